"""Trainer liveness: notice a dead trainer in about a second, not after ``timeout_s``.

The trainer's rank 0 hosts the transfer group's ``TCPStore`` (gloo / NCCL, ``rank_offset`` 1;
the SDK's ipc engine hosts one for this purpose only). The store's server runs on C++ threads
of the trainer's process, without Python's GIL: it answers as long as that process lives,
whatever the trainer's Python is doing, and its socket closes the moment the process dies
(SIGKILL, OOM kill, crash). :class:`StoreLiveness` holds a client connection of its own to that
store and sends a tiny ``check`` request every ``interval_s``: a closed connection fails the
next request at once ("Failed to recv, got 0 bytes" / "Broken pipe", measured ~20 ms after a
SIGKILL on this machine), and a store that stops answering (the trainer's host is gone: no FIN
ever arrives, and a TCPStore client request then blocks without any bound) is noticed when one
request stays unanswered for ``unresponsive_s``.

Why this signal (measured with gloo on CPU, see ``benchmarks/kill_matrix.py``): gloo reports a
dead peer only when a receive is posted on the broken pair at the right moment (often it never
does: the receive then waits for the backend's own timeout), NCCL never does (its kernels spin),
and ipc has no connection at all; the HTTP connection of ``/update_weights`` exists only while
that call runs, not between ``start``, ``update`` and ``finish``. The store connection exists
from the rendezvous to the teardown, for every backend.

A live but stuck trainer (its store answers, no data comes) is still bounded by ``timeout_s``.

Interface (:class:`PeerLiveness`): ``start()``, ``gone()`` (``None`` while alive, else why),
``stop()``. The manager (:mod:`rlserve.transfer.manager`) polls ``gone()`` during every open
update and fails it the way a broken transfer fails.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Protocol

logger = logging.getLogger(__name__)

#: Seconds between two probes of the trainer's store (one ~0.1 ms request each).
DEFAULT_INTERVAL_S = 0.25
#: Seconds one probe may stay unanswered before the trainer counts as gone (its host vanished
#: without closing the connection). Much longer than a probe takes even on a loaded machine
#: (~0.1 ms; the store's server threads need no GIL), much shorter than the default timeout_s.
DEFAULT_UNRESPONSIVE_S = 15.0
#: The key the probe asks about; it is never written.
PROBE_KEY = "rlserve/liveness/probe"


class PeerLiveness(Protocol):
    """What the manager needs from a liveness watch."""

    def start(self) -> None:
        """Begin watching (returns at once)."""

    def gone(self) -> str | None:
        """``None`` while the peer is (as far as known) alive, else a sentence saying why it is
        taken for dead."""

    def stop(self) -> None:
        """Stop watching and release the connection (never blocks)."""


class StoreLiveness:
    """Watch a trainer through the ``TCPStore`` its process hosts.

    Args:
        host / port: the store (``init_info.master_address`` / ``master_port``).
        interval_s: seconds between probes.
        unresponsive_s: a probe (or the connection) unanswered this long means gone.
        connect_timeout_s: the store client's own timeout for connecting (seconds).

    ``start()`` connects on a daemon thread and probes until ``stop()`` or the first failure;
    :meth:`gone` never blocks. :meth:`wait_connected` lets a caller require the connection
    (ipc: a ``master_port`` that names no store is refused at init).
    """

    def __init__(self, host: str, port: int, interval_s: float = DEFAULT_INTERVAL_S,
                 unresponsive_s: float = DEFAULT_UNRESPONSIVE_S, connect_timeout_s: float = 10.0):
        self.host, self.port = host, int(port)
        self.interval_s = float(interval_s)
        self.unresponsive_s = float(unresponsive_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._reason: str | None = None
        self._busy_since: float | None = None  # monotonic start of the request in flight
        self._thread: threading.Thread | None = None
        self.probes = 0

    def __repr__(self) -> str:
        return f"StoreLiveness({self.host}:{self.port})"

    def start(self) -> None:
        self._busy_since = time.monotonic()  # the connection counts as a request in flight
        self._thread = threading.Thread(target=self._run, name="rlserve-trainer-liveness", daemon=True)
        self._thread.start()

    def wait_connected(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for the connection; ``True`` once connected."""
        deadline = time.monotonic() + timeout_s
        while not self._connected.is_set():
            if self._reason is not None or time.monotonic() > deadline:
                return False
            self._connected.wait(0.01)
        return True

    def gone(self) -> str | None:
        if self._reason is not None:
            return self._reason
        since = self._busy_since
        if since is not None and not self._stop.is_set():
            waited = time.monotonic() - since
            if waited > self.unresponsive_s:
                what = "a liveness probe" if self._connected.is_set() else "connecting"
                self._reason = (f"the trainer's TCPStore at {self.host}:{self.port} did not answer {what} for "
                                f"{waited:.1f} s (its host or process is gone)")
        return self._reason

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, None, False, timedelta(seconds=self.connect_timeout_s),
                                  wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - the store is not there: the trainer is gone
            if not self._stop.is_set():
                self._reason = f"the trainer's TCPStore at {self.host}:{self.port} cannot be reached ({e})"
            return
        self._connected.set()
        try:
            while not self._stop.is_set():
                self._busy_since = time.monotonic()
                try:
                    store.check([PROBE_KEY])
                except Exception as e:  # noqa: BLE001 - the connection closed: the process died
                    if not self._stop.is_set():
                        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        self._reason = (f"the trainer's TCPStore at {self.host}:{self.port} closed its connection "
                                        f"(the trainer process died): {first[:200]}")
                    return
                self._busy_since = None
                self.probes += 1
                self._stop.wait(self.interval_s)
        finally:
            del store
