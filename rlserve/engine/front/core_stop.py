"""Stopping an engine-core process: :class:`CoreProcStop`, the stop half of
:class:`~rlserve.engine.front.core_client.CoreProcReplica` (a mixin: the replica's sockets, reader thread,
``proc`` and pidfd are its own; this part sends Shutdown, waits for the process, kills its process group when
it is late, and closes what is left).

Order: :meth:`CoreProcStop.stop` sends Shutdown (never blocks), :meth:`CoreProcStop.join` waits at most its
timeout: a core that has not said it is exiting :data:`_KILL_AFTER_S` after the Shutdown is killed with its TP
workers; then the reader ends, pending calls and routed requests fail with
:class:`~rlserve.errors.EngineDeadError`, and the sockets and the sockets' directory go.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time

from rlserve.engine import core_protocol as proto
from rlserve.engine.front import core_spawn
from rlserve.errors import EngineDeadError

logger = logging.getLogger("rlserve.engine.front.core_client")

#: a core that has neither exited nor said it is exiting (``CoreExiting``) this long after
#: Shutdown was sent is killed, with its TP workers (seconds). Nothing is lost by it: its requests
#: have ended by then (503), and the kernel frees its memory (GPU memory included) either way. A
#: core mid-step sees Shutdown only after the step: on a loaded 2-core CPU a 6000-token SmolLM2
#: prefill in flight kept it 1.3-1.6 s after a Ctrl-C, and waiting it out put the server's stop at
#: 1.7-1.9 s (BENCHMARKS.md, "Stop of rlserve serve with engine-core processes"). An idle core
#: leaves its loop in milliseconds; its process then takes as long as the kernel needs to free
#: its memory (0.2-0.3 s for SmolLM2 fp32 at load), which a kill would not shorten: a core that
#: said it is exiting is waited for (up to ``join``'s timeout), not killed.
_KILL_AFTER_S = 0.25


class CoreProcStop:
    """The stop path of a core-process replica (mixed into ``CoreProcReplica``, whose ``__init__`` sets
    ``_closing``, ``_stop_t``, ``proc``, ``_pidfd``, ``_reader``, ``_send_lock``, ``_in`` / ``_out`` / ``_ctx``,
    ``_dir``, ``exiting`` and ``alive``; ``_send``, ``_fail_calls``, ``_dead`` and ``fail_routed`` are its own)."""

    def stop(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop_t = time.monotonic()
        try:
            self._send(proto.Shutdown())
        except EngineDeadError:
            pass

    def join(self, timeout_s: float) -> None:
        """Wait for the core to exit, at most ``timeout_s``. A core that has not said it is
        exiting (:attr:`exiting`) by :data:`_KILL_AFTER_S` after :meth:`stop` sent it Shutdown
        (the signal's time, on a server's Ctrl-C) is killed with its process group; one that has
        is waited for, its process's end being the kernel's teardown. Then close the sockets and
        end the reader."""
        if self.proc is not None:
            t0 = time.monotonic()
            since = 0.0 if self._stop_t is None else t0 - self._stop_t
            if not self._wait_exit(max(0.0, min(timeout_s, _KILL_AFTER_S - since))) and self.exiting.is_set():
                self._wait_exit(max(0.0, timeout_s - (time.monotonic() - t0)))
            if self.proc.poll() is None:  # mid-step, or stuck: kill (not an error)
                logger.debug("engine replica %d did not exit %.2f s after its shutdown (%s): killing it", self.index,
                             since + time.monotonic() - t0,
                             "it said it was exiting" if self.exiting.is_set() else "still in its loop")
            self._reap()
        self._close(timeout_s)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _close(self, timeout_s: float) -> None:
        """End the reader (``timeout_s`` at most), fail what is left, close the sockets."""
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout_s)
        with self._send_lock:
            self.alive = False
        self._fail_calls()
        self.fail_routed(self._dead())
        for s in (self._in, self._out):
            s.close(linger=0)
        self._ctx.term()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _wait_exit(self, timeout_s: float) -> bool:
        """Whether the core's process has ended within ``timeout_s`` seconds (:func:`core_spawn.wait_exit`)."""
        return core_spawn.wait_exit(self.proc, self._pidfd, timeout_s)

    def _reap(self) -> None:
        """Kill the core's process group (the core and its TP workers) if still there; wait."""
        self._closing = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - an unkillable process
            logger.error("engine-core process %d does not exit", self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # TP workers left in its group
        except OSError:
            pass
