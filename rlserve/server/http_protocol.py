"""uvicorn's h11 protocol with a bound on reading a request's head (issue 33: slow-loris).

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but any byte that
arrives cancels that timer, and a new connection has no timer at all: a client that sends a
header line every few seconds, or nothing, holds a connection (a file descriptor and a
protocol object) for ever, and enough of them exhaust the process. Here a connection must
complete its request line and headers within ``header_timeout_s`` seconds of opening, and of
each previous response's end; otherwise it is closed. A request whose head has arrived is not
affected (its body and the answer take as long as they take).
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class BoundedH11Protocol(H11Protocol):
    """:class:`H11Protocol` plus the head-read bound :attr:`header_timeout_s` (seconds; 0 or
    None: none). Made per bound by :func:`bounded_h11_protocol`."""

    header_timeout_s: float | None = 30.0
    _head_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head has the same bound

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        if self.header_timeout_s:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed, or its request's head arrived
        client = "%s:%d " % self.client if self.client else ""
        logger.info("%sclosed: no complete request head within %g s", client, self.header_timeout_s)
        self.transport.close()


def bounded_h11_protocol(header_timeout_s: float | None) -> type[BoundedH11Protocol]:
    """A :class:`BoundedH11Protocol` class with ``header_timeout_s`` (uvicorn's ``http=``
    takes a class)."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": header_timeout_s})
