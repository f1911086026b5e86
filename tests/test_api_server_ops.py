"""``rlserve serve --api-server-count 2`` as an operator sees it (rlserve/server/multi_api.py), on a tiny
random llama, CPU, with the user's ``PROMETHEUS_MULTIPROC_DIR``:

* start-up: API process 1 is started with the engine core, before process 0's engine is ready (process 0
  logs "API server process 1 started" before "engine replica 0 ready"; until session 25 it started only
  once process 0's app was built);
* every log line of each API process starts with vLLM's ``(ApiServer_i pid=P)``, rlserve's lines and
  uvicorn's ("Started server process", the access lines);
* the metric files live in the user's directory (vLLM's warning says it is not cleaned) and stay there
  after the server stopped;
* a stopped (SIGSTOP: hung) API process 1: a ``/pause?timeout=3`` asked of process 0 answers 504
  ``api_server_timeout`` (OpenAI-style JSON) naming API server 1, its pid and "stopped", and is undone
  (``/is_paused`` false; process 0 generates HF's greedy tokens meanwhile); once process 1 runs again
  (SIGCONT) a pause and a resume succeed and both processes generate HF's greedy tokens.

Every wait is bounded by ``T`` (a hang, not a speed limit); the 504 comes from process 1 being stopped,
whatever the machine's load (a stopped process cannot apply the pause)."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from rlserve.proc_state import pid_alive
from rlserve.server.testing import ServerProcess
from tests.test_api_server_count import T, _children, _complete, _index, _pinned, _until
from tests.transfer_harness import greedy_continuation, load_hf

pytest.importorskip("openai")


def test_start_logs_metrics_dir_and_a_hung_api_server(tiny_model, tmp_path):
    path = tiny_model("llama")
    user_dir = tmp_path / "prom"
    srv = ServerProcess(path, "--api-server-count", "2", "--max-model-len", "256", "--device", "cpu",
                        env={"PROMETHEUS_MULTIPROC_DIR": str(user_dir)}).start()
    api1 = None
    try:
        hf = load_hf(path, scale=0.0)
        prompts = [[4, 50, 8, 70], [6, 31, 9, 12]]
        want = [greedy_continuation(hf, p, 8) for p in prompts]
        pid0 = srv.proc.pid
        api1 = next(p for p in _children(pid0) if "core_proc" not in open(f"/proc/{p}/cmdline").read())
        by = _pinned(srv.url)
        for i in (0, 1):
            assert _complete(by[i][0], path, prompts[0], 8, i == 1)[0] == want[0], i

        log = srv.log_tail(100_000_000).splitlines()
        # process 1 started beside the engine core's start, before process 0's engine was ready
        started = next(k for k, ln in enumerate(log) if f"API server process 1 started (pid {api1})" in ln)
        ready0 = next(k for k, ln in enumerate(log) if ln.startswith(f"(ApiServer_0 pid={pid0}) ")
                      and "engine replica 0 ready in process" in ln)
        assert started < ready0, log[:ready0 + 1]
        # each process's lines carry its prefix: rlserve's and uvicorn's
        for i, pid in ((0, pid0), (1, api1)):
            mine = [ln for ln in log if ln.startswith(f"(ApiServer_{i} pid={pid}) ")]
            assert any(re.search(r"\) \d{4}-\d\d-\d\d [\d:,]+ INFO rlserve\.serve: ", ln) for ln in mine), i
            assert any(ln.endswith(f"INFO:     Started server process [{pid}]") for ln in mine), i
            assert any(' - "GET /metrics HTTP/1.1" 200' in ln for ln in mine), i  # (the access lines)
        assert not [ln for ln in log if ln.startswith("INFO:")], "a uvicorn line without the prefix"
        # the user's directory holds the metric files; vLLM's warning, once
        assert [ln for ln in log if "PROMETHEUS_MULTIPROC_DIR" in ln and "not cleaned" in ln][0].startswith(
            f"(ApiServer_0 pid={pid0}) ")
        assert len([ln for ln in log if "not cleaned" in ln]) == 1
        assert any(name.endswith(".db") for name in os.listdir(user_dir))

        # API process 1 hung: the pause asked of process 0 (every new connection goes to it: process 1
        # cannot accept) fails at its timeout, names process 1, and is undone
        os.kill(api1, signal.SIGSTOP)
        with httpx.Client(base_url=srv.url, timeout=T) as c0:
            assert _index(c0) == 0
            r = c0.post("/pause", params={"mode": "keep", "timeout": 3})
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["code"] == "api_server_timeout" and err["type"] == "timeout_error", err
            assert f"API server 1 (pid {api1}, stopped (SIGSTOP or SIGTSTP)) did not apply API server 0's pause " \
                   f"(mode=keep) within 3 s" in err["message"], err
            assert err["message"].endswith("it was undone: generation continues"), err
            assert c0.get("/is_paused").json()["is_paused"] is False
            assert c0.get("/health").status_code == 200  # process 0 serves
            assert _complete(c0, path, prompts[1], 8, False)[0] == want[1]
        os.kill(api1, signal.SIGCONT)
        # process 1 applies the undone pause and its undoing in order; a pause and a resume then succeed
        by = _pinned(srv.url, [c for cs in by.values() for c in cs])
        r = by[1][0].post("/pause", params={"mode": "keep"})
        assert r.status_code == 200, r.text
        assert by[0][0].get("/is_paused").json()["is_paused"] is True
        assert by[1][1].post("/resume").status_code == 200
        for i in (0, 1):
            assert _complete(by[i][2], path, prompts[1], 8, i == 0)[0] == want[1], i

        pids = [pid0] + _children(pid0)
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(T)
        _until(lambda: not any(pid_alive(p) for p in pids), "every server process gone")
        assert any(name.endswith(".db") for name in os.listdir(user_dir))  # the user's: not removed
    finally:
        if api1 is not None and pid_alive(api1):
            os.kill(api1, signal.SIGCONT)
        srv.stop()
