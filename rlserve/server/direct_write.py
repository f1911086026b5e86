"""A plain stream's middle SSE chunks written to its connection from the engine's per-step output
callback (issue 37), not through the request's coroutine and the ASGI stack.

Per streamed event the usual path is: the step's callback puts the request's output into its
mailbox (:func:`rlserve.engine.front.front_request.put`), the request's task wakes, the route
fills the chunk, Starlette's ``StreamingResponse`` sends it through four middleware ``send``
wrappers to uvicorn's ``send``, which frames it (HTTP/1.1 chunked) and calls ``transport.write``:
~26 us of the API process's ~58 us an event at 256 streams (BENCHMARKS.md, H29). Here the
callback fills the chunk and writes the framed bytes itself; the task sleeps until something
only it can do comes (the stream's end, a paused transport, a chunk that is not plain).

One mechanism, four small pieces, one per layer:

* :class:`DirectWrite` (HTTP): one request-response cycle of uvicorn's httptools protocol.
  :func:`install` (called by ``BoundedHttpToolsProtocol.on_headers_complete``,
  :mod:`rlserve.server.http_protocol`) puts it into the request's ASGI scope as the extension
  ``scope["extensions"]["rlserve.direct_write"]``. :meth:`DirectWrite.write` writes exactly the
  bytes uvicorn's ``send`` writes for an ``http.response.body`` message with ``more_body``
  (``b"%x\\r\\n" % len(body) + body + b"\\r\\n"``); :meth:`DirectWrite.writable` is true only
  between the response's start and its end, while the connection is open, the response is
  chunked and the transport's writes are not paused (uvicorn's ``FlowControl``).
* :class:`DirectSink` (engine front): the request's ``FrontRequest.sink``; :func:`put` offers it
  each unfinished output first. It takes the output only while the stream's coroutine is parked
  (:attr:`DirectSink.parked`: waiting for its next output, everything before already written),
  the connection is writable and :attr:`DirectSink.fill` turns the whole output into chunk bytes
  (``stream_chunks.StreamChunks.plain``: no first chunk, no finish, no weight-version span, a byte
  template for every choice). Anything else -- an output it refuses, a finished one, an
  error -- wakes the coroutine as before, which writes it through the ASGI stack, in order
  (nothing is written here while it is not parked). A slow reader: its transport's writes
  pause, the sink refuses, the coroutine waits in uvicorn's ``drain`` and later outputs merge
  in the mailbox (the slow-client rule), as before.
* :func:`sink_for` (route): the sink of a request whose scope has a :class:`DirectWrite`; None
  otherwise (the h11 stack, a server built with ``direct_write=False``, a test client without
  a socket): then the stream runs as before, all of it on the coroutine.
* :func:`parked` (stream): the request's output generator as the stream's coroutine iterates it,
  setting the sink's ``parked`` and ``fill`` (:mod:`rlserve.server.openai_stream`).

What the bypass skips, and why that changes nothing observable: ``SSEResponse`` (Starlette's
``StreamingResponse``: it only forwards body messages), the middleware ``send`` wrappers of
:func:`rlserve.server.app.build_app` (``ServerErrorMiddleware``, ``ExceptionMiddleware``, rlserve's
``BodySizeLimit`` and ``LoneSurrogateCheck``: each records only whether the response has started,
which the coroutine's first chunk did; none reads or changes a body message:
``tests/test_direct_write.py`` checks the app's middleware list) and uvicorn's ``send`` (flow
control: :meth:`DirectWrite.writable`; a disconnected client: the same check). Access logs and
metrics are written at a request's start and end, which stay on the coroutine.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

logger = logging.getLogger(__name__)

#: the ASGI scope extension's name
EXTENSION = "rlserve.direct_write"


class DirectWrite:
    """Chunked writes to the connection of one uvicorn httptools ``RequestResponseCycle``
    (``cycle``: its ``transport``, ``flow``, ``response_started``, ``response_complete``,
    ``disconnected``, ``chunked_encoding``). Event-loop side."""

    __slots__ = ("cycle",)

    def __init__(self, cycle):
        self.cycle = cycle

    def writable(self) -> bool:
        """The response has started and not ended, is chunked, its client is connected and the
        transport's writes are not paused."""
        c = self.cycle
        return (c.response_started and not c.response_complete and not c.disconnected and c.chunked_encoding is True
                and not c.flow.write_paused and not c.transport.is_closing())

    def write(self, body: bytes) -> None:
        """``body`` (non-empty) as one HTTP/1.1 chunk: uvicorn's framing of a body message with
        ``more_body``. Only when :meth:`writable`."""
        self.cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


