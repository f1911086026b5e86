"""Test servers never outlive the test run that started them (rlserve.server.launch): a pytest run
that started a TP=2 ``rlserve serve`` (API process, engine-core process, TP follower) is killed
with SIGKILL -- no fixture teardown, no atexit -- and every one of those processes must go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rlserve.demo import pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD_TEST = textwrap.dedent("""
    import os, time
    from rlserve.server.testing import ServerProcess

    def test_hold_a_server():
        srv = ServerProcess(os.environ["CLEANUP_MODEL"], "--device", "cpu", "--dtype", "float32",
                            "--load-format", "dummy", "--max-model-len", "64", "--kv-cache-bytes", str(2 << 20),
                            "--tensor-parallel-size", "2", "--disable-access-log").start()
        with open(os.environ["CLEANUP_PID_FILE"] + ".tmp", "w") as f:
            f.write(str(srv.proc.pid))
        os.rename(os.environ["CLEANUP_PID_FILE"] + ".tmp", os.environ["CLEANUP_PID_FILE"])
        time.sleep(600)  # killed long before
""")


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process (Linux /proc)."""
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def _descendants(pid: int) -> list[int]:
    kids, todo, seen = _children(), [pid], []
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            seen.append(c)
            todo.append(c)
    return seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_pytest_leaves_no_server_behind(tiny_model, tmp_path):
    model = tiny_model("llama")  # 4 query / 2 KV heads: TP=2 splits them
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    pid_file = tmp_path / "server.pid"
    env = dict(os.environ, CLEANUP_MODEL=model, CLEANUP_PID_FILE=str(pid_file), PYTHONPATH=ROOT)
    log = open(tmp_path / "pytest.log", "w")
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
                              str(tmp_path / "test_child.py")], cwd=tmp_path, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    server_pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists():
            assert child.poll() is None, (tmp_path / "pytest.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the child's server did not start in 300 s"
            time.sleep(0.1)
        server = int(pid_file.read_text())
        server_pids = [server, *_descendants(server)]
        # the API process, its engine core and the core's TP follower (at least)
        assert len(server_pids) >= 3, server_pids
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        deadline = time.monotonic() + 120
        while alive := [p for p in server_pids if pid_alive(p)]:
            assert time.monotonic() < deadline, f"left behind after the test run was killed: {alive}"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait(30)
        for p in server_pids:  # whatever failed above: leave nothing running
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        log.close()
