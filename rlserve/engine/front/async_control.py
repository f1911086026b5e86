"""The control calls of :class:`~rlserve.engine.front.async_engine.AsyncEngine` (:class:`EngineControl`, one of its
base classes): calls into every replica's engine between two steps (:meth:`EngineControl.call_engines`,
:meth:`EngineControl.run_in_engines`, :meth:`EngineControl.reset_prefix_cache`), sleep mode's calls (vLLM's
``sleep`` / ``wake_up``: :mod:`rlserve.engine.front.async_sleep`), ending every request when the weights became
unusable (:meth:`EngineControl.fail_all`), and the stop (:meth:`EngineControl.begin_shutdown`,
:meth:`EngineControl.shutdown`). Submitting requests and delivering their outputs stay in
:mod:`rlserve.engine.front.async_engine`.

Uses the front's ``_replicas``, ``_requests``, ``_held``, ``_closed``, ``sleep_mode``, ``loop`` and ``_deliver``
(set or defined by ``AsyncEngine``); binds ``loop`` for it (:meth:`EngineControl.bind_loop`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from rlserve.engine.front.front_request import put, wait_all
from rlserve.errors import EngineDeadError


class EngineControl:
    """Calls into the replicas' engines, sleep mode, ending every request, and stopping: the control side of
    :class:`~rlserve.engine.front.async_engine.AsyncEngine`."""

    # ---- ending every request (weights unusable) ---------------------------------------
    async def fail_all(self, exc: BaseException) -> int:
        """End every in-flight and held request with ``exc`` (its :meth:`AsyncEngine.generate` raises it) and
        abort them in the engines. For weights that became unusable under running requests (a
        weight update that failed after loading part of the model in place): their KV cache and
        every further token would mix two weight sets, so none of them may finish normally.
        Event-loop side. Returns how many requests were ended."""
        reqs = list(self._requests.values())
        for req in reqs:
            if req in self._held:
                self._held.remove(req)
            put(req, exc)  # final: a later abort output from the engine cannot replace it
        # aborted, then a quarantined replica may step again: it has no requests
        await wait_all([r.abort_all(lift_quarantine=True) for r in self._replicas])
        return len(reqs)

    # ---- sleep mode (rlserve.engine.front.async_sleep; enable_sleep_mode) -----------------------
    def _sleep_mode(self):
        if self.sleep_mode is None:
            from rlserve.errors import SleepStateError

            raise SleepStateError("sleep mode is off: start with --enable-sleep-mode", code="sleep_mode_disabled")
        return self.sleep_mode

    async def sleep(self, level: int = 1, mode: str = "abort") -> dict:
        """vLLM's ``sleep``: free the weights' and KV cache's GPU memory (see AsyncSleep.sleep)."""
        return await self._sleep_mode().sleep(level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        """vLLM's ``wake_up``: take the memory of ``tags`` back (see AsyncSleep.wake_up)."""
        return await self._sleep_mode().wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_mode is not None and self.sleep_mode.is_sleeping()

    # ---- engine access ----------------------------------------------------------------
    def bind_loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop; it becomes the front's :attr:`loop` (the serving loop: the
        engine-core replicas' outputs are handled there, restarts swap replicas there, other API
        processes' aborts run there) unless another loop is bound and still running. A second,
        short-lived loop (``asyncio.run(aengine.call_engines(...))`` beside a running server)
        must not take that over: once it closed, outputs were handled on the reader thread,
        and a restart's swap ran off the serving loop, until the next ``generate`` bound the
        serving loop again. The server's app binds its loop at startup
        (:func:`rlserve.server.app.build_app`); ``call_engines`` and ``generate`` bind theirs.
        Event-loop side.

        Raises:
            RuntimeError: no event loop is running in this thread."""
        here = asyncio.get_running_loop()
        bound = self.loop
        if bound is not here and (bound is None or not bound.is_running()):
            self.loop = here
        return here

    async def call_engines(self, target: str, *args, timeout_s: float | None = None) -> list:
        """Run ``target(core, *args)`` on every replica between two steps (also while paused),
        where ``target`` is ``"package.module:function"`` and ``core`` the replica's
        :class:`~rlserve.engine.core.engine_core.EngineCore` (``core.engine`` is its engine,
        ``core.weight_version`` the version it stamps). Works in both engine modes; in process
        mode the function runs in the engine-core process and its arguments and result cross
        the boundary as MessagePack (sets and tuples arrive as lists).

        Returns:
            the results in replica order.

        Raises:
            the first exception raised by ``target`` (after all replicas finished; in process
            mode rebuilt by class name); TimeoutError after ``timeout_s`` seconds (the calls
            still complete later); EngineDeadError: a replica is not running.
        """
        self.bind_loop()
        futs = [r.call(target, *args) for r in self._replicas]
        coro = wait_all(futs, raise_first=True)
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))

    async def run_in_engines(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> list:
        """Run ``fn(engine)`` on every replica's thread between steps (also while paused).
        Thread mode only (a function cannot cross a process boundary): code that must run in
        both modes uses :meth:`call_engines`.

        Returns:
            the results in replica order.

        Raises:
            the first exception raised by ``fn`` (after all replicas finished);
            TimeoutError after ``timeout_s`` seconds (the calls still complete later);
            TypeError in process mode.
        """
        futs = [r.run(fn) for r in self._replicas]
        coro = wait_all(futs, raise_first=True)
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))

    async def reset_prefix_cache(self) -> None:
        """Forget every replica's cached prefixes."""
        await wait_all([r.reset_prefix_cache() for r in self._replicas], raise_first=True)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Event-loop side, first step of stopping (a SIGINT/SIGTERM handler): new requests are
        refused and every request in flight or held ends now with EngineDeadError (HTTP 503), so
        their connections close at once; the engines stop too."""
        self._closed = reason
        self._held = []
        for req in list(self._requests.values()):
            put(req, EngineDeadError(reason))
        for r in self._replicas:
            r.stop()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the replicas (in-flight requests fail with EngineDeadError) and free the
        engines: threads are joined, engine-core processes told to exit and killed (with their
        TP workers) if they have not 0.25 s after they were told (``core_stop._KILL_AFTER_S``). Safe to
        call twice, from any thread."""
        if self._closed is None:
            self._closed = "the engine is shut down"
        for r in self._replicas:
            r.stop()
        for r in self._replicas:
            r.join(timeout_s)
        held, self._held = self._held, []
        self._deliver([(req, EngineDeadError(self._closed)) for req in held])