#: what :class:`DirectWrite` reads of a cycle (uvicorn's httptools ``RequestResponseCycle``, set in its
#: ``__init__`` since well before uvicorn 0.29)
_CYCLE_FIELDS = ("scope", "transport", "flow", "response_started", "response_complete", "disconnected",
                 "chunked_encoding")


def install(scope: dict, cycle) -> None:
    """Put a :class:`DirectWrite` of ``cycle`` into ``scope``'s extensions, where ``cycle`` is the
    request-response cycle of ``scope`` (not one left from an upgrade) with what :class:`DirectWrite`
    reads (another uvicorn's cycle: no direct writes) and the method is not HEAD (no body)."""
    if (cycle is not None and all(hasattr(cycle, a) for a in _CYCLE_FIELDS) and cycle.scope is scope
            and hasattr(cycle.flow, "write_paused") and scope.get("method") != "HEAD"):
        scope.setdefault("extensions", {})[EXTENSION] = DirectWrite(cycle)


class DirectSink:
    """``FrontRequest.sink`` of one stream (event-loop side).

    Attributes:
        writer: the connection's :class:`DirectWrite`.
        fill: ``fill(output) -> bytes | None``: the output's chunks (``b""``: nothing new to
            send), having recorded them as sent; None: not plain (nothing recorded). Set by
            the stream once it knows the request is plain; None: the sink takes nothing.
        parked: set by the stream's coroutine while it waits for its next output with all
            earlier chunks written; the sink takes nothing otherwise.
    """

    __slots__ = ("writer", "fill", "parked")

    def __init__(self, writer: DirectWrite):
        self.writer = writer
        self.fill: Callable | None = None
        self.parked = False

    def __call__(self, out) -> bool:
        """Write ``out``'s chunks to the connection; False (nothing written or recorded): the
        coroutine must take it. Never raises (it runs in the engine's output callback): a bug
        here logs, turns the sink off and leaves the stream to its coroutine."""
        if self.fill is None or not self.parked:
            return False
        written = False
        try:
            if not self.writer.writable():
                return False
            body = self.fill(out)
            if body is None:
                return False
            written = True  # recorded as sent: from here a failure must not leave a gap
            if body:
                self.writer.write(body)
            return True
        except Exception:  # noqa: BLE001
            logger.exception("a stream's direct write failed; its coroutine writes the rest")
            self.fill = None
            if written:  # the chunk is lost: end the stream rather than skip it (the disconnect aborts it)
                with contextlib.suppress(Exception):
                    self.writer.cycle.transport.close()
            return written


def sink_for(scope: dict) -> DirectSink | None:
    """A :class:`DirectSink` for the request of ``scope`` where its protocol installed a
    :class:`DirectWrite` (:func:`install`); else None."""
    ext = scope.get("extensions")
    writer = ext.get(EXTENSION) if ext else None
    return None if writer is None else DirectSink(writer)


def parked(agen, sink: DirectSink | None, fill):
    """``agen`` (a request's outputs, to its stream's coroutine), with ``sink`` told when the
    coroutine is parked: from the moment it asks for the next output (everything it was given is
    written by then) until one is yielded; ``sink.fill`` is ``fill`` meanwhile. ``agen`` itself where
    there is no sink or no ``fill`` (the stream is not plain). Closing the result closes ``agen``."""
    if sink is None or fill is None:
        return agen
    return _parking(agen, sink, fill)


async def _parking(agen, sink: DirectSink, fill):
    sink.fill = fill
    try:
        async for out in agen:
            sink.parked = False
            yield out
            sink.parked = True  # the consumer asks for the next one: what it was given is written
    finally:
        sink.parked, sink.fill = False, None
        await agen.aclose()
