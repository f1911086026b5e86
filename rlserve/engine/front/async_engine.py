"""Asyncio front of the engine: data-parallel replicas, each in its own engine-core process
(default) or on a thread of this process.

Where the replicas run (``engine_mode``):

* ``"process"`` (default): one engine-core process per replica (:mod:`rlserve.engine.front.core_client`,
  :mod:`rlserve.engine.core.core_proc`); the step loop, scheduler, KV cache and model runner run off
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

This module submits requests and delivers their outputs. Pausing, and the requests held meanwhile:
:mod:`rlserve.engine.front.async_pause`; calls into the engines, sleep mode and the stop:
:mod:`rlserve.engine.front.async_control`. Building the replicas: :mod:`rlserve.engine.front.replica_setup`;
the per-request mailbox: :mod:`rlserve.engine.front.front_request`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import AsyncIterator, Callable

from rlserve import envs
from rlserve.engine.front.async_control import EngineControl
from rlserve.engine.front.async_pause import DEFAULT_HOLD_TIMEOUT_S, PAUSE_MODES, HeldTooLongError, PauseControl
from rlserve.engine.front.front_request import (FrontRequest, Wakeup, abandon, mark_delivered, put, put_all,
                                                stamped_abort, wait_all)
from rlserve.engine.prefix_view import plain_lists
from rlserve.engine.front.replica_health import ReplicaHealth
from rlserve.engine.front.replica_setup import build_replicas
from rlserve.engine.front.weight_state import WeightsControl, WeightState
from rlserve.errors import EngineDeadError, ModelUnavailableError

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "HeldTooLongError", "PAUSE_MODES", "ENGINE_MODES"]

ENGINE_MODES = ("process", "thread")


class AsyncEngine(ReplicaHealth, PauseControl, WeightsControl, EngineControl):
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
        stream_interval: new tokens per streamed output at least (vLLM's ``--stream-interval``,
            default 1: every step's output); a request's ``params.stream_interval`` can only
            raise it. The first and last outputs are never held back
            (:mod:`rlserve.engine.front.front_request`).

    Raises:
        whatever building an engine raises (the first replica's error), after stopping the
        replicas that did start; TimeoutError when a replica takes over ``start_timeout_s``;
        ValueError: an unknown ``engine_mode``, or ``"process"`` with an ``engine_factory``;
        ``stream_interval`` below 1.
        max_engine_restarts / engine_restart_window_s / serve_checkpoint_after_restart: process
            mode: an engine-core process that dies is restarted, at most ``max_engine_restarts``
            times within ``engine_restart_window_s`` seconds (0: never, the default here;
            ``rlserve serve``: 3 in 60 s); see :mod:`rlserve.engine.front.core_restart`.
        tokenizer: process mode: the tokenizer of ``config.tokenizer or config.model``, already
            loaded in this process (``rlserve serve``'s parser check), used instead of loading
            it again; None loads it.
        api_server_count: process mode: API processes sharing the engine cores (``rlserve serve
            --api-server-count``; :mod:`rlserve.engine.front.front_sync`). This one starts the cores
            unless ``attach`` is given.
        attach: in API process ``client_index`` > 0: ``{"client_index": i, "core_dirs": [socket
            directory of each replica's core]}``; the cores are API process 0's
            (:class:`~rlserve.engine.front.core_attach.AttachedCoreReplica`).
        on_started: ``fn(replicas)`` called once every replica was started, before the wait for them to be
            ready (on the calling thread): ``rlserve serve --api-server-count N`` starts API processes
            1..N-1 there, beside the cores' start, as vLLM does (:mod:`rlserve.server.multi_api`); what it
            raises fails the start as a replica's error would.
    """

    def __init__(self, config, *, weight_version: str = "0", engine_factory=None,
                 start_timeout_s: float = 3600.0, hold_timeout_s: float | None = DEFAULT_HOLD_TIMEOUT_S,
                 engine_mode: str | None = None, stream_interval: int = 1, max_engine_restarts: int = 0,
                 engine_restart_window_s: float = 60.0, serve_checkpoint_after_restart: bool = False,
                 tokenizer=None, api_server_count: int = 1, attach: dict | None = None,
                 on_started: Callable[[list], None] | None = None):
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {stream_interval!r}")
        self.stream_interval = stream_interval
        if engine_mode is None:
            engine_mode = "thread" if engine_factory is not None else envs.RLSERVE_ENGINE_MODE
        if engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, got {engine_mode!r}")
        if engine_mode == "process" and engine_factory is not None:
            raise ValueError("an engine_factory runs in this process: use engine_mode='thread'")
        self.config = config
        self.engine_mode = engine_mode
        self.hold_timeout_s = hold_timeout_s
        self._lock = threading.Lock()
        # valid or lost, and the version label (shared by weight syncs, sleep mode, restarts)
        self.weights = WeightState(str(weight_version))
        self._closed: str | None = None
        self._paused = False
        self._pause_mode: str | None = None
        self._paused_since: float | None = None  # time.monotonic() of the pause in force
        self._paused_total_s = 0.0  # seconds paused before it
        self._held: list[FrontRequest] = []
        # the API's LoRA ids read again at submission: old id -> current id, raises if gone (lora_routes)
        self.lora_resolver: Callable[[int], int] | None = None
        self._requests: dict[str, FrontRequest] = {}
        self._ids = itertools.count()
        self._pause_lock: asyncio.Lock | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (EngineControl.bind_loop)
        self.restarter = None  # rlserve.engine.front.core_restart.CoreRestarter (process mode, restarts on)
        # ``sink(generation_tokens, prompt_tokens)``: the engines' tokens as they are made (Replica.count_tokens;
        # on the replicas' delivering threads, before the outputs that hold them); the server's metrics set it
        self.token_sink: Callable[[int, int], None] | None = None
        from rlserve.engine.front.front_sync import FrontSync

        if api_server_count > 1 and (engine_mode != "process" or max_engine_restarts):
            raise ValueError("several API processes need engine_mode='process' and no engine-core restarts")
        self.front_sync = FrontSync(self, api_server_count, attach["client_index"] if attach else 0)
        if engine_mode == "process" and max_engine_restarts:
            from rlserve.engine.front.core_restart import CoreRestarter

            self.restarter = CoreRestarter(self, max_engine_restarts, engine_restart_window_s,
                                           serve_checkpoint_after_restart, start_timeout_s)
        self._replicas = build_replicas(self, config, engine_mode, engine_factory, self.weights.version, tokenizer,
                                        api_server_count, attach)
        error = None
        try:
            for r in self._replicas:
                r.start()  # every replica loads at once
            if on_started is not None:
                on_started(self._replicas)
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
        self.sleep_mode = None  # rlserve.engine.front.async_sleep.AsyncSleep with enable_sleep_mode
        # (API process 0's only: the others forward the sleep routes to it and refuse as it says, front_sync)
        if getattr(config, "enable_sleep_mode", False) and attach is None:
            from rlserve.engine.front.async_sleep import AsyncSleep

            self.sleep_mode = AsyncSleep(self)

    # ---- properties -------------------------------------------------------------------
    @property
    def engines(self) -> list:
        """The replicas' engines (thread mode; touch them only through :meth:`run_in_engines`)
        or :class:`~rlserve.engine.front.replica.EngineView` s of them (process mode)."""
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
    def num_unfinished(self) -> int:
        """Requests submitted to engines and not finished, plus held ones."""
        with self._lock:
            return sum(r.load for r in self._replicas) + len(self._held)

    def request_ids(self) -> list[str]:
        """Ids of the requests in flight or held, in arrival order."""
        return list(self._requests)

    def ids_matching(self, wanted) -> list[str]:
        """The ids of :meth:`request_ids` that ``wanted`` names: an id itself, or its response's id
        (``cmpl-X`` names every prompt's ``cmpl-X-i``)."""
        wanted = set(wanted)
        return [r for r in self._requests if r in wanted or r.rsplit("-", 1)[0] in wanted]

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
        is done on their event loops. With restarts on, the restarter takes it from here."""
        exc = EngineDeadError(getattr(replica, "death", None) or "an engine replica died")
        for loop in {req.loop for req in list(self._held)}:
            try:
                loop.call_soon_threadsafe(self._fail_held, loop, exc)
            except RuntimeError:  # the loop is closed
                pass
        if self.restarter is not None:
            self.restarter.on_death(replica)

    def _fail_held(self, loop, exc: BaseException) -> None:
        for req in [r for r in self._held if r.loop is loop]:
            self._held.remove(req)
            put(req, exc)

    # ---- generation -------------------------------------------------------------------
    async def generate(self, prompt, params, request_id: str | None = None, *, stream: bool = True,
                       sink=None, views: bool = False, on_abandoned=None) -> AsyncIterator:
        """Submit one request and yield its cumulative ``RequestOutput`` as it advances; the last one has
        ``finished == True``. A consumer slower than the engine skips intermediate outputs (they are cumulative:
        nothing is lost); with a stream interval N > 1 (:attr:`stream_interval`, ``params.stream_interval``) an
        output is yielded only once a sample has N new tokens, a sample finished, or it is the first or last. Each
        output carries ``weight_version``, ``weight_versions``, ``arrival_time`` and ``first_token_time``
        (``time.monotonic()`` seconds; None before the first token).

        Args:
            prompt: text or a list of token ids.
            params: :class:`~rlserve.engine.sampling_params.SamplingParams`.
            request_id: unique id (default: generated).
            stream: False yields only the final output (cheapest for non-streaming callers).
            sink: ``sink(output) -> bool``, called on the event loop with unfinished outputs before they are
                yielded; one it takes (True) is not (:mod:`~rlserve.engine.front.front_request`: direct writes).
            views: True (rlserve's routes): an unfinished output's ``token_ids`` / ``logprobs`` may be O(1)
                read-only views (:mod:`rlserve.engine.prefix_view`); False: lists (a copy each, as before).
            on_abandoned: ``on_abandoned(item)`` with the request's final item when the generator is closed
                before it (:func:`~rlserve.engine.front.front_request.abandon`: the abort's output, its tokens).

        Raises:
            ModelUnavailableError: :meth:`set_unavailable` is in effect; ModelSleepingError (a subclass) asleep.
            InvalidRequestError: the engine refused the request (bad prompt/params, duplicate id).
            EngineStepError: the engine failed while running it.
            EngineDeadError: the engine is shut down.

        Closing the generator early (or cancelling its task) aborts the request."""
        refusal = self.front_sync.refusal  # (API processes > 0 while process 0 sleeps: front_sync)
        if refusal is not None:
            raise refusal()
        if self.sleep_mode is not None:
            self.sleep_mode.check_generate()
        if self.weights.reason is not None:
            raise ModelUnavailableError(self.weights.reason, code=self.weights.code)
        if not self.is_alive():
            raise EngineDeadError(self.dead_reason() or "the engine is not running")
        loop = self.bind_loop()  # (the request's own loop gets its outputs: FrontRequest.loop)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        from rlserve.errors import InvalidRequestError

        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = FrontRequest(request_id, prompt, params, loop, Wakeup(loop), time.monotonic(),
                           stream=stream,
                           interval=max(self.stream_interval, getattr(params, "stream_interval", None) or 1),
                           sink=sink)
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
                elif not req.event.is_set():
                    await req.event.future()
                req.event.clear()
                item, req.slot = req.slot, None
                if item is None:
                    continue
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                mark_delivered(req, item)
                yield item if views else plain_lists(item)
                if done:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not done:
                self._abort_req(req, on_abandoned)

    def _submit(self, req: FrontRequest) -> None:
        if self.lora_resolver is not None and getattr(req.params, "lora_int_id", 0):
            try:
                req.params.lora_int_id = self.lora_resolver(req.params.lora_int_id)
            except Exception as e:  # noqa: BLE001 - the adapter was unloaded: this request's answer
                put(req, e)
                return
        with self._lock:
            replica = min((r for r in self._replicas if r.alive), key=lambda r: r.load, default=None)
            if replica is not None:
                replica.load += 1
        if replica is None:
            put(req, EngineDeadError(self.dead_reason() or "no engine replica is running"))
            return
        req.replica = replica
        try:
            replica.submit(req)
        except BaseException as e:  # noqa: BLE001 - the replica died meanwhile
            with self._lock:
                replica.load -= 1
            put(req, e)

    def _deliver(self, items) -> None:
        """Delivering thread → event loops: one ``call_soon_threadsafe`` per loop (put at once
        where the caller runs on that loop: the engine-core replicas' outputs are handled there)."""
        by_loop: dict = {}
        for req, item in items:
            by_loop.setdefault(req.loop, []).append((req, item))
        here = asyncio._get_running_loop()
        for loop, batch in by_loop.items():
            if loop is here:
                put_all(batch)
                continue
            try:
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

    def _abort_req(self, req: FrontRequest, on_abandoned=None) -> None:
        if req in self._held:
            self._held.remove(req)
            put(req, stamped_abort(req, self.weight_version))  # (the final item abandon() finds)
        elif req.replica is not None and not req.finished:
            req.replica.abort_nowait([req.request_id])
        abandon(req, on_abandoned)

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
                put(req, stamped_abort(req, self.weight_version))
            elif req.replica is not None:
                futs.append(req.replica.abort([req.request_id]))
        await wait_all(futs)

    async def abort_all(self) -> int:
        """Abort every in-flight and held request (the other API processes' too, ``--api-server-count``,
        their held ones counted by their acks). Returns how many were aborted."""
        n = self.abort_held()
        n += await self.front_sync.publish(abort_held=True)
        results = await wait_all([r.abort_all() for r in self._replicas])
        return n + sum(x for x in results if isinstance(x, int))

    def abort_held(self) -> int:
        """End every held request with an abort output. Returns how many."""
        held, self._held = self._held, []
        for req in held:
            put(req, stamped_abort(req, self.weight_version))
        return len(held)
