"""Asyncio front of the engine: data-parallel replicas, each in its own engine-core process
(default) or on a thread of this process.

Where the replicas run (``engine_mode``):

* ``"process"`` (default): one engine-core process per replica (:mod:`rlserve.engine.core_client`,
  :mod:`rlserve.engine.core_proc`); the step loop, scheduler, KV cache and model runner run off
  this process's GIL, so HTTP, JSON and tokenization here never slow a step down, and DP
  replicas step in parallel. The API process talks to them over ZMQ with msgspec messages
  (:mod:`rlserve.engine.core_protocol`).
* ``"thread"``: each replica on a thread here (``RLSERVE_ENGINE_MODE=thread`` or
  ``rlserve serve --engine-mode thread``: debugging; every ``engine_factory`` fake in tests).

Either way, every call into an engine runs between two of its steps, and outputs reach asyncio
one hop per step and event loop (not per request) into a one-slot mailbox per request: outputs
are cumulative, so a consumer that falls behind simply gets the newest one (its deltas just get
bigger) instead of a backlog, and a non-streaming consumer (``generate(..., stream=False)``) is
woken only once, at the end.

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
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Callable

from rlserve.engine.core import EngineDeadError, EngineStepError, abort_output
from rlserve.errors import ModelUnavailableError

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "HeldTooLongError", "PAUSE_MODES", "ENGINE_MODES"]

PAUSE_MODES = ("abort", "wait", "keep")
ENGINE_MODES = ("process", "thread")
DEFAULT_HOLD_TIMEOUT_S = 600.0  # a request held behind a pause waits at most this long (seconds)


class HeldTooLongError(ModelUnavailableError):
    """A request was held behind a pause for longer than the engine's ``hold_timeout_s``; it
    never started. HTTP 503 (the model is unavailable while generation stays paused)."""


@dataclasses.dataclass(eq=False)
class _Request:
    """Front-side state of one request (event-loop side, plus the replica's delivering thread)."""

    request_id: str
    prompt: Any
    params: Any
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event  # set when ``slot`` holds something new
    arrival_time: float  # time.monotonic() seconds
    stream: bool = True  # deliver every step's output (else only the final one)
    slot: Any = None  # newest undelivered output, or the exception that ended the request
    replica: Any = None
    finished: bool = False  # set by the delivering thread when the final item is routed


def _replica_config(config, dp_index: int):
    """A per-replica copy of ``config`` (the engine writes resolved values into its config).

    Replica ``i`` uses GPUs ``device_ids[i*TP:(i+1)*TP]`` (default ids ``0..TP*DP-1``): with
    TP > 1 the TP executor picks them from the full list by ``dp_index``; with TP = 1 the
    single in-process worker follows ``config.device``, so it is set to ``cuda:<id>`` here.

    Raises:
        ValueError: fewer device ids than TP x DP.
    """
    cfg = copy.deepcopy(config)
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if tp == 1 and (dp > 1 or config.device_ids):
        from rlserve.config import resolve_device

        dev = resolve_device(config.device)
        if dev.type == "cuda" and dev.index is None:
            ids = list(config.device_ids) if config.device_ids else list(range(dp * tp))
            if len(ids) < dp * tp:
                raise ValueError(f"device_ids {ids} has fewer than TP x DP = {dp * tp} entries")
            cfg.device = f"cuda:{ids[dp_index]}"
    return cfg


class AsyncEngine:
    """``data_parallel_size`` engine replicas behind one asyncio interface.

    Args:
        config: :class:`~rlserve.config.EngineConfig` (each replica gets a copy).
        weight_version: initial weight version stamped on outputs (default "0").
        engine_factory: ``factory(config, dp_index) -> engine`` (default
            ``LLMEngine(config, dp_index=dp_index)``); tests pass fakes here. A factory runs
            the replicas on threads (it cannot cross a process boundary).
        start_timeout_s: seconds to wait for every replica to load.
        hold_timeout_s: a request that arrives while generation is paused waits at most this
            many seconds for :meth:`resume` (measured from its arrival), then ends with
            :class:`HeldTooLongError` (HTTP 503); None: no bound. Default 600 s, longer than
            any weight update's pause should be (``rlserve serve --pause-hold-timeout``).
        engine_mode: ``"process"`` (one engine-core process per replica) or ``"thread"``;
            default: ``$RLSERVE_ENGINE_MODE``, else ``"process"`` (``"thread"`` with a factory).

    Raises:
        whatever building an engine raises (the first replica's error), after stopping the
        replicas that did start; TimeoutError when a replica takes over ``start_timeout_s``;
        ValueError: an unknown ``engine_mode``, or ``"process"`` with an ``engine_factory``.
    """

    def __init__(self, config, *, weight_version: str = "0", engine_factory=None,
                 start_timeout_s: float = 3600.0, hold_timeout_s: float | None = DEFAULT_HOLD_TIMEOUT_S,
                 engine_mode: str | None = None):
        if engine_mode is None:
            engine_mode = "thread" if engine_factory is not None else os.environ.get("RLSERVE_ENGINE_MODE", "process")
        if engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, got {engine_mode!r}")
        if engine_mode == "process" and engine_factory is not None:
            raise ValueError("an engine_factory runs in this process: use engine_mode='thread'")
        self.config = config
        self.engine_mode = engine_mode
        self.hold_timeout_s = hold_timeout_s
        self._lock = threading.Lock()
        self._weight_version = str(weight_version)
        self.weight_version_sets = 0  # set_weight_version calls (committed weight syncs)
        self._unavailable: str | None = None
        self._closed: str | None = None
        self._paused = False
        self._pause_mode: str | None = None
        self._paused_since: float | None = None  # time.monotonic() of the pause in force
        self._paused_total_s = 0.0  # seconds paused before it
        self._held: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._pause_lock: asyncio.Lock | None = None
        dp = max(1, int(getattr(config, "data_parallel_size", 1) or 1))
        cfgs = [_replica_config(config, i) if hasattr(config, "data_parallel_size") else config for i in range(dp)]
        if engine_mode == "thread":
            from rlserve.engine.thread_replica import ThreadReplica

            if engine_factory is None:
                from rlserve.engine.llm_engine import LLMEngine

                def engine_factory(cfg, dp_index):
                    return LLMEngine(cfg, dp_index=dp_index)

            self._replicas = [ThreadReplica(self, i, lambda cfg=cfg, i=i: engine_factory(cfg, i), self._weight_version)
                              for i, cfg in enumerate(cfgs)]
        else:
            from rlserve.engine.core_client import CoreProcReplica

            tokenizer = _TokenizerOnce(config)
            self._replicas = [CoreProcReplica(self, i, cfg, self._weight_version, tokenizer)
                              for i, cfg in enumerate(cfgs)]
        error = None
        try:
            for r in self._replicas:
                r.start()  # every replica loads at once
            for r in self._replicas:
                try:
                    r.wait_ready(start_timeout_s)
                except BaseException as e:  # noqa: BLE001
                    error = error or e
        except BaseException as e:  # noqa: BLE001 - e.g. a process that could not be started
            error = error or e
        if error is not None:
            self.shutdown()
            raise error
        self.sleep_mode = None  # rlserve.engine.async_sleep.AsyncSleep with enable_sleep_mode
        if getattr(config, "enable_sleep_mode", False):
            from rlserve.engine.async_sleep import AsyncSleep

            self.sleep_mode = AsyncSleep(self)

    # ---- properties -------------------------------------------------------------------
    @property
    def engines(self) -> list:
        """The replicas' engines (thread mode; touch them only through :meth:`run_in_engines`)
        or :class:`~rlserve.engine.replica.EngineView` s of them (process mode)."""
        return [r.engine for r in self._replicas]

    @property
    def engine(self):
        """Replica 0's engine or its view (for read-only facts: tokenizer, vocab size,
        max_model_len, device, dtype)."""
        return self._replicas[0].engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        """The engine's end-of-sequence token ids."""
        return sorted(getattr(self.engine, "eos_token_ids", ()) or ())

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    def core_pids(self) -> list[int]:
        """Process ids of the engine-core processes (empty in thread mode)."""
        return [r.pid for r in self._replicas if getattr(r, "pid", None) is not None]

    @property
    def weight_version(self) -> str:
        """The version stamped on new outputs (str)."""
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every output of the steps that follow."""
        self._weight_version = str(version)
        self.weight_version_sets += 1
        for r in self._replicas:
            r.set_weight_version(self._weight_version)

    def set_unavailable(self, reason: str | None) -> None:
        """While ``reason`` is set, :meth:`generate` raises ModelUnavailableError (503). ``None``
        also lifts any quarantine (:meth:`quarantine`)."""
        self._unavailable = reason
        if reason is None:
            for r in self._replicas:
                r.set_quarantined(False)

    def quarantine(self, engine, reason: str) -> None:
        """Thread mode, on a replica's thread inside a :meth:`run_in_engines` command whose work
        left that replica's weights unusable: from now on :meth:`generate` answers 503 with
        ``reason`` and the replica steps nothing until :meth:`fail_all` ended its requests.
        (Engine-side code that runs in both modes calls ``core.quarantine(reason)`` instead, as
        ``rlserve.transfer.server.engine_calls`` does, and its caller sets the 503.) Unknown ``engine``:
        only the 503."""
        self._unavailable = reason
        for r in self._replicas:
            core = getattr(r, "core", None)
            if core is not None and core.engine is engine:
                core.quarantine(reason)

    async def fail_all(self, exc: BaseException) -> int:
        """End every in-flight and held request with ``exc`` (its :meth:`generate` raises it) and
        abort them in the engines. For weights that became unusable under running requests (a
        weight update that failed after loading part of the model in place): their KV cache and
        every further token would mix two weight sets, so none of them may finish normally.
        Event-loop side. Returns how many requests were ended."""
        reqs = list(self._requests.values())
        for req in reqs:
            if req in self._held:
                self._held.remove(req)
            _put(req, exc)  # final: a later abort output from the engine cannot replace it
        # aborted, then a quarantined replica may step again: it has no requests
        await _wait_all([r.abort_all(lift_quarantine=True) for r in self._replicas])
        return len(reqs)

    @property
    def unavailable_reason(self) -> str | None:
        return self._unavailable

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

    def is_alive(self) -> bool:
        """True while every replica runs (its thread, or its engine-core process)."""
        return self._closed is None and all(r.alive for r in self._replicas)

    def dead_reason(self) -> str | None:
        """Why :meth:`is_alive` is False (None while alive)."""
        if self._closed is not None:
            return self._closed
        for r in self._replicas:
            if not r.alive:
                return getattr(r, "death", None) or f"engine replica {r.index} is not running"
        return None

    @property
    def num_unfinished(self) -> int:
        """Requests submitted to engines and not finished, plus held ones."""
        with self._lock:
            return sum(r.load for r in self._replicas) + len(self._held)

    def request_ids(self) -> list[str]:
        """Ids of the requests in flight or held, in arrival order."""
        return list(self._requests)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def stats(self) -> dict:
        """Sum of the replicas' latest ``engine.stats`` snapshots (numbers added;
        ``kv_cache_usage`` averaged), plus ``num_held``, ``num_unfinished`` (live: submitted
        and not finished, plus held) and ``num_replicas``."""
        total: dict = {}
        for r in self._replicas:
            for k, v in dict(r.stats).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        if "kv_cache_usage" in total:
            total["kv_cache_usage"] /= len(self._replicas)
        total["num_held"] = len(self._held)
        total["num_unfinished"] = self.num_unfinished  # live, not a snapshot
        total["num_replicas"] = len(self._replicas)
        return total

    def _replica_died(self, replica) -> None:
        """A replica's engine-core process died (its delivering thread calls this after ending
        its requests): the held requests end too (nothing sound is left to run them on); this
        is done on their event loops."""
        exc = EngineDeadError(getattr(replica, "death", None) or "an engine replica died")
        for loop in {req.loop for req in list(self._held)}:
            try:
                loop.call_soon_threadsafe(self._fail_held, loop, exc)
            except RuntimeError:  # the loop is closed
                pass

    def _fail_held(self, loop, exc: BaseException) -> None:
        for req in [r for r in self._held if r.loop is loop]:
            self._held.remove(req)
            _put(req, exc)

    # ---- generation -------------------------------------------------------------------
    async def generate(self, prompt, params, request_id: str | None = None, *, stream: bool = True) -> AsyncIterator:
        """Submit one request and yield its cumulative ``RequestOutput`` as it advances; the
        last one has ``finished == True``. A consumer slower than the engine skips
        intermediate outputs (they are cumulative: nothing is lost). Each output carries
        ``weight_version``, ``weight_versions``, ``arrival_time`` and ``first_token_time``
        (``time.monotonic()`` seconds; None before the first token).

        Args:
            prompt: text or a list of token ids.
            params: :class:`~rlserve.engine.sampling_params.SamplingParams`.
            request_id: unique id (default: generated).
            stream: False yields only the final output (cheapest for non-streaming callers).

        Raises:
            ModelUnavailableError: :meth:`set_unavailable` is in effect; ModelSleepingError (a
                subclass) while asleep (sleep mode: :meth:`sleep`).
            InvalidRequestError: the engine refused the request (bad prompt/params, duplicate id).
            EngineStepError: the engine failed while running it.
            EngineDeadError: the engine is shut down.

        Closing the generator early (or cancelling its task) aborts the request.
        """
        if self._unavailable is not None:
            raise ModelUnavailableError(self._unavailable)
        if self.sleep_mode is not None:
            self.sleep_mode.check_generate()
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason() or "the engine is not running")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        from rlserve.errors import InvalidRequestError

        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = _Request(request_id, prompt, params, asyncio.get_running_loop(), asyncio.Event(), time.monotonic(),
                       stream=stream)
        self._requests[request_id] = req
        if self._paused:
            self._held.append(req)
        else:
            self._submit(req)
        done = False
        try:
            while True:
                if req.replica is None and self.hold_timeout_s is not None:  # held (or failed to submit)
                    await self._wait_held(req)
                else:
                    await req.event.wait()
                req.event.clear()
                item, req.slot = req.slot, None
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not done:
                self._abort_req(req)

    async def _wait_held(self, req: _Request) -> None:
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

    def _submit(self, req: _Request) -> None:
        with self._lock:
            replica = min((r for r in self._replicas if r.alive), key=lambda r: r.load, default=None)
            if replica is not None:
                replica.load += 1
        if replica is None:
            _put(req, EngineDeadError(self.dead_reason() or "no engine replica is running"))
            return
        req.replica = replica
        try:
            replica.submit(req)
        except BaseException as e:  # noqa: BLE001 - the replica died meanwhile
            with self._lock:
                replica.load -= 1
            _put(req, e)

    def _deliver(self, items) -> None:
        """Delivering thread → event loops: one ``call_soon_threadsafe`` per loop."""
        by_loop: dict = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

    def _abort_req(self, req: _Request) -> None:
        if req in self._held:
            self._held.remove(req)
            return
        if req.replica is not None and not req.finished:
            req.replica.abort_nowait([req.request_id])

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id (unknown ids are ignored); each ends with a final output
        whose unfinished samples have ``finish_reason == "abort"``."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        futs = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is None:
                continue
            if req in self._held:
                self._held.remove(req)
                _put(req, _stamped_abort(req, self.weight_version))
            elif req.replica is not None:
                futs.append(req.replica.abort([req.request_id]))
        await _wait_all(futs)

    async def abort_all(self) -> int:
        """Abort every in-flight and held request. Returns how many were aborted."""
        n = 0
        for req in list(self._held):
            self._held.remove(req)
            _put(req, _stamped_abort(req, self.weight_version))
            n += 1
        results = await _wait_all([r.abort_all() for r in self._replicas])
        return n + sum(x for x in results if isinstance(x, int))

    # ---- pause / resume ---------------------------------------------------------------
    async def pause(self, mode: str = "abort", clear_cache: bool = False, timeout_s: float | None = None) -> None:
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

        Raises:
            ValueError: unknown mode. TimeoutError: see ``timeout_s``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        async with self._get_pause_lock():
            before = self._pause_mode if self._paused else None
            if not self._paused:
                self._paused_since = time.monotonic()
            self._paused = True
            self._pause_mode = mode
            try:
                await self._pause_locked(mode, clear_cache, timeout_s)
            except BaseException:
                # a pause that did not take effect (timeout, cancelled, an engine error) must not
                # leave generation paused with nobody to resume it: back to the state before it
                await self._restore_pause(before)
                raise
        logger.info("generation paused (mode=%s, clear_cache=%s)", mode, clear_cache)

    async def _restore_pause(self, before: str | None) -> None:
        """Undo a failed :meth:`pause` (pause lock held): resume when generation was running
        before it (held requests are submitted), else return to the earlier pause's mode (a
        keep-pause freezes the replicas again)."""
        if before is None:
            await self._resume_locked()
            logger.warning("pause did not take effect; generation resumed (it was not paused before)")
            return
        self._pause_mode = before
        if before == "keep":
            await _wait_all([r.set_frozen(True) for r in self._replicas])
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
        await _wait_all(futs, raise_first=True)
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume(self) -> None:
        """Continue generation: unfreeze replicas and submit the held requests."""
        async with self._get_pause_lock():
            n = await self._resume_locked()
        logger.info("generation resumed (%d held request(s) submitted)", n)

    async def _resume_locked(self) -> int:
        await _wait_all([r.set_frozen(False) for r in self._replicas])
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

    # ---- sleep mode (rlserve.engine.async_sleep; enable_sleep_mode) -----------------------
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
    async def call_engines(self, target: str, *args, timeout_s: float | None = None) -> list:
        """Run ``target(core, *args)`` on every replica between two steps (also while paused),
        where ``target`` is ``"package.module:function"`` and ``core`` the replica's
        :class:`~rlserve.engine.core.EngineCore` (``core.engine`` is its engine,
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
        futs = [r.call(target, *args) for r in self._replicas]
        coro = _wait_all(futs, raise_first=True)
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
        coro = _wait_all(futs, raise_first=True)
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))

    async def reset_prefix_cache(self) -> None:
        """Forget every replica's cached prefixes."""
        await _wait_all([r.reset_prefix_cache() for r in self._replicas], raise_first=True)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Event-loop side, first step of stopping (a SIGINT/SIGTERM handler): new requests are
        refused and every request in flight or held ends now with EngineDeadError (HTTP 503), so
        their connections close at once; the engines stop too."""
        self._closed = reason
        self._held = []
        for req in list(self._requests.values()):
            _put(req, EngineDeadError(reason))
        for r in self._replicas:
            r.stop()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the replicas (in-flight requests fail with EngineDeadError) and free the
        engines: threads are joined, engine-core processes told to exit and killed (with their
        TP workers) if they have not within a second. Safe to call twice, from any thread."""
        if self._closed is None:
            self._closed = "the engine is shut down"
        for r in self._replicas:
            r.stop()
        for r in self._replicas:
            r.join(timeout_s)
        held, self._held = self._held, []
        self._deliver([(req, EngineDeadError(self._closed)) for req in held])


class _TokenizerOnce:
    """Loads the tokenizer in this (the API) process once, for every replica's view."""

    def __init__(self, config):
        self.config = config
        self._tok = None
        self._loaded = False

    def __call__(self):
        if not self._loaded:
            if not getattr(self.config, "skip_tokenizer_init", False):
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.config.tokenizer or self.config.model)
            self._loaded = True
        return self._tok


def _put(req: _Request, item) -> None:
    """Event-loop side: the newest item replaces an undelivered one, except that the final
    item (an exception or a finished output) is never replaced (nothing follows it)."""
    if req.slot is not None and (isinstance(req.slot, BaseException) or req.slot.finished):
        return
    req.slot = item
    req.event.set()


def _put_all(batch) -> None:
    for req, item in batch:
        _put(req, item)


def _stamped_abort(req: _Request, version: str):
    out = abort_output(req.request_id, req.prompt, getattr(req.params, "n", 1) or 1)
    out.weight_version = version
    out.weight_versions = [version]
    out.arrival_time = req.arrival_time
    return out


async def _wait_all(futs, raise_first: bool = False) -> list:
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
