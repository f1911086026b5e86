"""A process's state as the kernel has it now, from one read of ``/proc/PID/stat`` (Linux; see
proc(5)): :func:`pid_alive` (exists and is not a zombie) and :func:`pid_ending` (gone, exited,
exiting, or sent a SIGKILL it has not acted on yet, and how it ends). Used where a flag another thread sets a
moment later is not good enough: ``/health`` right after its engine-core process was killed
(:meth:`rlserve.engine.front.core_client.CoreProcReplica.ended_now`), and by the launchers and
tests that wait for processes to go."""

from __future__ import annotations

import os
import signal

#: ``PF_EXITING`` of the task's flags (include/linux/sched.h): set as the process starts its exit,
#: before the kernel frees its memory (seconds for a large CUDA process) and it becomes a zombie
PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name: ``[0]`` is the state (proc(5)'s
    field 3), ``[6]`` the flags (field 9), ``[28]`` the pending signals (field 31), ``[49]`` the
    exit code in ``waitpid``'s form (field 52, set as the exit begins). ``None`` when there is no
    such process or no ``/proc`` (:data:`HAS_PROC`)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


#: whether this system has a Linux ``/proc``
HAS_PROC = os.path.exists("/proc/self/stat")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (``/proc/PID/stat``'s state field; without
    ``/proc``: while it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    if fields is None:
        return not HAS_PROC
    return fields[0] != "Z"


def exit_text(rc: int | None) -> str:
    """A process's end in words from a ``Popen.returncode`` (``-signal`` when a signal killed it):
    ``"was killed by SIGKILL"``, ``"exited with code 1"``; ``"is gone"`` for ``None``."""
    if rc is None:
        return "is gone"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def _returncode(wait_status: int) -> int:
    """``waitpid``'s status as a ``Popen.returncode`` (``-signal`` for a signal's kill)."""
    return -(wait_status & 0x7F) if wait_status & 0x7F else (wait_status >> 8) & 0xFF


def pid_ending(pid: int) -> str | None:
    """Why process ``pid`` will not run on, in :func:`exit_text`'s words, read now; ``None`` while
    it runs (and without ``/proc``).

    Returns:
        ``"is gone"`` (no such process, or reaped); for one that has ended (a zombie) or has begun
        its exit (``PF_EXITING``: the kernel may take seconds to free a large process's memory),
        how: ``"was killed by SIGKILL"``, ``"exited with code 1"`` (``"is exiting"`` in the moment
        before the kernel records the code); ``"was killed by SIGKILL"`` too for a SIGKILL still
        pending (``kill -9`` sets it before it returns, and it cannot be caught).
    """
    fields = stat_fields(pid)
    if fields is None:
        return "is gone" if HAS_PROC else None
    try:
        state, flags, pending = fields[0], int(fields[6]), int(fields[28])
        code = int(fields[49]) if len(fields) > 49 else 0
    except (IndexError, ValueError):
        return None
    if state in ("Z", "X", "x") or (flags & PF_EXITING and code):
        return exit_text(_returncode(code))
    if flags & PF_EXITING:
        return "is exiting"
    if pending & _SIGKILL_BIT:
        return exit_text(-signal.SIGKILL)
    return None


def child_ended(pid: int) -> str | None:
    """:func:`pid_ending` for a child process of this one; without ``/proc``, its exit status
    read without reaping it (``waitid`` with ``WNOWAIT``: its ``Popen`` still collects it).
    ``None`` while it runs."""
    if HAS_PROC:
        return pid_ending(pid)
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError, AttributeError):
        return None
    if info is None:
        return None
    return exit_text(-info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status)


def child_processes(pid: int) -> list[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of every live child of process ``pid``, read from ``/proc`` (empty without it;
    a child that ends meanwhile is left out)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for d in names:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out.append((int(d), f.read().split(b"\0")))
        except (OSError, ValueError, IndexError):
            continue
    return out
