"""One engine replica's request bookkeeping around its engine: :class:`EngineCore`.

The same object runs in both places an engine replica can live: on a thread of the API
server's process (``AsyncEngine(..., engine_mode="thread")``, and every ``engine_factory`` fake)
and in its own engine-core process (:mod:`rlserve.engine.core.core_proc`, the default for servers).
Its driver calls it from one thread only, between steps; it needs no locking.

What it adds to the engine:

* per-request stamping: every output carries the weight version of its last token
  (``weight_version``), every version seen while it ran (``weight_versions``), its
  ``arrival_time`` and ``first_token_time`` (``time.monotonic()`` seconds: the clock is
  system-wide on Linux, so the two processes agree);
* outputs only for streamed requests and finished ones (a non-streamed request costs one
  output, at its end);
* final "abort" outputs for aborted requests, and ending every request when a step fails;
* the replica's weight version, its keep-pause ``frozen`` flag, its quarantine and its stats
  snapshot;
* the tokens behind ``vllm:generation_tokens_total`` / ``vllm:prompt_tokens_total`` (vLLM counts them
  per engine step, generation tokens as they are sampled, a request's prompt once with its first token:
  never again after a preemption's recompute). Delta mode: the API process counts the tokens of the
  deltas (:mod:`rlserve.engine.front.output_processor`), so every request with new tokens gets a delta
  at least every :data:`PROGRESS_EVERY_S` seconds (and at a keep-pause's freeze, :meth:`EngineCore.progress`),
  not only at its end. On a thread: :meth:`EngineCore.take_token_counts` after each step.

Outputs come in one of two forms. Cumulative (the default, on a thread): the engine's
``RequestOutput`` s, text included. Deltas (``deltas=True``, in the engine-core process): the
engine does not detokenize; each step yields a
:class:`~rlserve.engine.core_protocol.RequestDelta` per request that advanced and is streamed
or has stop strings, and per request that finished -- only the tokens sampled since its
previous delta -- and the API process turns them into ``RequestOutput`` s
(:mod:`rlserve.engine.front.output_processor`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import time
from typing import Any

from rlserve.engine import core_protocol
from rlserve.engine.routed_experts import npy_bytes, routed_delta
from rlserve.errors import EngineDeadError, EngineStepError, RLServeError

logger = logging.getLogger(__name__)

STATS_EVERY_S = 0.2  # engine stats are snapshotted at most this often (seconds)
#: delta mode: a request that gets no delta per step (per_step_deltas) gets one at least this often
#: (seconds) while it advances, so its tokens show in the counters as they are made (a Prometheus
#: scrape comes every 5-60 s); each pass costs ~2-4 us of core CPU per such request (BENCHMARKS.md,
#: "Token counters per step")
PROGRESS_EVERY_S = 1.0


@dataclasses.dataclass(eq=False)
class _Tracked:
    """Core-side state of one request."""

    stream: bool
    arrival_time: float
    prompt: Any
    n: int
    prompt_len: int = 0  # prompt tokens (counted with the first token: take_token_counts)
    versions: list = dataclasses.field(default_factory=list)
    first_token_time: float | None = None
    last_output: Any = None
    # delta mode
    live: Any = None  # the engine's Request (its Sequences), kept after the engine drops it
    steps: bool = True  # a delta every step it advances (streamed, or stop strings to match)
    sent: list = dataclasses.field(default_factory=list)  # per sample: tokens already sent
    routed_sent: list = dataclasses.field(default_factory=list)  # per sample: next routed position to send
    done: list = dataclasses.field(default_factory=list)  # per sample: its finish was sent
    started: bool = False  # its RequestStart was sent


class _StreamingIds:
    """``rid in self``: the engine should build a per-step output for request ``rid`` -- a
    streamed request, or one this core does not know (its output is then dropped anyway)."""

    def __init__(self, requests: dict):
        self.requests = requests

    def __contains__(self, rid) -> bool:
        req = self.requests.get(rid)
        return req is None or req.stream


def resolve_target(target: str):
    """``"package.module:function"`` → the function (how utility calls name engine-side code)."""
    mod, _, name = target.partition(":")
    if not mod or not name:
        raise ValueError(f"engine call target must be 'module:function', got {target!r}")
    return getattr(importlib.import_module(mod), name)


class EngineCore:
    """Request bookkeeping of one engine replica.

    Args:
        engine: an :class:`~rlserve.engine.core.llm_engine.LLMEngine` (or, without ``deltas``, a test
            fake with ``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests``).
        index: the data-parallel replica index.
        weight_version: the version stamped on outputs until :attr:`weight_version` changes.
        deltas: yield :class:`~rlserve.engine.core_protocol.RequestDelta` s instead of
            ``RequestOutput`` s, and switch the engine's detokenization off (an LLMEngine with
            no request yet).
    """

    def __init__(self, engine, index: int = 0, weight_version: str = "0", deltas: bool = False):
        self.engine = engine
        self.index = index
        self.weight_version = str(weight_version)
        self.frozen = False  # keep-mode pause: the driver does not step
        # weights left unusable by a command (a weight update that failed after writing into
        # them): the driver does not step until the requests were ended (abort_all)
        self.quarantined: str | None = None
        self.requests: dict[str, _Tracked] = {}
        self._streaming = _StreamingIds(self.requests)
        self._filter = bool(getattr(engine, "supports_output_filter", False))
        self.stats: dict = {}
        self._stats_time = 0.0
        self._progress_time = 0.0  # delta mode: the last progress deltas (PROGRESS_EVERY_S)
        self._gen_seen = 0  # thread mode: the engine's generation_tokens at the last take_token_counts
        self._prompt_new = 0  # thread mode: prompt tokens of first tokens since then
        self.deltas = deltas
        if deltas:
            self._proto = core_protocol
            engine.detokenize = False

    # ---- requests ------------------------------------------------------------------
    def add(self, request_id: str, prompt, params, stream: bool = True, arrival_time: float | None = None) -> None:
        """Queue a request in the engine. Nothing is kept when it raises.

        Raises:
            what ``engine.add_request`` raises when it is one of rlserve's errors
            (InvalidRequestError for bad input); anything else (a bug met by this request only)
            as :class:`EngineStepError` naming the request and the original error (HTTP 500).
        """
        try:
            self.engine.add_request(request_id, prompt, params)
        except RLServeError:
            raise
        except Exception as e:  # noqa: BLE001 - this request fails alone; the replica keeps serving
            logger.exception("engine replica %d could not add request %s", self.index, request_id)
            raise EngineStepError(f"engine replica {self.index} could not add request {request_id}: "
                                  f"{type(e).__name__}: {e}") from e
        live = getattr(self.engine, "requests", {}).get(request_id)
        if stream and live is not None:
            for seq in live.seqs:  # the scheduler keeps prefill steps short while streams decode
                seq.streamed = True
        n = getattr(params, "n", 1) or 1
        prompt_len = len(live.prompt_token_ids) if live is not None else len(prompt) if isinstance(prompt, list) else 0
        req = _Tracked(stream, time.monotonic() if arrival_time is None else arrival_time, prompt, n, prompt_len)
        if self.deltas:
            req.live = self.engine.requests[request_id]
            req.steps = core_protocol.per_step_deltas(stream, params)
            req.sent, req.done = [0] * n, [False] * n
            req.routed_sent = [params.routed_experts_prompt_start] * n
        self.requests[request_id] = req

    @property
    def halted(self) -> bool:
        """The driver must not step (keep-paused or quarantined)."""
        return self.frozen or self.quarantined is not None

    def quarantine(self, reason: str) -> None:
        """Step nothing (``reason``: why the weights are unusable) until :meth:`lift_quarantine`
        (the front ends the requests in flight first, then lifts it)."""
        self.quarantined = reason
        logger.error("engine replica %d quarantined: %s", self.index, reason)

    def lift_quarantine(self) -> None:
        self.quarantined = None

    def busy(self) -> bool:
        """Whether the engine has unfinished requests."""
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> list:
        """One engine step. Returns the stamped cumulative outputs of streamed requests that
        advanced and of every request that finished (delta mode: their deltas, also for
        requests with stop strings). Raises what the engine raises (the driver then calls
        :meth:`fail_all`)."""
        if self.deltas:
            return self._step_deltas()
        if self._filter:
            outs = self.engine.step(outputs_for=self._streaming)
            advanced = self.engine.last_step_request_ids
        else:
            outs, advanced = self.engine.step(), None
        self._note_advanced(advanced)
        items = []
        for out in outs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue  # aborted meanwhile
            self._stamp(req, out)
            if out.finished:
                del self.requests[out.request_id]
                items.append(out)
            elif req.stream:
                req.last_output = out
                items.append(out)
        return items

    def _note_advanced(self, advanced) -> None:
        """First-token time and weight version of the requests that got tokens this step."""
        if advanced:
            version, now = self.weight_version, None
            for rid in advanced:
                req = self.requests.get(rid)
                if req is None:
                    continue
                if req.first_token_time is None:
                    req.first_token_time = now = now or time.monotonic()
                    if not self.deltas:
                        self._prompt_new += req.prompt_len
                if not req.versions or req.versions[-1] != version:
                    req.versions.append(version)

    # ---- delta mode --------------------------------------------------------------------
    def _step_deltas(self) -> list:
        outs = self.engine.step(outputs_for=())  # cumulative outputs for finished requests only
        self._note_advanced(getattr(self.engine, "last_step_request_ids", ()))
        finished = {o.request_id for o in outs if o.finished}
        now = time.monotonic()
        progress = now - self._progress_time >= PROGRESS_EVERY_S  # every request's new tokens
        if progress:
            self._progress_time = now
        items = []
        for rid, req in list(self.requests.items()):
            done = rid in finished
            if done or req.steps or progress:
                d = self._delta(rid, req, done)
                if done:
                    del self.requests[rid]
                if d is not None:
                    items.append(d)
        return items

    def _delta(self, rid: str, req: _Tracked, finished: bool):
        """``req``'s :class:`~rlserve.engine.core_protocol.RequestDelta` since its previous one
        (None: nothing new and not finished). ``finished``: its last; samples the engine left
        unfinished end with "abort"."""
        proto = self._proto
        samples = []
        for i, s in enumerate(req.live.seqs):
            k, toks, reason = req.sent[i], s.output_token_ids, s.finish_reason
            if finished and reason is None:
                reason = "abort"
            if len(toks) == k and (reason is None or req.done[i]):
                continue
            routed, req.routed_sent[i] = routed_delta(self.engine.routed_experts, s, req.routed_sent[i])
            samples.append(proto.SampleDelta(
                s.index, toks[k:], [] if s.sampled_logprobs is None else s.sampled_logprobs[k:], None if s.logprobs is None else s.logprobs[k:],
                reason, s.stop_reason, None if routed is None else npy_bytes(routed)))
            req.sent[i] = len(toks)
            req.done[i] = reason is not None
        if not samples and not finished:
            return None
        start = None
        if not req.started:
            live = req.live
            start = proto.RequestStart(live.prompt_token_ids, live.prompt_logprobs,
                                       live.extra.get("prompt_logprob_ranks"))
            req.started = True
        if not req.versions:
            req.versions.append(self.weight_version)
        return proto.RequestDelta(rid, samples, finished, list(req.versions), req.first_token_time, start,
                                  req.live.extra.get("scheduled_time"))

    def progress(self) -> list:
        """Delta mode: a delta for every request with tokens not sent yet (a keep-pause's freeze: the
        counters then hold every token made); ``[]`` on a thread."""
        if not self.deltas:
            return []
        self._progress_time = time.monotonic()
        deltas = (self._delta(rid, req, False) for rid, req in self.requests.items())
        return [d for d in deltas if d is not None]

    def take_token_counts(self) -> tuple[int, int]:
        """On a thread (cumulative mode): ``(generation tokens, prompt tokens)`` made since the last
        call: the engine's ``stats_counters["generation_tokens"]`` (every sampled token; none without
        it: a test fake), and the prompts of requests whose first token came since (once per request).
        Delta mode: ``(0, 0)`` (the API process counts the deltas' tokens)."""
        counters = getattr(self.engine, "stats_counters", None)
        total = counters.get("generation_tokens", 0) if counters is not None and not self.deltas else 0
        gen, prompt = total - self._gen_seen, self._prompt_new
        self._gen_seen, self._prompt_new = total, 0
        return gen, prompt

    def stop_samples(self, request_id: str, indices) -> list:
        """Delta mode: finish samples ``indices`` of a request (a stop string matched in the API
        process). Returns the request's final delta when that finished it, else ``[]``."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        self.engine.finish_sequences(request_id, indices)
        if not req.live.finished:
            return []
        del self.requests[request_id]
        return [self._delta(request_id, req, True)]

    def abort(self, request_ids) -> list:
        """Abort requests (unknown ids ignored). Returns their final outputs (unfinished samples
        have ``finish_reason == "abort"``)."""
        present = [r for r in request_ids if r in self.requests]
        if not present:
            return []
        try:
            outs = self.engine.abort_request(present) or []
        except Exception:  # noqa: BLE001
            logger.exception("abort_request failed on replica %d", self.index)
            outs = []
        by_id = {o.request_id: o for o in outs}
        items = []
        for rid in present:
            req = self.requests.pop(rid)
            if self.deltas:
                items.append(self._delta(rid, req, True))
                continue
            out = by_id.get(rid) or abort_output(rid, req.prompt, req.n, req.last_output)
            self._stamp(req, out, bump=False)
            out.finished = True
            items.append(out)
        return items

    def abort_all(self) -> list:
        """Abort every request; returns their final outputs."""
        return self.abort(list(self.requests))

    def fail_all(self, exc: BaseException, abort_in_engine: bool = True) -> tuple[list[str], BaseException]:
        """End every request after ``exc`` (a failed step, or the replica stopping). Returns
        the ids ended and the error they end with (:class:`EngineStepError` unless ``exc`` is
        an :class:`EngineDeadError`)."""
        ids = list(self.requests)
        self.requests.clear()
        if abort_in_engine:
            try:
                fn = getattr(self.engine, "abort_all", None)
                if callable(fn):
                    fn()
                elif ids:
                    self.engine.abort_request(ids)
            except Exception:  # noqa: BLE001
                logger.exception("aborting after a failure also failed on replica %d", self.index)
        if isinstance(exc, EngineDeadError):
            return ids, exc
        if ids:
            logger.error("engine replica %d step failed; failing %d request(s)", self.index, len(ids), exc_info=exc)
        return ids, EngineStepError(f"engine replica {self.index} failed while generating: {type(exc).__name__}: {exc}")

    def _stamp(self, req: _Tracked, out, bump: bool = True) -> None:
        if req.first_token_time is None and any(c.token_ids for c in out.outputs):
            req.first_token_time = time.monotonic()
            self._prompt_new += req.prompt_len
        version = self.weight_version
        if (bump and (not req.versions or req.versions[-1] != version)) or not req.versions:
            req.versions.append(version)
        out.weight_version = req.versions[-1]
        out.weight_versions = list(req.versions)
        out.arrival_time = req.arrival_time
        out.first_token_time = req.first_token_time

    # ---- other engine access ---------------------------------------------------------
    def call(self, target: str, *args):
        """Run ``target(self, *args)`` (``"module:function"``, see :func:`resolve_target`)."""
        return resolve_target(target)(self, *args)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def snapshot_stats(self, force: bool = False) -> bool:
        """Refresh :attr:`stats` from ``engine.stats`` at most every ``STATS_EVERY_S`` seconds
        (``force``: now). Returns whether it was refreshed."""
        now = time.monotonic()
        if not force and now - self._stats_time < STATS_EVERY_S:
            return False
        self._stats_time = now
        try:
            self.stats = {k: v for k, v in dict(self.engine.stats).items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
        except Exception:  # noqa: BLE001 - stats are best effort
            logger.debug("stats snapshot failed", exc_info=True)
            return False
        return True

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("engine replica %d shutdown failed", self.index)


def abort_output(request_id: str, prompt, n: int, last=None):
    """Final "abort" output of a request: its last output with unfinished samples marked
    "abort", or (none yet) ``n`` empty samples."""
    from rlserve.engine.outputs import CompletionOutput, RequestOutput

    if last is not None:
        out = copy.copy(last)
        outs = []
        for c in last.outputs:
            c2 = copy.copy(c)
            if c2.finish_reason is None:
                c2.finish_reason = "abort"
            outs.append(c2)
        out.outputs = outs
        out.finished = True
        return out
    return RequestOutput(
        request_id=request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(prompt) if isinstance(prompt, (list, tuple)) else [],
        prompt_logprobs=None,
        outputs=[CompletionOutput(index=i, finish_reason="abort") for i in range(n)],
        finished=True,
    )
