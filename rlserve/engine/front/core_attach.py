"""An engine core that another API process started: :class:`AttachedCoreReplica`, the replica of
API processes 1..N-1 of ``rlserve serve --api-server-count N``.

API process 0 starts each engine-core process (:class:`~rlserve.engine.front.core_client.CoreProcReplica`
with ``api_server_count=N``) and tells it the input / output addresses of every other API process
(in its socket directory, :func:`~rlserve.engine.front.core_spawn.client_addresses`). Process ``i``
binds its two sockets there under its own index (the core has been connecting since its start:
its ready message waits in the pipe), then sends its requests (``AddRequest.client_index = i``)
and receives their outputs exactly as process 0 does: the reader thread, the output processing and
the routing to the requests are :class:`CoreProcReplica`'s. What differs:

* no process is started and none is stopped: the core belongs to process 0 (and dies with it, by
  ``PR_SET_PDEATHSIG``); :meth:`stop` aborts this process's requests in the core, :meth:`join`
  closes the sockets. The core's end is seen by polling its pid (it is not this process's child).
* no utility calls: pause, sleep, weight updates and every other call into the cores are process
  0's (the control routes are forwarded to it, :mod:`rlserve.server.multi_api`); a call here raises
  ``RuntimeError``. The admission state process 0 decides arrives as
  :class:`~rlserve.engine.core_protocol.FrontState` (:mod:`rlserve.engine.front.front_sync`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib

from rlserve.engine import core_protocol as proto
from rlserve.engine.front.core_client import CoreProcReplica
from rlserve.engine.front.replica import failed_future, prefetch_tokenizer
from rlserve.errors import EngineDeadError
from rlserve.proc_state import pid_alive


class _CoreProcess:
    """``Popen``'s ``pid`` / ``poll`` / ``returncode`` for a core that is not this process's child:
    ``poll()`` is None while it runs, then True (its exit status is its parent's to read:
    ``returncode`` stays None, "is gone" in the replica's words), or once this side closes."""

    def __init__(self, pid: int, replica: "AttachedCoreReplica"):
        self.pid = pid
        self.returncode = None
        self._replica = replica

    def poll(self):
        return True if self._replica._closing or not pid_alive(self.pid) else None

    def kill(self) -> None:
        """Not ours to kill: a failure on this side ends this side's reader only."""
        self._replica._closing = True


class AttachedCoreReplica(CoreProcReplica):
    """Replica ``index`` in API process ``client_index`` > 0, on the core API process 0 started
    (arguments as :class:`CoreProcReplica`'s; ``core_dir``: that core's socket directory)."""

    def start(self) -> None:
        """Nothing to start (the sockets were bound at construction): the tokenizer starts loading on a
        thread, as in process 0, while the core may still be starting (processes 1..N-1 start beside it)."""
        self._pidfd = None  # the reader polls (every 100 ms) the pid it learns from the ready message
        prefetch_tokenizer(self._tokenizer_loader)

    def wait_ready(self, timeout_s: float) -> None:
        self.proc = _Waiting()
        super().wait_ready(timeout_s)  # the ready message the core sent at its start
        self.proc = _CoreProcess(self._view.info.pid, self)

    def _call(self, method: str, *args) -> concurrent.futures.Future:
        return failed_future(RuntimeError(f"API server {self.client_index}: engine-core calls ({method}) are made by "
                                          "API server 0, which owns the control state"))

    def abort(self, request_ids) -> concurrent.futures.Future:
        self.abort_nowait(request_ids)  # (its final outputs come back here, as an answered abort's)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done

    def set_weight_version(self, version: str) -> None:
        """The core stamps API process 0's version; nothing to send from here."""
        self._version = version

    def set_quarantined(self, quarantined: bool) -> None:
        """Process 0's to lift."""

    def _handle(self, msg) -> None:
        if isinstance(msg, proto.CoreExiting):  # API process 0 stopped it: the server stops (not a death)
            self._closing = True
        super()._handle(msg)

    def stop(self) -> None:
        """This API process stops: its requests in the core are aborted (the core serves on)."""
        if self._closing:
            return
        with contextlib.suppress(EngineDeadError):
            if self.reqs:
                self.abort_nowait(list(self.reqs))
        self._closing = True

    def join(self, timeout_s: float) -> None:
        self._closing = True
        self._close(timeout_s)


class _Waiting:
    """The core's process before its ready message names its pid: running, as far as we know."""

    pid = None
    returncode = None

    @staticmethod
    def poll():
        return None
