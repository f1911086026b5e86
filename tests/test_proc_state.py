"""rlserve.proc_state: a process's state as the kernel has it now (``/proc/PID/stat``): alive,
and why one will not run on (killed, exited, exiting), read the moment after the event."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rlserve.proc_state import HAS_PROC, child_ended, exit_text, pid_alive, pid_ending

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _ended_unreaped(p: subprocess.Popen) -> None:
    """Wait until ``p`` has ended, leaving it unreaped (a zombie)."""
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)


def test_pid_alive_says_false_for_a_zombie_and_a_reaped_process():
    """The one /proc state reader (rlserve.demo and benchmarks/startup_stop.py import it): a
    running child is alive, the same child killed but not reaped (a zombie: its memory is freed)
    is not, nor once reaped."""
    p = subprocess.Popen(SLEEPER)
    try:
        assert pid_alive(p.pid)
        p.kill()
        _ended_unreaped(p)
        assert not pid_alive(p.pid)
    finally:
        p.kill()
        p.wait()
    assert not pid_alive(p.pid)
    import rlserve.demo

    assert rlserve.demo.pid_alive is pid_alive


@pytest.mark.skipif(not HAS_PROC, reason="reads /proc (Linux)")
def test_pid_ending_knows_a_kill_as_soon_as_kill_returns():
    """Right after ``kill -9`` returns (no wait), the process reads as killed: the SIGKILL is
    pending, or its exit has begun (``is exiting`` only in the moment before the kernel records
    the signal) or ended. A running one reads None, a reaped one ``is gone``."""
    p = subprocess.Popen(SLEEPER)
    try:
        assert pid_ending(p.pid) is None and child_ended(p.pid) is None
        os.kill(p.pid, signal.SIGKILL)
        assert pid_ending(p.pid) in ("was killed by SIGKILL", "is exiting")
        _ended_unreaped(p)
        assert pid_ending(p.pid) == child_ended(p.pid) == "was killed by SIGKILL"
    finally:
        p.kill()
        p.wait()
    assert pid_ending(p.pid) == "is gone"


@pytest.mark.parametrize("code,rc", [("import sys; sys.exit(3)", 3), ("pass", 0),
                                     ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM)])
def test_child_ended_gives_the_exit_status_before_the_reap(code, rc):
    """An ended child's status, in Popen.returncode's words, without reaping it (its Popen
    still collects the same status)."""
    p = subprocess.Popen([sys.executable, "-c", code])
    _ended_unreaped(p)
    assert child_ended(p.pid) == exit_text(rc)
    assert p.wait() == rc
