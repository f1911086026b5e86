"""Pausing generation in the async front (:class:`PauseControl`, a base class of
:class:`~rlserve.engine.front.async_engine.AsyncEngine`), and the requests held meanwhile.

Pause semantics follow vLLM's ``pause_generation``:

* ``abort``: in-flight requests end now with ``finish_reason == "abort"``.
* ``wait``: requests already submitted run to completion; :meth:`AsyncEngine.pause`
  returns once every replica is idle.
* ``keep``: the step loops stop between two steps and keep all state (KV cache, partial
  outputs); :meth:`AsyncEngine.resume` continues exactly where they stopped.

In every mode requests that arrive while paused are *held* (queued in the front, never
rejected) and start on resume. ``clear_cache=True`` resets every replica's prefix cache
once the pause has taken effect. :meth:`AsyncEngine.call_engines` works while paused (that is
how weight updates run with the engines frozen).

A request held longer than ``AsyncEngine.hold_timeout_s`` ends with :class:`HeldTooLongError`
(HTTP 503). :class:`PauseControl` uses the front's ``_replicas``, ``_held``, ``_submit`` and
``reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlserve.engine.front.front_request import FrontRequest, wait_all
from rlserve.errors import APIServerTimeoutError, ModelUnavailableError

logger = logging.getLogger("rlserve.engine.front.async_engine")  # the front's log, as before the split

PAUSE_MODES = ("abort", "wait", "keep")
DEFAULT_HOLD_TIMEOUT_S = 600.0  # a request held behind a pause waits at most this long (seconds)


class HeldTooLongError(ModelUnavailableError):
    """A request was held behind a pause for longer than the engine's ``hold_timeout_s``; it
    never started. HTTP 503 (the model is unavailable while generation stays paused)."""


class PauseControl:
    """pause / resume of every replica, the pause's state, and the wait of a held request.

    State (set by ``AsyncEngine.__init__``): ``_paused``, ``_pause_mode``, ``_paused_since``
    (``time.monotonic()`` of the pause in force), ``_paused_total_s`` (seconds paused before it),
    ``_pause_lock`` (made on first use, in the event loop), ``hold_timeout_s``."""

    def is_paused(self) -> bool:
        return self._paused

    @property
    def paused_seconds(self) -> float:
        """Seconds generation has been paused since start (weight syncs and operators; the
        pause in force included): what pausing has cost generation."""
        since = self._paused_since
        return self._paused_total_s + (time.monotonic() - since if since is not None else 0.0)

    @property
    def pause_mode(self) -> str | None:
        return self._pause_mode if self._paused else None

    #: ``fn() -> bool`` set by the weight-sync manager (``rlserve.transfer.server.manager``), asked
    #: under the pause lock by :meth:`resume`: True while an open in-place weight update needs the
    #: replicas frozen; the resume is then left to that update's end (sleep mode's wake, whose
    #: resume would otherwise run generation on partly loaded weights)
    resume_deferral = None

    async def pause(self, mode: str = "abort", clear_cache: bool = False, timeout_s: float | None = None,
                    check=None) -> None:
        """Stop generation. New requests are held until :meth:`resume`.

        Args:
            mode: "abort" (in-flight requests end with finish_reason "abort"), "wait" (let
                them finish; returns when all replicas are idle) or "keep" (freeze them in
                place between two steps).
            clear_cache: reset the prefix cache of every replica once paused.
            timeout_s: give up waiting after this many seconds (TimeoutError). A pause that
                fails (timeout, cancellation, an engine error) is undone: generation resumes
                (held requests start) when it was running before, or stays under the earlier
                pause otherwise; requests that an ``abort`` pause already ended stay ended.
            check: ``fn()`` called under the pause lock before anything changes; what it raises
                refuses the pause (an operator's pause checked against an open weight update:
                nothing can open or end one between the check and the pause).

        Raises:
            ValueError: unknown mode. TimeoutError: see ``timeout_s``. What ``check`` raises.
            APIServerTimeoutError (a TimeoutError): with ``--api-server-count N``, another API process did
                not apply the pause within ``timeout_s`` (at most ``front_sync.ACK_TIMEOUT_S``); undone as above.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        async with self._get_pause_lock():
            if check is not None:
                check()
            await self._pause_in_lock(mode, clear_cache, timeout_s)
        logger.info("generation paused (mode=%s, clear_cache=%s)", mode, clear_cache)

    async def pause_unless_paused(self, mode: str, then) -> bool:
        """Under the pause lock: pause with ``mode`` unless generation is paused already, then
        ``then(paused_here)`` -- a weight update opening its session, so that no :meth:`resume`
        (an operator's, a wake's) can come between the pause it relies on and the session that
        makes such a resume wait for it. Returns ``paused_here``."""
        async with self._get_pause_lock():
            paused_here = not self._paused
            if paused_here:
                await self._pause_in_lock(mode, False, None)
            then(paused_here)
        if paused_here:
            logger.info("generation paused (mode=%s, clear_cache=False)", mode)
        return paused_here

    async def _pause_in_lock(self, mode: str, clear_cache: bool, timeout_s: float | None) -> None:
        before = self._pause_mode if self._paused else None
        if not self._paused:
            self._paused_since = time.monotonic()
        self._paused = True
        self._pause_mode = mode
        t0 = time.monotonic()
        try:
            # the other API processes hold new requests from here on, and what they admitted
            # before is in the cores (rlserve.engine.front.front_sync): the pause treats it as ours
            # (one that does not apply it within the pause's timeout: APIServerTimeoutError, naming it)
            await self.front_sync.publish(timeout_s=timeout_s)
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
            await self._pause_locked(mode, clear_cache, left)
        except BaseException as e:
            # a pause that did not take effect (timeout, cancelled, an engine error) must not
            # leave generation paused with nobody to resume it: back to the state before it
            # (without waiting again for a process that did not apply the pause: it gets the state in order)
            await self._restore_pause(before, wait_others=not isinstance(e, APIServerTimeoutError))
            raise

    async def _restore_pause(self, before: str | None, wait_others: bool = True) -> None:
        """Undo a failed :meth:`pause` (pause lock held): resume when generation was running
        before it (held requests are submitted), else return to the earlier pause's mode (a
        keep-pause freezes the replicas again). ``wait_others``: see :meth:`_resume_locked`."""
        if before is None:
            await self._resume_locked(wait_others)
            logger.warning("pause did not take effect; generation resumed (it was not paused before)")
            return
        self._pause_mode = before
        if before == "keep":
            await wait_all([r.set_frozen(True) for r in self._replicas])
        logger.warning("pause did not take effect; generation stays paused by the earlier pause (mode=%s)", before)

    async def _pause_locked(self, mode: str, clear_cache: bool, timeout_s: float | None) -> None:
        if mode == "keep":  # frozen, with stats() as of the freeze
            futs = [r.set_frozen(True) for r in self._replicas]
        elif mode == "abort":
            futs = [f for r in self._replicas for f in (r.abort_all(), r.set_frozen(False))]
        else:  # wait: a replica frozen by an earlier keep-pause steps to drain
            futs = [r.wait_drained() for r in self._replicas]
        coro = self._pause_effect(futs, clear_cache)
        if timeout_s is None:
            await coro
        else:
            await asyncio.wait_for(coro, timeout_s)

    async def _pause_effect(self, futs, clear_cache) -> None:
        await wait_all(futs, raise_first=True)
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume(self, check=None) -> bool:
        """Continue generation: unfreeze replicas and submit the held requests. Returns False
        when :attr:`resume_deferral` left the resume to an open in-place weight update's end
        (generation stays paused until then), True otherwise.

        Args:
            check: ``fn()`` called under the pause lock first; what it raises refuses the resume
                (an operator's ``/resume`` during an in-place weight update: 409).
        """
        async with self._get_pause_lock():
            if check is not None:
                check()
            if self.resume_deferral is not None and self.resume_deferral():
                logger.info("resume deferred: an in-place weight update is open; generation resumes at its end")
                return False
            n = await self._resume_locked()
        logger.info("generation resumed (%d held request(s) submitted)", n)
        return True

    async def _resume_locked(self, wait_others: bool = True) -> int:
        """Unfreeze, submit the held requests, and have the other API processes release theirs (waiting
        until they did, unless not ``wait_others``). Returns how many this process submitted."""
        await wait_all([r.set_frozen(False) for r in self._replicas])
        n = self.release_held()
        if wait_others:
            await self.front_sync.publish()  # the other API processes release theirs
        else:
            self.front_sync.notify()
        return n

    def hold_new(self, mode: str | None) -> None:
        """Hold new requests from now on (pause ``mode``), touching no engine: the pause's effect
        on the engines is API process 0's (an API process > 0 applying its state,
        :mod:`rlserve.engine.front.front_sync`)."""
        if not self._paused:
            self._paused_since = time.monotonic()
        self._paused = True
        self._pause_mode = mode

    def release_held(self) -> int:
        """Generation runs again: submit the held requests (the engines already unfrozen).
        Returns how many."""
        if self._paused_since is not None:
            self._paused_total_s += time.monotonic() - self._paused_since
            self._paused_since = None
        self._paused = False
        self._pause_mode = None
        held, self._held = self._held, []
        for req in held:
            self._submit(req)
        return len(held)

    def _get_pause_lock(self) -> asyncio.Lock:
        if self._pause_lock is None:
            self._pause_lock = asyncio.Lock()
        return self._pause_lock

    async def _wait_held(self, req: FrontRequest) -> None:
        """Wait for ``req``'s next item while it is held; raises :class:`HeldTooLongError` (and
        drops it) once it has been held ``hold_timeout_s`` seconds since its arrival."""
        left = req.arrival_time + self.hold_timeout_s - time.monotonic()
        try:
            await asyncio.wait_for(req.event.wait(), max(left, 0.0))
        except asyncio.TimeoutError:
            if req in self._held and not req.event.is_set():
                self._held.remove(req)
                raise HeldTooLongError(
                    f"generation has been paused (mode={self._pause_mode}) for the {self.hold_timeout_s:g} s this "
                    "request may wait for /resume (rlserve serve --pause-hold-timeout); it was not started") from None
