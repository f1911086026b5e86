"""``init_info.master_address`` checked before the workers join the group: an address that can
never be reached is a 400 at once, instead of a rendezvous retried for ``timeout_s`` (300 s by
default) before a 504 -- what a trainer with a typo in its address got before session 19."""

from __future__ import annotations

import asyncio
import socket

from rlserve.errors import WeightUpdateError

#: Longest a name resolution may take here (seconds); past it the address is let through (the
#: rendezvous' own ``timeout_s`` bounds it then), as is a temporary resolver failure.
RESOLVE_TIMEOUT_S = 10.0
#: getaddrinfo's answers that say the name does not exist (not a temporary failure)
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def check_master_address(address: str, port: int, field: str = "init_info.master_address") -> None:
    """Refuse ``address`` when it is not a host name or IP literal (whitespace, control or other
    characters no host name holds; more than 253 characters) or the resolver says no such host
    exists (resolved off the event loop, at most :data:`RESOLVE_TIMEOUT_S` seconds).

    Raises:
        WeightUpdateError: (HTTP 400) naming ``field``.
    """
    bad = [c for c in address if c.isspace() or not c.isprintable() or not c.isascii()]
    if bad or len(address) > 253:
        what = f"the character {bad[0]!r}" if bad else f"{len(address)} characters (at most 253)"
        raise WeightUpdateError(f"{field} must be a host name or an IP address, got {address[:80]!r}: {what}",
                                param=field)
    try:
        await asyncio.wait_for(asyncio.to_thread(socket.getaddrinfo, address, port or None, type=socket.SOCK_STREAM),
                               RESOLVE_TIMEOUT_S)
    except socket.gaierror as e:
        if e.errno in _NO_SUCH_NAME:
            raise WeightUpdateError(f"{field} {address!r} does not resolve ({e.strerror}): no trainer can be "
                                    "reached there", param=field) from None
    except (asyncio.TimeoutError, OSError, UnicodeError):
        pass  # a slow or failing resolver: the rendezvous' timeout_s decides
