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

from rlserve.proc_state import pid_alive

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


# ---- the start's time bound: a starved start is not a hang (session 16's "not healthy within 180 s")
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_start_clock_waits_for_a_starved_start_and_ends_a_spin_or_a_stall():
    """StartClock with a fake clock and CPU reading (seconds): a start past its 100 s timeout
    that keeps getting a little CPU goes on; one whose processes used 25 CPU-s (STARVED_SHARE of
    the timeout) ends; one that used no CPU for STALL_S ends; MAX_STRETCH ends any. The old
    wait ended every one at 100 s."""
    from rlserve.server import launch

    clock, cpu = _Clock(), {"s": 0.0}
    starved = launch.StartClock(1, 100.0, cpu=lambda pid: cpu["s"], clock=clock)
    for t in range(0, 700, 2):  # 0.02 of a core: 14 CPU-s by 700 s (a 13 CPU-s start gets done)
        clock.t, cpu["s"] = float(t), 0.02 * t
        assert starved.expired() is None, t
    clock.t, cpu["s"] = 0.0, 0.0
    spin = launch.StartClock(1, 100.0, cpu=lambda pid: cpu["s"], clock=clock)
    clock.t, cpu["s"] = 100.0, 24.9
    assert spin.expired() is None  # not past the timeout yet
    clock.t, cpu["s"] = 101.0, 25.0
    assert "used 25.0 s of CPU: not a starved start" in spin.expired()
    clock.t, cpu["s"] = 0.0, 3.0
    stall = launch.StartClock(1, 100.0, cpu=lambda pid: cpu["s"], clock=clock)
    for t in range(101, 101 + int(launch.STALL_S)):
        clock.t = float(t)
        assert stall.expired() is None, t
    clock.t = 101.0 + launch.STALL_S
    assert "used no CPU for 60 s: hung" in stall.expired()
    clock.t, cpu["s"] = 0.0, 0.0
    capped = launch.StartClock(1, 100.0, cpu=lambda pid: cpu["s"], clock=clock)
    clock.t, cpu["s"] = 1000.5, 1.0
    assert "nor within 1000 s" in capped.expired()
    clock.t = 0.0
    no_proc = launch.StartClock(1, 100.0, cpu=lambda pid: None, clock=clock)
    clock.t = 100.5
    assert no_proc.expired() == "within 100 s"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="/proc")
def test_tree_cpu_seconds_counts_the_descendants(tmp_path):
    """A child that ran a CPU-burning grandchild to its end (reaped: its parent's cutime) and
    a live grandchild that burns CPU: the tree's CPU covers both."""
    from rlserve.server.launch import tree_cpu_seconds

    burn = "import os\nx = 0\nfor i in range(10**7): x += i\nprint(sum(os.times()[:2]), flush=True)"
    code = ("import subprocess, sys, time\n"
            f"r = subprocess.run([sys.executable, '-c', {burn!r}], capture_output=True, text=True)\n"
            "open(sys.argv[1], 'w').write(r.stdout)\n"
            f"p = subprocess.Popen([sys.executable, '-c', {burn!r} + '\\nimport time\\ntime.sleep(600)'], "
            "stdout=open(sys.argv[2], 'w'))\n"
            "time.sleep(600)\n")
    done, live = tmp_path / "done", tmp_path / "live"
    p = subprocess.Popen([sys.executable, "-c", code, str(done), str(live)])
    try:
        deadline = time.monotonic() + 300  # a hang bound only
        while not (live.exists() and live.read_text().strip()):
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        reaped, running = float(done.read_text()), float(live.read_text())
        # each burner's own count (os.times, its user + system) is in the tree's, within a clock tick each
        assert tree_cpu_seconds(p.pid) >= reaped + running - 2 / os.sysconf("SC_CLK_TCK")
    finally:
        for q in _descendants(p.pid):
            os.kill(q, signal.SIGKILL)
        p.kill()
        p.wait()



SLOW_SERVER = textwrap.dedent("""
    import functools, http.server, os, sys, time
    t0 = time.monotonic()
    while time.monotonic() - t0 < float(sys.argv[2]):  # a start that gets little CPU: ~1% of a core
        sum(range(2000))
        time.sleep(0.05)
    os.makedirs(sys.argv[1] + ".d")
    with open(sys.argv[1] + ".d/health", "w") as f:  # GET /health: 200 (a static file)
        f.write("ok")
    srv = http.server.HTTPServer(("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler,
                                                                     directory=sys.argv[1] + ".d"))
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    srv.serve_forever()
""")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="/proc")
def test_wait_healthy_waits_past_its_timeout_for_a_starved_start_and_ends_a_spin(tmp_path):
    """A server process that uses ~1% of a core and answers /health 6 s after it started, waited
    for with a 3 s timeout: healthy (the old wait raised at 3 s: fails on the old code). A
    process that spins and never answers: ends once it used STARVED_SHARE x 1 s of CPU."""
    from rlserve.server.launch import ServerStartError, wait_healthy

    port_file = tmp_path / "port"

    def url():
        return f"http://127.0.0.1:{port_file.read_text()}" if port_file.exists() else None

    p = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, str(port_file), "6"])
    try:
        waited = wait_healthy(p, url, 3.0, lambda: "", poll_s=0.1)
        assert waited > 3.0 and port_file.exists()
    finally:
        p.kill()
        p.wait()
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with pytest.raises(ServerStartError, match="not a starved start"):
            wait_healthy(spin, lambda: None, 1.0, lambda: "", poll_s=0.1)
    finally:
        spin.kill()
        spin.wait()


def _core_children() -> list[int]:
    """Live engine-core processes that are children of this process."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"rlserve.engine.core.core_proc" in cmd and pid_alive(int(d)):
            out.append(int(d))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_in_process_server_fails_at_once_when_its_uvicorn_thread_ends(tiny_model, monkeypatch):
    """tests/transfer_harness.InProcessServer waits for /health by wait_healthy's rule
    (StartClock) and fails at once when the server is dead: here its uvicorn thread ends at
    once (the socket the harness hands it is one it cannot serve on: a datagram socket, so
    ``create_server`` raises). The old wait polled a fixed 120 s, then said only "did not start"
    (fails on the old code: the message). No engine-core process is left behind. (The harness
    binds its port itself, ``bound_socket``: no free_port() that another process could take
    before uvicorn listened, the "address already in use" this test used to provoke.)"""
    import socket

    from tests import transfer_harness

    def not_a_stream_socket() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        return s

    before = set(_core_children())  # (other tests' servers may still run: the shared weight-sync ones)
    monkeypatch.setattr(transfer_harness, "bound_socket", not_a_stream_socket)
    with pytest.raises(RuntimeError, match="uvicorn thread ended before /health answered"):
        transfer_harness.InProcessServer(tiny_model("llama"), engine_mode="process")
    assert not set(_core_children()) - before
