"""Trainer liveness: notice a dead trainer in a fraction of a second, not after ``timeout_s``.

The trainer's rank 0 hosts the transfer group's ``TCPStore`` (gloo / NCCL with ``rank_offset``
1, vLLM's trainers included; the SDK's ipc engine hosts one for this purpose only). The store's
server runs on C++ threads of the trainer's process, and the kernel closes its sockets the
moment that process dies (SIGKILL, OOM kill, crash). :class:`StoreLiveness` opens one plain TCP
connection of its own to the store's port and never sends on it (the store's server keeps a
silent client: checked for minutes), and a thread waits for it to become readable: the store
never writes unprompted, so readable means end of file (the process died: seen within ~0.1 s of
a SIGKILL on this machine) or a socket error. TCP keepalive (``unresponsive_s``: first probe
after a third of it, then a probe every sixth, five unanswered probes) turns a host that
vanished without closing anything (power loss, a cut network) into a socket error too.

Why this signal (measured with gloo on CPU, ``benchmarks/kill_matrix.py``): gloo reports a dead
peer only when it notices on a pair with an operation pending (the issue's runs with 4 MiB and
1 GiB buckets waited for ``timeout_s`` instead), NCCL never does (its kernels spin), ipc has no
connection at all, and the HTTP connection of ``/update_weights`` exists only while that call
runs, not between ``start``, ``update`` and ``finish``. The store connection exists from the
rendezvous to the teardown, for every backend. (A TCPStore *client* was tried first: its
requests detect the close too, but each failure prints a C++ stack trace to the server's log,
and a request to a silent peer blocks without any bound.)

A live but stuck trainer (its process alive, no data coming) is still bounded by ``timeout_s``.
A trainer that forked children after the rendezvous (e.g. ``DataLoader`` workers) shares its
sockets with them: the connection ends when the last of them exits (``DataLoader`` workers
notice their parent's death within ~5 s) -- the same holds for gloo's own connections.

Interface (:class:`PeerLiveness`): ``start()``, ``gone()`` (``None`` while alive, else why),
``stop()``. The manager (:mod:`rlserve.transfer.server.manager`) polls ``gone()`` from init to
teardown and fails an open update the way a broken transfer fails.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Protocol

logger = logging.getLogger(__name__)

#: Seconds a silent, unreachable peer host may take to count as gone (TCP keepalive: no FIN or
#: RST ever arrives from a host that lost power). Far shorter than the default timeout_s.
DEFAULT_UNRESPONSIVE_S = 15.0
#: Longest the watch thread sleeps between looks at its stop flag (seconds).
_STOP_POLL_S = 0.5


class PeerLiveness(Protocol):
    """What the manager needs from a liveness watch."""

    def start(self) -> None:
        """Begin watching (returns at once)."""

    def gone(self) -> str | None:
        """``None`` while the peer is (as far as known) alive, else a sentence saying why it is
        taken for dead."""

    def stop(self) -> None:
        """Stop watching and release the connection (never blocks)."""


def _keepalive(sock: socket.socket, unresponsive_s: float) -> None:
    """TCP keepalive: first probe after ``unresponsive_s / 3`` idle seconds, then every
    ``unresponsive_s / 6``, five unanswered probes end the connection (~``unresponsive_s``)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(unresponsive_s / 3))
    opts = (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, int(unresponsive_s / 6))), ("TCP_KEEPCNT", 5))
    for name, value in opts:
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    if getattr(socket, "TCP_KEEPIDLE", None) is None and hasattr(socket, "TCP_KEEPALIVE"):  # macOS
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPALIVE, idle)


class StoreLiveness:
    """Watch a trainer through the ``TCPStore`` its process hosts.

    Args:
        host / port: the store (``init_info.master_address`` / ``master_port``).
        unresponsive_s: a peer host that vanished silently counts as gone after about this
            many seconds (TCP keepalive).
        connect_timeout_s: seconds for connecting.

    ``start()`` connects on a daemon thread and waits there for the connection to end;
    :meth:`gone` never blocks; :meth:`wait_connected` lets a caller require the connection
    (ipc: a ``master_port`` that names no store is refused at init).
    """

    def __init__(self, host: str, port: int, unresponsive_s: float = DEFAULT_UNRESPONSIVE_S,
                 connect_timeout_s: float = 10.0):
        self.host, self.port = host, int(port)
        self.unresponsive_s = float(unresponsive_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._reason: str | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"StoreLiveness({self.host}:{self.port})"

    def start(self) -> None:
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
        return self._reason

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the watch thread to end (after :meth:`stop` or
        a verdict; it looks at the stop flag every 0.5 s)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _gone(self, reason: str) -> None:
        if not self._stop.is_set():
            self._reason = f"the trainer's TCPStore at {self.host}:{self.port} {reason}"

    def _run(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as e:
            self._gone(f"cannot be reached ({e})")
            return
        with sock:
            try:
                _keepalive(sock, self.unresponsive_s)
            except OSError as e:  # pragma: no cover - a platform without the options
                logger.warning("trainer liveness: TCP keepalive not set (%s): a silently vanished host is then "
                               "noticed by timeout_s only", e)
            sock.setblocking(False)
            self._connected.set()
            while not self._stop.is_set():
                readable, _, broken = select.select([sock], [], [sock], _STOP_POLL_S)
                if not (readable or broken):
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError as e:  # keepalive gave up (ETIMEDOUT), reset, ...
                    self._gone(f"connection failed ({e}): the trainer's host or process is gone")
                    return
                if not data:
                    self._gone("closed its connection: the trainer process died")
                    return
                # (the store never writes unprompted; whatever this was, the peer is alive)
