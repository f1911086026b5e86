"""Trainer liveness where the server hosts the store: TRL's layout (``rank_offset`` 0).

There server worker 0 hosts the transfer group's ``TCPStore`` and the trainer (the last rank) is
one of its clients: it keeps that connection from the rendezvous to its teardown (TRL's clients
use the store for barriers; rlserve's ``TRLWeightSyncClient`` holds its group's store). The
kernel closes it the moment the trainer process dies, so the server's side of it leaves the
``ESTABLISHED`` state (``CLOSE_WAIT``, then gone once the store's thread closed it).

:class:`StoreConnectionLiveness` finds the trainer's connections once, right after the
rendezvous: the connections to the store's port (the server's side: local port = the store's)
whose other end is not a socket of a server worker (each worker reports the local endpoints of
its own sockets connected to that port: :func:`own_endpoints`, run through ``collective_rpc``).
Then ``gone()`` reads the kernel's TCP table (``/proc/net/tcp`` and ``tcp6``, at most every
``min_interval_s``) and says the trainer is gone once none of those connections is established
any more (all of them: a client that closed one connection of several is not a dead process).

Limits: Linux only (elsewhere, or when no trainer connection is found, nothing is watched and
``timeout_s`` bounds the wait, as before); a trainer host that vanished without closing anything
keeps the entry established (no keepalive on the store's sockets): ``timeout_s`` again.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


def _ip(hex_addr: str) -> str:
    """``/proc/net/tcp`` address hex (host byte order words) -> dotted IPv4 or the IPv6 hex; an
    IPv4-mapped IPv6 address becomes its IPv4 (a dual-stack listener sees v4 peers so)."""
    if len(hex_addr) == 8:
        return ".".join(str(int(hex_addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
    words = [hex_addr[i:i + 8] for i in range(0, 32, 8)]
    if words[0] == words[1] == "00000000" and words[2].upper() == "FFFF0000":
        return _ip(words[3])
    return hex_addr.upper()


def tcp_table() -> list[tuple[tuple[str, int], tuple[str, int], str, str]]:
    """``(local (ip, port), remote (ip, port), state hex, inode)`` of every TCP socket of this
    host's network namespace; ``[]`` where ``/proc/net/tcp`` does not exist."""
    rows = []
    for path in _TABLES:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            (la, lp), (ra, rp) = parts[1].split(":"), parts[2].split(":")
            rows.append(((_ip(la), int(lp, 16)), (_ip(ra), int(rp, 16)), parts[3], parts[9]))
    return rows


def own_endpoints(port: int) -> list[list]:
    """The local ``[ip, port]`` of this process's TCP sockets connected to ``port`` (a server
    worker's store clients). ``[]`` without ``/proc``."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    return [list(local) for local, remote, _state, inode in tcp_table() if remote[1] == port and inode in inodes]


class StoreConnectionLiveness:
    """Watch the trainer's connections to the store this server hosts (module docstring).

    Args:
        port: the store's port (``init_info.master_port``).
        exclude: ``(ip, port)`` local endpoints of the server workers' own store clients.
        min_interval_s: the shortest time between two reads of the TCP table (seconds).
    """

    def __init__(self, port: int, exclude, min_interval_s: float = 0.2):
        self.port = int(port)
        self.exclude = {(str(ip), int(p)) for ip, p in exclude}
        self.min_interval_s = float(min_interval_s)
        self.peers: set[tuple[str, int]] = set()
        self._last = 0.0
        self._reason: str | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return f"StoreConnectionLiveness(port={self.port}, peers={sorted(self.peers)})"

    def start(self) -> None:
        """Find the trainer's connections (the server side of each connection to ``port`` whose
        other end is no worker's). None found: nothing is watched (logged)."""
        self.peers = {remote for local, remote, state, _ in tcp_table()
                      if local[1] == self.port and state == _ESTABLISHED and remote not in self.exclude}
        if not self.peers:
            logger.warning("trainer liveness: no connection of the trainer to the store on port %d found; a dead "
                           "trainer is noticed after timeout_s only", self.port)
        self._last = time.monotonic()

    def gone(self) -> str | None:
        """``None`` while one of the trainer's connections is established, else why."""
        if self._stopped or not self.peers:
            return None
        if self._reason is not None:
            return self._reason
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return None
        self._last = now
        alive = {remote for local, remote, state, _ in tcp_table()
                 if local[1] == self.port and state == _ESTABLISHED and remote in self.peers}
        if not alive:
            peers = ", ".join(f"{ip}:{p}" for ip, p in sorted(self.peers))
            self._reason = f"its connection to the transfer group's store (port {self.port}, from {peers}) closed"
        return self._reason

    def stop(self) -> None:
        """Stop watching: ``gone()`` reports nothing more."""
        self._stopped = True
