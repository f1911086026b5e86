"""Is a ``TCPStore`` answering at the trainer's address? Asked before a server worker's store client connects.

torch's ``TCPStore`` client (2.13) bounds its connect by the store's timeout but not its handshake: against a
listener that takes the connection and never answers (a silent TCP listener; Python's ``http.server``, which waits
for a request line) the constructor blocks for ever, and ``/init_weight_transfer_engine`` answered only when the
manager's own deadline (``timeout_s`` + 30 s) fired, with a 504 that named no address. :func:`probe_store` sends the
client's own first bytes itself, on a plain socket with a deadline, and reads the answer:

- ``VALIDATE`` (query byte 0) + the magic number ``0x3C85F7CE``, then ``PING`` (query byte 13) + a 32-bit nonce,
  all little-endian: what torch 2.13's client sends first (captured from it on a listening socket);
- a store answers the ping with the same nonce (4 bytes).

A connection refused (nothing listening yet: the trainer builds its store while the server joins) is retried until
the deadline, as torch's client retries it.

Raises:
    TrainerUnreachableError: (HTTP 502) the listener at ``host:port`` closed or reset the connection, answered
        something else than the nonce, or gave no answer within the deadline.
    TransferTimeoutError: (HTTP 504) nothing took a connection at ``host:port`` within the deadline.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from rlserve.transfer.errors import TrainerUnreachableError, TransferTimeoutError

#: torch's c10d store: QueryType VALIDATE, the validation magic number, QueryType PING (little-endian words)
_VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)
_PING = b"\x0d"
#: seconds between two connection attempts while nothing listens (torch's client backs off similarly)
RETRY_S = 0.1


def _answer(sock: socket.socket, nonce: int, deadline: float, timeout_s: float) -> str | None:
    """Send the handshake on a connected ``sock`` and read the ping's answer before ``deadline``
    (``time.monotonic()`` seconds; ``timeout_s`` is named in the words). None when a store answered; else what
    went wrong, in words."""
    got = b""
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(_VALIDATE + _PING + struct.pack("<I", nonce))
        while len(got) < 4:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            part = sock.recv(4 - len(got))
            if not part:
                return f"the listener there closed the connection after {len(got)} bytes of an answer"
            got += part
    except socket.timeout:
        return (f"the listener there took the connection but sent {len(got)} of the 4 bytes of a TCPStore "
                f"handshake answer within {timeout_s:g} s (timeout_s)")
    except OSError as e:
        return f"the connection was broken during the TCPStore handshake ({e})"
    if struct.unpack("<I", got)[0] != nonce:
        return f"the listener there answered {got.hex()}, not a TCPStore's handshake answer"
    return None


def probe_store(host: str, port: int, timeout_s: float, who: str) -> None:
    """Return once a ``TCPStore`` at ``host:port`` answered a ping, within ``timeout_s`` seconds.

    Args:
        host / port: the store's address (``init_info.master_address`` / ``master_port``).
        timeout_s: the whole probe's bound (seconds): connection attempts and the answer together.
        who: the caller in words, for the messages (e.g. ``"rank 1/2, gloo"``).
    Raises:
        TrainerUnreachableError, TransferTimeoutError: see the module docstring; both name ``host:port``.
    """
    where = f"the transfer group's TCPStore at {host}:{port} ({who})"
    hint = "is the trainer's store listening there (init_info.master_address / master_port)?"
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"nothing took a connection to {where} within {timeout_s:g} s "
                                       f"(timeout_s; last: {last}) -- {hint}")
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except socket.timeout:
            last = "the connect timed out"
            continue
        except OSError as e:  # refused (not up yet), unreachable for now: retried as torch's client does
            last = str(e)
            time.sleep(min(RETRY_S, max(deadline - time.monotonic(), 0)))
            continue
        with sock:
            what = _answer(sock, os.getpid() & 0xFFFFFFFF, deadline, timeout_s)
        if what is None:
            return
        raise TrainerUnreachableError(f"could not connect to {where}: {what} -- {hint}")
