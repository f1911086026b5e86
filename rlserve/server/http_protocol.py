"""The API process's HTTP stack: uvicorn's protocol with a bound on reading a request's head
(issue 33: slow-loris), on uvloop + httptools where both are installed (vLLM's stack,
``uvicorn[standard]``), else on the stdlib asyncio loop + h11.

Which stack: :func:`http_stack` (``RLSERVE_HTTP_IMPL``: ``auto`` the fast one when importable,
``h11`` the stdlib loop + h11, ``uvloop-h11`` uvloop + h11 for A/B). uvloop's loop and
httptools' C parser cut the API process's CPU per streamed chunk (BENCHMARKS.md, HTTP serving,
issue 37 s18).

The head bound: uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but
any byte that arrives cancels that timer, and a new connection has no timer at all: a client
that sends a header line every few seconds, or nothing, holds a connection (a file descriptor
and a protocol object) for ever, and enough of them exhaust the process. Here a connection must
complete its request line and headers within ``header_timeout_s`` seconds of opening, and of
each previous response's end; otherwise it is closed. The same bound holds between two reads of a
request's body (session 21: a client that sent a head with ``Content-Length`` and then part of the body, or
none, held its connection for ever, the control routes' included): a body that stops arriving for
``header_timeout_s`` seconds closes the connection (nginx's ``client_body_timeout`` rule: a slow but moving
upload is not cut). The answer takes as long as it takes. h11 also answers 400 when more
than 16 KiB of a head are buffered incomplete (its incomplete-event limit); httptools has no such
limit, so :class:`BoundedHttpToolsProtocol` counts what arrives while a head is incomplete and
answers 400 over the same size.

The httptools protocol also hands each request's connection to the routes for the direct writes
of a plain stream's middle chunks (issue 37, :mod:`rlserve.server.direct_write`):
``direct_write`` (default True; False: every chunk through the ASGI stack, for A/B tests).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from rlserve.server.direct_write import install as install_direct_write

logger = logging.getLogger(__name__)

#: most bytes of an incomplete request head (h11's DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, uvicorn's h11 default)
MAX_HEAD_BYTES = 16 * 1024


class _HeadTimer:
    """The head-read bound shared by both protocols: a timer armed at ``connection_made`` and at
    each response's end, cancelled at ``connection_lost``; when it fires and
    :meth:`_waiting_for_head` is true, the connection closes. A protocol class lists this mixin
    before uvicorn's class."""

    header_timeout_s: float | None = 30.0
    _head_timer = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head has the same bound

    def _waiting_for_head(self) -> bool:
        raise NotImplementedError

    def _waiting_for_body(self) -> bool:
        """A request's head arrived and its body has not all arrived."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if not self.transport.is_closing() and self._waiting_for_body():
            self._arm_head_timer()  # the body's bound runs from its last read

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
        if self.transport.is_closing():
            return
        client = "%s:%d " % self.client if self.client else ""
        if self._waiting_for_head():
            logger.info("%sclosed: no complete request head within %g s", client, self.header_timeout_s)
        elif self._waiting_for_body():
            flow = getattr(self, "flow", None)
            if flow is not None and flow.read_paused:  # the app has not read what came: not the client's delay
                self._arm_head_timer()
                return
            logger.info("%sclosed: no byte of the request body for %g s", client, self.header_timeout_s)
        else:
            return  # its request arrived: the answer takes as long as it takes
        self.transport.close()


def _h11_class() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11Protocol(_HeadTimer, H11Protocol):
        """:class:`H11Protocol` plus the head-read bound :attr:`header_timeout_s` (seconds; 0 or
        None: none)."""

        def _waiting_for_head(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def _waiting_for_body(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

    return BoundedH11Protocol


def _httptools_class() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(_HeadTimer, HttpToolsProtocol):
        """:class:`HttpToolsProtocol` plus the head-read bound :attr:`header_timeout_s` and h11's
        bound on an incomplete head: more than :data:`MAX_HEAD_BYTES` received while a request
        head is incomplete (httptools keeps a header value's pieces until it ends, and the URL's)
        is a 400 and a close. A head that completes within one read is not counted (h11 too
        parses a complete head of any size). A head has arrived for every response begun or
        queued (pipelined) beyond the responses completed."""

        _heads = 0  # request heads parsed on this connection
        _answered = 0  # responses completed
        _in_head = True  # between a message's begin (or the connection's start) and its head's end
        _head_bytes = 0  # received while _in_head (reads that began it: not counted)
        _in_body = False  # between a request head's end and its message's end
        direct_write = True  # install rlserve.server.direct_write's DirectWrite in each request's scope

        def _waiting_for_head(self) -> bool:
            return self._heads == self._answered

        def _waiting_for_body(self) -> bool:
            return self._in_body

        def data_received(self, data: bytes) -> None:
            counted = self._in_head
            super().data_received(data)  # (the body's bound: _HeadTimer.data_received)
            if not self._in_head or self.parser is None or self.transport.is_closing():
                return
            self._head_bytes = self._head_bytes + len(data) if counted else 0
            if self._head_bytes > MAX_HEAD_BYTES:
                self.logger.warning("Invalid HTTP request received: a request head over %d bytes.", MAX_HEAD_BYTES)
                self.send_400_response("Invalid HTTP request received.")

        def on_message_begin(self) -> None:
            self._in_head, self._head_bytes = True, 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._heads += 1
            self._in_body = True
            super().on_headers_complete()
            if self.direct_write:
                install_direct_write(self.scope, self.cycle)

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._answered += 1
            super().on_response_complete()

    return BoundedHttpToolsProtocol


class HttpStack(NamedTuple):
    """What serves HTTP: ``name`` (``uvloop+httptools``, ``uvloop+h11`` or ``asyncio+h11``),
    ``run`` (runs a coroutine to its end on the stack's event loop: ``asyncio.run``'s
    signature) and ``protocol`` (``(header_timeout_s, direct_write=True)`` -> a uvicorn protocol
    class for ``uvicorn.Config(http=...)``; ``direct_write`` counts on the httptools stack only)."""

    name: str
    run: Callable[[Any], Any]
    protocol: Callable[[float | None], type]


def _importable(module: str, attr: str | None = None) -> bool:
    """``module`` imports (and has ``attr``)."""
    try:
        m = __import__(module)
    except ImportError:
        return False
    return attr is None or hasattr(m, attr)


def http_stack(impl: str | None = None) -> HttpStack:
    """The HTTP stack for ``impl`` (default: ``RLSERVE_HTTP_IMPL``). ``auto``: uvloop's loop if
    ``uvloop`` imports, httptools' parser if ``httptools`` imports (each on its own; vLLM's
    uvicorn picks them the same way), else the stdlib loop / h11; ``h11``: the stdlib loop + h11
    (rlserve before session 18); ``uvloop-h11``: uvloop + h11 (uvloop must import).

    Raises:
        ValueError: another ``impl``, or ``uvloop-h11`` without uvloop."""
    import asyncio

    from rlserve import envs

    # the variable's own parser checks an explicit value too (one list of the stacks)
    impl = envs.RLSERVE_HTTP_IMPL if impl is None else envs.http_impl("RLSERVE_HTTP_IMPL", impl)
    fast_loop = _importable("uvloop", "run") if impl != "h11" else False  # (uvloop.run: 0.18+)
    if impl == "uvloop-h11" and not fast_loop:
        raise ValueError("RLSERVE_HTTP_IMPL=uvloop-h11: uvloop is not installed (pip install uvloop)")
    fast_parser = impl == "auto" and _importable("httptools")
    run = asyncio.run
    if fast_loop:
        import uvloop

        run = uvloop.run

    def protocol(header_timeout_s: float | None, direct_write: bool = True) -> type:
        make = _httptools_class() if fast_parser else _h11_class()
        return type(make.__name__, (make,), {"header_timeout_s": header_timeout_s, "direct_write": direct_write})

    name = ("uvloop" if fast_loop else "asyncio") + ("+httptools" if fast_parser else "+h11")
    return HttpStack(name, run, protocol)

