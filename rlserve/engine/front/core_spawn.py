"""Where and how an engine-core process starts (for :class:`rlserve.engine.front.core_client.CoreProcReplica`):
from one spawner thread that lives as long as this process (:func:`spawn`), or handed its arguments when it
was started earlier, before they were known (:func:`prestart_cores`, :func:`take_prestarted`); and the
directory of its two ZMQ sockets (:func:`socket_dir`), with the leftovers of dead servers removed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import select
import subprocess
import sys
import threading

import msgspec

logger = logging.getLogger(__name__)


class _Spawner:
    """Starts the engine-core processes from one daemon thread that lives as long as this
    process. A core asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG`` in
    :func:`rlserve.engine.core.core_proc.die_with_parent`), and Linux counts the *thread* that forked
    it as that parent: a core started from a thread that then ended (an ``AsyncEngine`` built in
    a worker thread) was SIGKILLed at once. Started from here, it dies with the process only."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = None
        self._pid = None  # the process the thread runs in (a forked child needs its own)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """``subprocess.Popen(cmd, **kw)`` on the spawner thread; raises what it raises."""
        import queue

        with self._lock:
            if self._pid != os.getpid():
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=self._run, args=(self._queue,), name="rlserve-core-spawner",
                                 daemon=True).start()
            q = self._queue
        fut: concurrent.futures.Future = concurrent.futures.Future()
        q.put((fut, cmd, kw))
        return fut.result()

    @staticmethod
    def _run(q) -> None:
        while True:
            fut, cmd, kw = q.get()
            try:
                fut.set_result(subprocess.Popen(cmd, **kw))
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)


_SPAWNER = _Spawner()


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)`` from the spawner thread (:class:`_Spawner`); raises what it raises."""
    return _SPAWNER.popen(cmd, **kw)

#: replica index -> an engine-core process started before its arguments were known (:func:`prestart_cores`)
_PRESTARTED: dict[int, subprocess.Popen] = {}


def prestart_cores(count: int, device: str = "auto") -> None:
    """Start ``count`` engine-core processes now (replicas ``0..count-1``), before this process knows their
    arguments: each imports the engine (torch, transformers, the model code: seconds) while this process
    still imports and checks its own, then waits for its arguments on stdin, which
    :meth:`rlserve.engine.front.core_client.CoreProcReplica.start` writes (``rlserve serve`` calls this first; a replica that finds none starts
    its process then, as before). Unused ones are killed at exit (:func:`discard_prestarted`) and exit by
    themselves at their stdin's end. ``device``: the server's ``--device`` (``cpu``: the cores skip the CUDA
    and Triton part of :func:`rlserve.engine.core.core_proc.warm_up_imports`)."""
    import atexit

    for i in range(count):
        if i in _PRESTARTED:
            continue
        try:
            _PRESTARTED[i] = spawn([sys.executable, "-m", "rlserve.engine.core.core_proc", "--prestarted",
                                             device],
                                            start_new_session=True, stdin=subprocess.PIPE)
        except OSError:
            logger.debug("could not prestart engine-core process %d", i, exc_info=True)
            return
    atexit.register(discard_prestarted)


def discard_prestarted() -> None:
    """Kill the prestarted engine-core processes no replica took (a start that failed before them)."""
    while _PRESTARTED:
        _, p = _PRESTARTED.popitem()
        with contextlib.suppress(OSError):
            p.kill()
            p.wait(5)


def take_prestarted(index: int, cmd: list[str]) -> subprocess.Popen | None:
    """Replica ``index``'s prestarted process, handed ``cmd``'s arguments (after ``-m module``), or None."""
    import json

    p = _PRESTARTED.pop(index, None)
    if p is None:
        return None
    try:
        if p.poll() is not None:
            raise OSError(f"exited with {p.returncode}")
        p.stdin.write((json.dumps(cmd[3:]) + "\n").encode())
        p.stdin.close()
    except (OSError, ValueError):
        logger.debug("prestarted engine-core process %d not usable", index, exc_info=True)
        with contextlib.suppress(OSError):
            p.kill()
            p.wait(5)
        return None
    return p


SOCKET_DIR_PREFIX = "rlserve-core-"


def client_addresses(directory: str, client_index: int = 0) -> tuple[str, str]:
    """The ZMQ ``(input, output)`` addresses of API process ``client_index`` for the core whose
    socket directory is ``directory`` (``--api-server-count``; process 0's are ``in`` / ``out``,
    as with one API process)."""
    suffix = f"-{client_index}" if client_index else ""
    return f"ipc://{directory}/in{suffix}", f"ipc://{directory}/out{suffix}"


def core_command(directory: str, dp_index: int, weight_version: str, config, api_server_count: int = 1) -> list[str]:
    """The command line of replica ``dp_index``'s engine-core process (``python -m
    rlserve.engine.core.core_proc``) whose sockets live in ``directory``: process 0's input and
    output, then ``--client-input`` / ``--client-output`` of API processes 1..``api_server_count``-1;
    ``config`` (an ``EngineConfig``) travels as JSON, the log level is this process's."""
    in_addr, out_addr = client_addresses(directory)
    cmd = [sys.executable, "-m", "rlserve.engine.core.core_proc", "--input", in_addr, "--output", out_addr,
           "--dp-index", str(dp_index), "--parent-pid", str(os.getpid()), "--weight-version", weight_version,
           "--config", msgspec.json.encode(config).decode(),
           "--log-level", logging.getLevelName(logging.getLogger("rlserve").getEffectiveLevel()).lower()]
    for i in range(1, api_server_count):
        client_in, client_out = client_addresses(directory, i)
        cmd += ["--client-input", client_in, "--client-output", client_out]
    return cmd


def wait_exit(proc: subprocess.Popen, pidfd: int | None, timeout_s: float) -> bool:
    """Whether ``proc`` has ended (and is reaped) within ``timeout_s`` seconds. Woken by its ``pidfd``
    the moment it ends (``Popen.wait`` alone polls, up to 50 ms late); without one (None), polled."""
    if pidfd is not None:
        if not select.select([pidfd], [], [], timeout_s)[0]:
            return False
        timeout_s = max(timeout_s, 1.0)  # it has ended: only its reaping (maybe by the reader) is left
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def socket_dir(root: str | None = None) -> str:
    """A new directory for one core's two ZMQ ``ipc://`` sockets, ``<tmp>/rlserve-core-<pid>-XXXX``
    after this process, the ones of processes that are gone removed first (a SIGKILLed server cannot
    remove its own: its core is SIGKILLed too, by ``PR_SET_PDEATHSIG``): :func:`rlserve.pid_dirs.pid_dir`.

    Args:
        root: where (default ``tempfile.gettempdir()``).
    """
    from rlserve.pid_dirs import pid_dir

    return pid_dir(SOCKET_DIR_PREFIX, root)
