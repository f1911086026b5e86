"""The async front's per-request mailbox: :class:`FrontRequest` (one slot holding the newest
undelivered output, or the exception that ended the request, plus an ``asyncio.Event``) and the
helpers that fill it (:func:`put`, :func:`put_all`: event-loop side), the abort output of a
request that never started (:func:`stamped_abort`) and awaiting replicas' concurrent futures
(:func:`wait_all`). Used by :mod:`rlserve.engine.front.async_engine` and :mod:`rlserve.engine.front.async_pause`.

Stream interval (vLLM's ``--stream-interval`` / ``stream_interval``): a streamed request with
``interval`` N > 1 is woken for an output only when it is the request's first, its last, a
sample finished since the previous delivery, or a sample has at least N tokens more than at the
previous delivery (vLLM's ``RequestState.make_request_output`` rule, per sample). Other outputs
wait in the slot, replaced by newer ones (outputs are cumulative: nothing is lost). A consumer
slower than the engine still gets the newest output when it asks, so its deltas can be larger
than N (rlserve's slow-client rule, which vLLM does not have).

A sink (``FrontRequest.sink``, issue 37: :class:`rlserve.server.direct_write.DirectSink`) is
offered each unfinished output before the consumer: where it takes the output, the consumer is
not woken for it (the sink wrote the stream's chunk itself). It is offered one only while the
slot is empty (the consumer has taken everything before: order is kept), and never an exception
or a finished output (the consumer's: once one is put, the sink is dropped). Under a stream
interval, an output that is not due is dropped while the slot is empty: the consumer would not
have been woken for it, and a later output holds its tokens too.

A consumer that leaves before the final item (its generator closed: a client that went away)
may still want it (:func:`abandon`): the final item of the aborted request (the abort's output
carries every token the request made; metrics count them, as vLLM counts every step's tokens)
is handed to a callback when it comes, through the same sink slot (no cost for other requests)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable

from rlserve.engine.core.engine_core import abort_output

logger = logging.getLogger(__name__)


class Wakeup:
    """``asyncio.Event``'s ``set`` / ``clear`` / ``is_set`` / ``wait`` for one consumer on a known loop
    (a request's stream), plus :meth:`future`: the consumer awaits a bare future of ``loop``, made
    only when it has to wait. What it saves per streamed output against an ``Event`` (issue 37): the
    running-loop look-up (on CPython 3.11 a ``getpid`` system call: 1.5 a streamed event at 256
    streams, strace), the waiters' deque and a coroutine frame. Event-loop side only, as ``Event``."""

    __slots__ = ("loop", "_set", "_fut")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self._set, self._fut = loop, False, None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            fut = self._fut
            if fut is not None and not fut.done():
                fut.set_result(None)

    def clear(self) -> None:
        self._set = False

    def future(self) -> asyncio.Future:
        """A future done once :meth:`set` is called (already done when set)."""
        fut = self._fut
        if fut is None or fut.done():
            fut = self._fut = self.loop.create_future()
            if self._set:
                fut.set_result(None)
        return fut

    async def wait(self) -> bool:
        if not self._set:
            await self.future()
        return True


@dataclasses.dataclass(eq=False)
class FrontRequest:
    """Front-side state of one request (event-loop side, plus the replica's delivering thread)."""

    request_id: str
    prompt: Any
    params: Any
    loop: asyncio.AbstractEventLoop
    event: Wakeup  # set when ``slot`` holds something new
    arrival_time: float  # time.monotonic() seconds
    stream: bool = True  # deliver every step's output (else only the final one)
    slot: Any = None  # newest undelivered output, or the exception that ended the request
    replica: Any = None
    finished: bool = False  # set by the delivering thread when the final item is routed
    interval: int = 1  # stream interval: new tokens per delivered output at least (see the module docstring)
    delivered: Any = None  # per sample (tokens, finished) at the last delivery; None: nothing delivered
    sink: Any = None  # event-loop side: sink(output) -> True when it took an unfinished output (module docstring)


def due(req: FrontRequest, item) -> bool:
    """Whether ``item`` (an output) must wake ``req``'s consumer under its stream interval."""
    if req.interval <= 1 or req.delivered is None or item.finished:
        return True
    for c, (k, was_done) in zip(item.outputs, req.delivered):
        if len(c.token_ids) - k >= req.interval or (c.finish_reason is not None and not was_done):
            return True
    return False


def mark_delivered(req: FrontRequest, item) -> None:
    """Record what the consumer got (the base of :func:`due`'s counts)."""
    if req.interval > 1:
        req.delivered = [(len(c.token_ids), c.finish_reason is not None) for c in item.outputs]


def put(req: FrontRequest, item) -> None:
    """Event-loop side: the newest item replaces an undelivered one, except that the final
    item (an exception or a finished output) is never replaced (nothing follows it). The
    consumer is woken unless the stream interval holds the output back (:func:`due`). A sink
    (:attr:`FrontRequest.sink`) is offered the item first (the module docstring)."""
    slot = req.slot
    if slot is not None and (isinstance(slot, BaseException) or slot.finished):
        return
    sink = req.sink
    if sink is not None:
        if isinstance(item, BaseException) or item.finished:
            req.sink = None  # the consumer's from here on
            if sink.__class__ is _Abandoned:  # ... who left: the callback's (abandon)
                sink.final(item)
                return
        elif slot is None:
            if not due(req, item):
                return
            if sink(item):
                mark_delivered(req, item)
                return
    req.slot = item
    if isinstance(item, BaseException) or due(req, item):
        req.event.set()


class _Abandoned:
    """The sink of a request whose consumer left (:func:`abandon`): unfinished outputs are
    dropped (taken: nobody reads them), the final item goes to ``on_final``."""

    __slots__ = ("on_final",)

    def __init__(self, on_final: Callable[[Any], None]):
        self.on_final = on_final

    def __call__(self, item) -> bool:
        return True

    def final(self, item) -> None:
        try:
            self.on_final(item)
        except Exception:  # noqa: BLE001 - a callback's bug must not stop the other requests' delivery
            logger.exception("the final-item callback of an abandoned request failed")


def abandon(req: FrontRequest, on_final: Callable[[Any], None] | None) -> None:
    """``req``'s consumer left before its final item (the request was aborted, or had ended
    unread): ``on_final(item)`` with the final item -- the finished output (an abort's holds the
    tokens the request made before it) or the exception that ended it -- now if the slot holds
    it, else when :func:`put` gets it. Called once per request, by the consumer's side, after the
    abort was sent (a held request: after its abort output was put). Event-loop side, as
    :func:`put`. ``on_final`` None: nothing."""
    if on_final is None:
        return
    slot = req.slot
    if slot is not None and (isinstance(slot, BaseException) or slot.finished):
        req.slot = None
        _Abandoned(on_final).final(slot)
    else:
        req.sink = _Abandoned(on_final)


def put_all(batch) -> None:
    """:func:`put` each ``(request, item)`` of ``batch`` (one event-loop callback per step)."""
    for req, item in batch:
        put(req, item)


def stamped_abort(req: FrontRequest, version: str):
    """The final \"abort\" output of a request that never reached an engine (held), stamped with
    ``version``."""
    out = abort_output(req.request_id, req.prompt, getattr(req.params, "n", 1) or 1)
    out.weight_version = version
    out.weight_versions = [version]
    out.arrival_time = req.arrival_time
    return out


async def wait_all(futs, raise_first: bool = False) -> list:
    """Await concurrent futures; returns results (exceptions in place unless raise_first)."""
    if not futs:
        return []
    wrapped = [asyncio.wrap_future(f) for f in futs]
    results = await asyncio.gather(*wrapped, return_exceptions=True)
    if raise_first:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results
