"""Asyncio front of the engine: data-parallel replicas stepping on background threads.

Each :class:`~rlserve.engine.llm_engine.LLMEngine` replica is owned by one thread
(``rlserve-engine-<i>``) that runs its step loop; *every* call into that engine (add,
abort, step, ``run_in_engines`` functions) runs on that thread, so the engine needs no
locking and the HTTP event loop never blocks on a forward pass. Outputs reach asyncio
through ``loop.call_soon_threadsafe`` (one hop per step and event loop, not per request)
into a one-slot mailbox per request: outputs are cumulative, so a consumer that falls
behind simply gets the newest one (its deltas just get bigger) instead of a backlog, and a
non-streaming consumer (``generate(..., stream=False)``) is woken only once, at the end.

Pause semantics follow vLLM's ``pause_generation``:

* ``abort``: in-flight requests end now with ``finish_reason == "abort"``.
* ``wait``: requests already submitted run to completion; :meth:`AsyncEngine.pause`
  returns once every replica is idle.
* ``keep``: the step loops stop between two steps and keep all state (KV cache, partial
  outputs); :meth:`AsyncEngine.resume` continues exactly where they stopped.

In every mode requests that arrive while paused are *held* (queued in the front, never
rejected) and start on resume. ``clear_cache=True`` resets every replica's prefix cache
once the pause has taken effect. ``run_in_engines`` works while paused (that is how weight
updates run with the engines frozen).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from rlserve.errors import ModelUnavailableError, RLServeError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
_IDLE_POLL_S = 1.0  # an idle engine thread wakes at least this often (seconds)
_STATS_EVERY_S = 0.2  # engine stats are snapshotted at most this often (seconds)
DEFAULT_HOLD_TIMEOUT_S = 600.0  # a request held behind a pause waits at most this long (seconds)


class EngineStepError(RLServeError):
    """An engine step (or adding a request) raised unexpectedly. The requests that were in
    that replica fail with this error (HTTP 500); the replica keeps serving."""


class EngineDeadError(RLServeError):
    """The engine threads are stopped (shutdown or a fatal error). HTTP 503."""


class HeldTooLongError(ModelUnavailableError):
    """A request was held behind a pause for longer than the engine's ``hold_timeout_s``; it
    never started. HTTP 503 (the model is unavailable while generation stays paused)."""


@dataclasses.dataclass(eq=False)
class _Request:
    """Front-side state of one request (shared by the event loop and one engine thread)."""

    request_id: str
    prompt: Any
    params: Any
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event  # set when ``slot`` holds something new
    arrival_time: float  # time.monotonic() seconds
    stream: bool = True  # deliver every step's output (else only the final one)
    slot: Any = None  # newest undelivered output, or the exception that ended the request
    first_token_time: float | None = None  # time.monotonic() seconds, set on the engine thread
    replica: "_Replica | None" = None
    versions: list = dataclasses.field(default_factory=list)
    last_output: Any = None
    finished: bool = False  # set on the engine thread when the final item is produced


class _Replica:
    """One engine replica and the thread that owns it."""

    def __init__(self, front: "AsyncEngine", index: int, factory: Callable[[], Any]):
        self.front = front
        self.index = index
        self.engine = None
        self._factory = factory
        self._cmds: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self.frozen = False  # keep-mode pause: no stepping
        # weights left unusable by a command of this thread (AsyncEngine.quarantine): no stepping
        # until fail_all ended the requests
        self.quarantined = False
        self.requests: dict[str, _Request] = {}  # engine-thread only
        self._streaming = _StreamingIds(self.requests)
        self.load = 0  # unfinished requests assigned here (guarded by front._lock)
        self._drain_waiters: list[concurrent.futures.Future] = []
        self.stats: dict = {}
        self._stats_time = 0.0
        self.ready = concurrent.futures.Future()
        self.alive = False
        self.thread = threading.Thread(target=self._main, name=f"rlserve-engine-{index}", daemon=True)

    # ---- posting work onto the thread ------------------------------------------------
    def post(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; returns a concurrent Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineDeadError(f"engine replica {self.index} is not running"))
            return fut
        self._cmds.append((fn, fut))
        self._wakeup.set()
        return fut

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    # ---- thread body ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self.ready.set_exception(e)
            return
        self.alive = True
        self.ready.set_result(self.engine)
        step_failures = 0
        was_busy = True
        try:
            while True:
                self._wakeup.clear()
                self._run_commands()
                if self._stopping:
                    break
                busy = self.engine.has_unfinished_requests()
                halted = self.frozen or self.quarantined
                if halted or not busy:
                    self._snapshot_stats(force=was_busy)  # fresh numbers as soon as it goes idle
                    was_busy = False
                if not busy:
                    self._resolve_drain_waiters()
                if halted or not busy:
                    self._wakeup.wait(_IDLE_POLL_S)
                    continue
                try:
                    if getattr(self.engine, "supports_output_filter", False):
                        outs = self.engine.step(outputs_for=self._streaming)
                        advanced = self.engine.last_step_request_ids
                    else:
                        outs, advanced = self.engine.step(), None
                    step_failures = 0
                except Exception as e:  # noqa: BLE001 - must not kill the loop
                    step_failures += 1
                    self._fail_all(e)
                    if step_failures > 1:
                        time.sleep(min(0.05 * step_failures, 1.0))  # do not spin on a broken engine
                    continue
                self._dispatch(outs, advanced)
                self._snapshot_stats()
                was_busy = True
        except BaseException as e:  # noqa: BLE001 - a bug in this loop itself
            logger.exception("engine replica %d loop crashed", self.index)
            self._fail_all(e)
        finally:
            self.alive = False
            for fn, fut in self._drain_cmds():
                fut.set_exception(EngineDeadError(f"engine replica {self.index} stopped"))
            for fut in self._drain_waiters:
                if not fut.done():
                    fut.set_exception(EngineDeadError(f"engine replica {self.index} stopped"))
            self._fail_all(EngineDeadError(f"engine replica {self.index} stopped"), abort_in_engine=False)
            shutdown = getattr(self.engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # noqa: BLE001
                    logger.exception("engine replica %d shutdown failed", self.index)

    def _drain_cmds(self):
        while self._cmds:
            yield self._cmds.popleft()

    def _run_commands(self) -> None:
        for fn, fut in self._drain_cmds():
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

    def _snapshot_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._stats_time < _STATS_EVERY_S:
            return
        self._stats_time = now
        try:
            self.stats = dict(self.engine.stats)
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("stats snapshot failed", exc_info=True)

    def _resolve_drain_waiters(self) -> None:
        if self._drain_waiters:
            waiters, self._drain_waiters = self._drain_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    # ---- request bookkeeping (engine thread) ------------------------------------------
    def add(self, req: _Request) -> None:
        """Engine-thread side of submitting ``req``; an engine error fails only it."""
        try:
            self.engine.add_request(req.request_id, req.prompt, req.params)
        except Exception as e:  # noqa: BLE001 - InvalidRequestError and bugs alike
            self._finish(req, e)
            self.front._deliver([(req, e)])
            return
        self.requests[req.request_id] = req

    def abort(self, request_ids) -> None:
        """Abort on the engine thread; each request gets a final "abort" output."""
        present = [r for r in request_ids if r in self.requests]
        if not present:
            return
        try:
            outs = self.engine.abort_request(present) or []
        except Exception:  # noqa: BLE001
            logger.exception("abort_request failed on replica %d", self.index)
            outs = []
        by_id = {o.request_id: o for o in outs}
        items = []
        for rid in present:
            req = self.requests.pop(rid)
            out = by_id.get(rid) or _abort_output(req)
            self._stamp(req, out, bump=False)
            out.finished = True
            self._finish(req, None)
            items.append((req, out))
        self.front._deliver(items)

    def abort_all(self) -> int:
        n = len(self.requests)
        self.abort(list(self.requests))
        return n

    def wait_drained(self) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._drain_waiters.append(fut)
        return fut

    def _stamp(self, req: _Request, out, bump: bool = True) -> None:
        if req.first_token_time is None and any(c.token_ids for c in out.outputs):
            req.first_token_time = time.monotonic()
        version = self.front.weight_version
        if bump and (not req.versions or req.versions[-1] != version):
            req.versions.append(version)
        if not req.versions:
            req.versions.append(version)
        try:
            out.weight_version = req.versions[-1]
            out.weight_versions = list(req.versions)
            out.arrival_time = req.arrival_time
            out.first_token_time = req.first_token_time
        except AttributeError:  # an output type with __slots__; stamping is best effort
            pass

    def _finish(self, req: _Request, error) -> None:
        req.finished = True
        with self.front._lock:
            self.load -= 1

    def _dispatch(self, outs, advanced=None) -> None:
        """Deliver this step's outputs. ``advanced``: ids of every request that got tokens (the
        engine builds outputs only for streamed and finished requests): their first-token time
        and weight versions are kept here, without an output."""
        if advanced:
            version = self.front.weight_version
            now = None
            for rid in advanced:
                req = self.requests.get(rid)
                if req is None:
                    continue
                if req.first_token_time is None:
                    req.first_token_time = now = now or time.monotonic()
                if not req.versions or req.versions[-1] != version:
                    req.versions.append(version)
        items = []
        for out in outs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted meanwhile, or not ours
            self._stamp(req, out)
            req.last_output = out
            if out.finished:
                del self.requests[out.request_id]
                self._finish(req, None)
                items.append((req, out))
            elif req.stream:
                items.append((req, out))
        if items:
            self.front._deliver(items)

    def _fail_all(self, exc: BaseException, abort_in_engine: bool = True) -> None:
        if not self.requests:
            if abort_in_engine and self.engine is not None:
                _try_abort_all(self.engine)
            return
        err = exc if isinstance(exc, EngineDeadError) else EngineStepError(
            f"engine replica {self.index} failed while generating: {type(exc).__name__}: {exc}"
        )
        if not isinstance(exc, EngineDeadError):
            logger.error("engine replica %d step failed; failing %d request(s)", self.index, len(self.requests),
                         exc_info=exc)
        reqs = list(self.requests.values())
        self.requests.clear()
        if abort_in_engine:
            try:
                self.engine.abort_request([r.request_id for r in reqs])
            except Exception:  # noqa: BLE001
                logger.exception("abort after a failed step also failed on replica %d", self.index)
                _try_abort_all(self.engine)
        for r in reqs:
            self._finish(r, err)
        self.front._deliver([(r, err) for r in reqs])


class _StreamingIds:
    """``rid in self``: the engine should build a per-step output for request ``rid`` -- a
    streamed request, or one this replica does not know (its output is then dropped anyway)."""

    def __init__(self, requests: dict):
        self.requests = requests

    def __contains__(self, rid) -> bool:
        req = self.requests.get(rid)
        return req is None or req.stream


def _try_abort_all(engine) -> None:
    fn = getattr(engine, "abort_all", None)
    try:
        if callable(fn):
            fn()
    except Exception:  # noqa: BLE001
        logger.exception("abort_all failed")


def _abort_output(req: _Request):
    """Final "abort" output for a request the engine gave no output for."""
    from rlserve.engine.outputs import CompletionOutput, RequestOutput

    last = req.last_output
    if last is not None:
        out = copy.copy(last)
        outs = []
        for c in last.outputs:
            c2 = copy.copy(c)
            if c2.finish_reason is None:
                c2.finish_reason = "abort"
            outs.append(c2)
        out.outputs = outs
        return out
    n = getattr(req.params, "n", 1) or 1
    prompt_text = req.prompt if isinstance(req.prompt, str) else None
    prompt_ids = list(req.prompt) if isinstance(req.prompt, (list, tuple)) else []
    return RequestOutput(
        request_id=req.request_id,
        prompt=prompt_text,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=None,
        outputs=[CompletionOutput(index=i, finish_reason="abort") for i in range(n)],
        finished=True,
    )


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
            ``LLMEngine(config, dp_index=dp_index)``); tests pass fakes here.
        start_timeout_s: seconds to wait for every replica to load.
        hold_timeout_s: a request that arrives while generation is paused waits at most this
            many seconds for :meth:`resume` (measured from its arrival), then ends with
            :class:`HeldTooLongError` (HTTP 503); None: no bound. Default 600 s, longer than
            any weight update's pause should be (``rlserve serve --pause-hold-timeout``).

    Raises:
        whatever building an engine raises (the first replica's error), after stopping the
        replicas that did start; TimeoutError when a replica takes over ``start_timeout_s``.
    """

    def __init__(self, config, *, weight_version: str = "0", engine_factory=None,
                 start_timeout_s: float = 3600.0, hold_timeout_s: float | None = DEFAULT_HOLD_TIMEOUT_S):
        if engine_factory is None:
            from rlserve.engine.llm_engine import LLMEngine

            def engine_factory(cfg, dp_index):
                return LLMEngine(cfg, dp_index=dp_index)

        self.config = config
        self.hold_timeout_s = hold_timeout_s
        self._lock = threading.Lock()
        self._weight_version = str(weight_version)
        self._unavailable: str | None = None
        self._paused = False
        self._pause_mode: str | None = None
        self._paused_since: float | None = None  # time.monotonic() of the pause in force
        self._paused_total_s = 0.0  # seconds paused before it
        self._held: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._pause_lock: asyncio.Lock | None = None
        dp = max(1, int(getattr(config, "data_parallel_size", 1) or 1))
        self._replicas = []
        for i in range(dp):
            cfg = _replica_config(config, i) if hasattr(config, "data_parallel_size") else config
            self._replicas.append(_Replica(self, i, lambda cfg=cfg, i=i: engine_factory(cfg, i)))
        for r in self._replicas:
            r.thread.start()
        error = None
        for r in self._replicas:
            try:
                r.ready.result(timeout=start_timeout_s)
            except concurrent.futures.TimeoutError:
                error = error or TimeoutError(f"engine replica {r.index} did not start in {start_timeout_s}s")
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            self.shutdown()
            raise error

    # ---- properties -------------------------------------------------------------------
    @property
    def engines(self) -> list:
        """The replicas' engines (touch them only through :meth:`run_in_engines`)."""
        return [r.engine for r in self._replicas]

    @property
    def engine(self):
        """Replica 0's engine (for read-only facts: tokenizer, vocab size, max_model_len)."""
        return self._replicas[0].engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def weight_version(self) -> str:
        """The version stamped on new outputs (str)."""
        return self._weight_version

    def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every output produced from now on."""
        self._weight_version = str(version)

    def set_unavailable(self, reason: str | None) -> None:
        """While ``reason`` is set, :meth:`generate` raises ModelUnavailableError (503). ``None``
        also lifts any :meth:`quarantine`."""
        self._unavailable = reason
        if reason is None:
            for r in self._replicas:
                r.quarantined = False

    def quarantine(self, engine, reason: str) -> None:
        """On a replica's thread, inside a :meth:`run_in_engines` command whose work left that
        replica's weights unusable (a weight update that failed after writing into them): from
        now on :meth:`generate` answers 503 with ``reason``, and the replica steps nothing until
        :meth:`fail_all` has ended its requests, so no token is computed on the broken weights
        in between (an event-loop call that marks the model unavailable comes only after the
        command returned, and the replica would step first). Unknown ``engine``: only the 503."""
        self._unavailable = reason
        for r in self._replicas:
            if r.engine is engine:
                r.quarantined = True

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
        # aborted, then a quarantined replica (see quarantine) may step again: it has no requests
        await _wait_all([r.post(lambda r=r: (r.abort_all(), setattr(r, "quarantined", False))[0])
                         for r in self._replicas])
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
        """True while every replica's thread is running."""
        return all(r.alive for r in self._replicas)

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
            for k, v in r.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        if "kv_cache_usage" in total:
            total["kv_cache_usage"] /= len(self._replicas)
        total["num_held"] = len(self._held)
        total["num_unfinished"] = self.num_unfinished  # live, not a snapshot
        total["num_replicas"] = len(self._replicas)
        return total

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
            ModelUnavailableError: :meth:`set_unavailable` is in effect.
            InvalidRequestError: the engine refused the request (bad prompt/params, duplicate id).
            EngineStepError: the engine failed while running it.
            EngineDeadError: the engine is shut down.

        Closing the generator early (or cancelling its task) aborts the request.
        """
        if self._unavailable is not None:
            raise ModelUnavailableError(self._unavailable)
        if not self.is_alive():
            raise EngineDeadError("the engine is not running")
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
            _put(req, EngineDeadError("no engine replica is running"))
            return
        req.replica = replica
        fut = replica.post(lambda: replica.add(req))
        if fut.done() and fut.exception() is not None:  # the replica died meanwhile
            with self._lock:
                replica.load -= 1
            _put(req, fut.exception())

    def _deliver(self, items) -> None:
        """Engine thread → event loops: one ``call_soon_threadsafe`` per loop."""
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
            req.replica.post(lambda: req.replica.abort([req.request_id]))

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
                futs.append(req.replica.post(lambda r=req: r.replica.abort([r.request_id])))
        await _wait_all(futs)

    async def abort_all(self) -> int:
        """Abort every in-flight and held request. Returns how many were aborted."""
        n = 0
        for req in list(self._held):
            self._held.remove(req)
            _put(req, _stamped_abort(req, self.weight_version))
            n += 1
        results = await _wait_all([r.post(r.abort_all) for r in self._replicas])
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
            await _wait_all([r.post(lambda r=r: setattr(r, "frozen", True)) for r in self._replicas])
        logger.warning("pause did not take effect; generation stays paused by the earlier pause (mode=%s)", before)

    async def _pause_locked(self, mode: str, clear_cache: bool, timeout_s: float | None) -> None:
        if mode == "keep":  # frozen, with stats() as of the freeze
            futs = [r.post(lambda r=r: (setattr(r, "frozen", True), r._snapshot_stats(force=True)))
                    for r in self._replicas]
        elif mode == "abort":
            futs = [r.post(lambda r=r: (r.abort_all(), setattr(r, "frozen", False))[0])
                    for r in self._replicas]
        else:  # wait: a replica frozen by an earlier keep-pause must step to drain
            futs = [r.post(lambda r=r: (setattr(r, "frozen", False), r.wait_drained())[1])
                    for r in self._replicas]
        coro = self._pause_effect(futs, mode, clear_cache)
        if timeout_s is None:
            await coro
        else:
            await asyncio.wait_for(coro, timeout_s)

    async def _pause_effect(self, futs, mode, clear_cache) -> None:
        results = await _wait_all(futs, raise_first=True)
        if mode == "wait":
            await _wait_all(results, raise_first=True)  # the drain futures themselves
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume(self) -> None:
        """Continue generation: unfreeze replicas and submit the held requests."""
        async with self._get_pause_lock():
            n = await self._resume_locked()
        logger.info("generation resumed (%d held request(s) submitted)", n)

    async def _resume_locked(self) -> int:
        await _wait_all([r.post(lambda r=r: setattr(r, "frozen", False)) for r in self._replicas])
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

    # ---- engine access ----------------------------------------------------------------
    async def run_in_engines(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> list:
        """Run ``fn(engine)`` on every replica's thread between steps (also while paused).

        Returns:
            the results in replica order.

        Raises:
            the first exception raised by ``fn`` (after all replicas finished);
            TimeoutError after ``timeout_s`` seconds (the calls still complete later).
        """
        futs = [r.post(lambda r=r: fn(r.engine)) for r in self._replicas]
        coro = _wait_all(futs, raise_first=True)
        return await (coro if timeout_s is None else asyncio.wait_for(coro, timeout_s))

    async def reset_prefix_cache(self) -> None:
        """Forget every replica's cached prefixes."""
        await self.run_in_engines(lambda e: e.reset_prefix_cache())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine threads (in-flight requests fail with EngineDeadError) and
        shut the engines down. Safe to call twice."""
        for r in self._replicas:
            r.stop()
        for r in self._replicas:
            if r.thread.is_alive() and r.thread is not threading.current_thread():
                r.thread.join(timeout_s)


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
    out = _abort_output(req)
    out.weight_version = version
    out.weight_versions = [version]
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
