"""``benchmarks/vllm_serve.py``'s ``VLLMServer`` is a :class:`rlserve.server.launch.ServerSubprocess`
(one launcher: environment, log file, start-and-wait, stop, ``with``), started here against a
stand-in for vLLM's API server (a script that answers ``GET /health`` on the ``--port`` it is
given): the command line and environment vLLM would get, start, health, stop of the whole
process group; and a server that exits at start-up fails ``start`` with its log in the error."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import httpx
import pytest

from benchmarks.vllm_serve import VLLM_ENV, VLLMServer
from rlserve.demo import pid_alive
from rlserve.server.launch import ServerSubprocess

FAKE_VLLM = textwrap.dedent("""
    import http.server, json, os, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
        json.dump({"argv": args, "pythonpath": os.environ.get("PYTHONPATH"),
                   "env": {k: os.environ.get(k) for k in %r}}, f)
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("fake vllm: cannot start", flush=True)
        sys.exit(3)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
""" % (sorted(VLLM_ENV),))


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """An executable standing in for a vLLM virtualenv's Python: runs the fake server with the
    arguments it is given (``-m vllm.entrypoints.openai.api_server --model ...``)."""
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_vllm.py'} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    for k in VLLM_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")  # the caller's setting wins over the default
    return str(exe)


def test_vllm_server_shares_the_launcher():
    for name in ("log_tail", "__enter__", "__exit__", "pid", "_spawn", "_spawn_and_wait"):
        assert getattr(VLLMServer, name) is getattr(ServerSubprocess, name), name
    srv = VLLMServer("/models/m", ["--max-model-len", "64"], pythonpath="/opt/vsite")
    try:
        assert os.path.basename(srv.log_path).startswith("vllm-serve-") and os.path.exists(srv.log_path)
        assert srv.env["PYTHONPATH"] == "/opt/vsite" and srv.env["PATH"].startswith("/opt/vsite/bin" + os.pathsep)
        assert srv.env["PYTHONUNBUFFERED"] == "1" and srv.env["VLLM_NO_USAGE_STATS"] == "1"
        cmd = srv.command(8123)
        assert os.path.basename(cmd[0]) == "vllm" and cmd[1:] == ["serve", "/models/m", "--host", "127.0.0.1",
                                                                   "--port", "8123", "--max-model-len", "64"]
        assert srv.pid is None and srv.stop() is None  # never started
    finally:
        os.unlink(srv.log_path)


def test_vllm_server_starts_answers_and_stops(fake_python, tmp_path):
    with VLLMServer("/models/m", ["--dtype", "float32"], python=fake_python, startup_timeout_s=60) as srv:
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        port = srv.url.rsplit(":", 1)[1]
        pid = srv.pid
        assert pid_alive(pid)
    assert not pid_alive(pid) and srv.proc.returncode is not None
    assert srv.stop() == srv.proc.returncode  # idempotent
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["argv"] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m", "--host", "127.0.0.1",
                           "--port", port, "--dtype", "float32"]
    assert rec["pythonpath"] is None  # python mode: vLLM's own environment, not the caller's PYTHONPATH
    assert rec["env"] == dict(VLLM_ENV, VLLM_NO_USAGE_STATS="0")
    os.unlink(srv.log_path)


def test_vllm_server_that_exits_fails_start_with_its_log(fake_python, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    srv = VLLMServer("/models/m", [], python=fake_python, startup_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"(?s)vllm serve exited with status 3 .*fake vllm: cannot start"):
        srv.start()
    assert srv.url is None and srv.proc.returncode == 3 and srv.stop() == 3
    os.unlink(srv.log_path)
