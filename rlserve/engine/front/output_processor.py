"""API-process side of the engine-core boundary: token deltas in, vLLM's ``RequestOutput`` s out.

An engine-core process (:mod:`rlserve.engine.core.core_proc`) sends token ids only
(:class:`~rlserve.engine.core_protocol.RequestDelta`: per step, the tokens each request gained).
:class:`OutputProcessor` keeps each request's tokens, logprobs and a detokenizer
(:func:`~rlserve.engine.fast_detokenizer.new_detokenizer`) per sample here, off the engine's
critical path (vLLM's ``OutputProcessor`` does the same in its front-end process), and builds
the cumulative outputs the async front delivers.

Same results as the engine's own detokenizer (``LLMEngine.detokenize``, the offline and thread
paths), rule for rule:

* a token that ended its sample as a stop token or EOS (``finish_reason == "stop"`` from the
  engine) becomes text only with ``include_stop_str_in_output``, and a stop string found in
  it then does not replace the engine's reason;
* a stop string completed by any other token (also the one that reached ``max_tokens``)
  finishes the sample here: ``finish_reason "stop"``, ``stop_reason`` the string, tokens and
  logprobs cut after the token that completed it; the core is asked to stop the sample
  (:class:`~rlserve.engine.core_protocol.StopSamples`) and whatever it sampled past that
  point is dropped;
* ``cumulative_logprob`` is the sum of the kept tokens' logprobs, added in the engine's order
  (the same float the engine computes), and None when the request did not ask for logprobs
  (vLLM's rule; the core then sends no logprobs);
* a sample that ends for any other reason flushes its detokenizer (``finish()``; a stop
  string completed by the flush cuts the text only, as in the engine).

Each sample also keeps where each weight version's tokens start (``CompletionOutput.version_marks``): a delta's
tokens are one step's, produced by its ``weight_versions[-1]`` -- for a request that gets a delta every step
(:func:`~rlserve.engine.core_protocol.per_step_deltas`); the others' deltas come every
``engine_core.PROGRESS_EVERY_S`` seconds (several steps' tokens), so they keep only their first mark (None).
The marks are a tuple, replaced (not changed) when a version is added (once per weight update a sample sees):
every output carries the sample's tuple itself, no copy, and a reader's tuple never changes under it.

The tokens behind ``vllm:generation_tokens_total`` / ``vllm:prompt_tokens_total`` are counted here, as
vLLM's ``OutputProcessor`` counts them (``IterationStats``): every kept token of a delta (not those a
stop string cut), and a request's prompt once, with its first kept token; :meth:`OutputProcessor.process` hands
them to ``count_tokens`` (the replica's: the metrics) before it returns the outputs, so a finished request's
tokens are counted before anyone sees its last output.

A streamed request's unfinished outputs carry read-only views of its samples' token and logprob
lists (:class:`~rlserve.engine.prefix_view.PrefixView`: O(1) per output, issue 37), which is why
those lists only ever grow by appends here (a stop string cuts what is added, never what is there);
its finished output carries lists.

Errors are per request: one whose outputs cannot be processed (a tokenizer that raises on its
tokens) ends alone with :class:`~rlserve.errors.EngineStepError` and is aborted in the
core; the others go on.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from rlserve.engine.core_protocol import per_step_deltas
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.prefix_view import PrefixView
from rlserve.engine.routed_experts import RoutedChunks
from rlserve.errors import EngineStepError

logger = logging.getLogger(__name__)


def _view(items: list) -> PrefixView:
    return PrefixView(items, len(items))


class _NoText:
    """The detokenizer of a sample when there is no tokenizer (``skip_tokenizer_init``)."""

    visible_text = ""

    def add_tokens(self, token_ids):
        return None

    def finish(self):
        return None


class _Sample:
    __slots__ = ("detok", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason", "routed",
                 "marks", "mark_version")

    def __init__(self, detok, want_logprobs: bool):
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if want_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if want_logprobs else None  # vLLM's rule
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.routed = RoutedChunks()  # routed-experts replay: rows as the core sends them
        self.marks: tuple[tuple[int, str], ...] = ()  # (first token index, weight version): version_marks
        self.mark_version: str | None = None  # the last mark's version


class _State:
    __slots__ = ("prompt", "prompt_token_ids", "prompt_logprobs", "prompt_logprob_ranks", "samples", "stream",
                 "arrival_time", "include_stop", "routed_start", "per_step", "counted")

    def __init__(self, req, start, tokenizer):
        from rlserve.engine.fast_detokenizer import new_detokenizer

        params = req.params
        self.prompt = req.prompt if isinstance(req.prompt, str) else None
        self.prompt_token_ids = list(start.prompt_token_ids)
        self.prompt_logprobs = start.prompt_logprobs
        self.prompt_logprob_ranks = start.prompt_logprob_ranks
        self.stream = req.stream
        self.arrival_time = req.arrival_time
        self.include_stop = bool(params.include_stop_str_in_output)
        self.routed_start = int(getattr(params, "routed_experts_prompt_start", 0) or 0)
        self.per_step = per_step_deltas(req.stream, params)  # a delta every step: exact version marks
        self.counted = False  # its prompt tokens were counted (with its first kept token)
        n = getattr(params, "n", 1) or 1
        want_lps = params.logprobs is not None
        self.samples = [
            _Sample(_NoText() if tokenizer is None
                    else new_detokenizer(tokenizer, self.prompt_token_ids, params), want_lps)
            for _ in range(n)]


class OutputProcessor:
    """Turns one engine replica's deltas into cumulative ``RequestOutput`` s (see the module
    docstring). Used by one thread (the replica's output reader).

    Args:
        tokenizer: the Hugging Face tokenizer the engine uses (None: no text).
        count_tokens: ``(generation tokens, prompt tokens) -> None``, called by each :meth:`process` that
            counted some (:meth:`~rlserve.engine.front.replica.Replica.count_tokens`); None: kept for
            :meth:`take_counts`.
    """

    def __init__(self, tokenizer, count_tokens=None):
        self.tokenizer = tokenizer
        self.count_tokens = count_tokens
        self._states: dict[str, _State] = {}
        self._gen = 0  # generation tokens kept since the last take_counts
        self._prompt = 0  # prompt tokens of requests whose first token was kept since then

    def take_counts(self) -> tuple[int, int]:
        """``(generation tokens, prompt tokens)`` counted since the last call (see the module docstring)."""
        counts = self._gen, self._prompt
        self._gen = self._prompt = 0
        return counts

    def __len__(self) -> int:
        return len(self._states)

    def drop(self, request_id: str) -> None:
        """Forget a request (it ended with an error routed elsewhere)."""
        self._states.pop(request_id, None)

    def clear(self) -> None:
        self._states.clear()

    def process(self, deltas, reqs: Mapping[str, Any]):
        """Apply deltas: one message's, or several messages' in the core's order (a request
        may then have one delta per step; it still gets one output, built once after its last
        delta: what a consumer that fell behind needs, at a fraction of the work).

        Args:
            deltas: :class:`~rlserve.engine.core_protocol.RequestDelta` s, in the core's order.
            reqs: request id -> the front's request (``prompt``, ``params``, ``stream``,
                ``arrival_time``); deltas of requests not there are dropped (ended already).

        Returns:
            ``(outputs, errors, stops, aborts)``: the outputs to deliver (streamed requests
            that advanced, and every request that finished: ``finished`` is its last),
            ``(request_id, exception)`` for requests that failed here, ``(request_id,
            indices)`` of samples the core must stop, and request ids the core must abort
            (finished here before there, or failed here).
        """
        errors, stops, aborts = [], [], []
        ready: dict[str, tuple] = {}  # request id -> (state, its last delta, finished): outputs to build
        ended: set[str] = set()  # finished or failed in this call: later deltas of theirs are dropped
        for d in deltas:
            rid = d.request_id
            req = reqs.get(rid)
            if req is None or rid in ended:
                self._states.pop(rid, None)
                continue
            try:
                st, finished, stopped = self._apply(rid, req, d)
            except Exception as e:  # noqa: BLE001 - this request only
                logger.exception("processing the outputs of request %s failed", rid)
                self._states.pop(rid, None)
                ready.pop(rid, None)
                ended.add(rid)
                errors.append((rid, EngineStepError(
                    f"processing the outputs of request {rid} failed: {type(e).__name__}: {e}")))
                if not d.finished:
                    aborts.append(rid)
                continue
            if not (st.stream or finished):
                continue
            ready[rid] = (st, d, finished)
            if finished:
                self._states.pop(rid, None)
                ended.add(rid)
                if not d.finished:
                    aborts.append(rid)  # done here (stop strings) before the core knew
            elif stopped:
                stops.append((rid, stopped))
        outputs = [self._output(rid, st, d, finished) for rid, (st, d, finished) in ready.items()]
        if self.count_tokens is not None and (self._gen or self._prompt):
            self.count_tokens(*self.take_counts())
        return outputs, errors, stops, aborts

    def _apply(self, rid: str, req, d):
        """Add one delta to its request's state. Returns ``(state, finished, indices of
        samples a stop string finished here)``."""
        st = self._states.get(rid)
        if st is None:
            if d.start is None:
                raise RuntimeError("the engine sent no start for this request")
            st = self._states[rid] = _State(req, d.start, self.tokenizer)
        stopped = []
        version = d.weight_versions[-1] if d.weight_versions else None  # (the step's: its newest tokens')
        for sd in d.samples:
            s = st.samples[sd.index]
            if sd.routed_experts is not None:
                s.routed.add(sd.routed_experts)
            if s.finish_reason is not None:
                continue  # stopped here already: tokens the core sampled past it are dropped
            if s.mark_version != version and sd.token_ids and (st.per_step or not s.marks):
                s.marks += ((len(s.token_ids), version),)  # a new tuple: outputs hold the old one
                s.mark_version = version
            if self._extend(st, s, sd):
                stopped.append(sd.index)
        if d.finished:
            for s in st.samples:
                if s.finish_reason is None:  # the core ended the request without a reason for it
                    s.finish_reason = "abort"
                    s.detok.finish()
        return st, all(s.finish_reason is not None for s in st.samples), stopped

    def _extend(self, st: _State, s: _Sample, sd) -> bool:
        """Add one sample's new tokens, all of them in one detokenizer call (its ``token_index``
        says where a stop string completed: the tokens, logprobs and ``cumulative_logprob`` end
        there). Returns True when a stop string finished it here."""
        toks, lps, top = sd.token_ids, sd.sampled_logprobs, sd.logprobs
        engine_stop = sd.finish_reason == "stop" and len(toks) > 0
        # a terminating EOS / stop token is text only when asked for (vLLM's rule), and a stop
        # string it completes does not replace the engine's reason
        text_toks = toks[:-1] if engine_stop else toks
        match = s.detok.add_tokens(text_toks) if text_toks else None
        keep = len(toks) if match is None else match.token_index + 1
        s.token_ids += toks[:keep]
        if keep:
            self._gen += keep
            if not st.counted:
                st.counted = True
                self._prompt += len(st.prompt_token_ids)
        cum = s.cumulative_logprob
        if cum is not None:  # (None: the request did not ask for logprobs)
            for lp in lps[:keep]:  # one at a time, in the engine's order: the engine's float
                cum += lp
            s.cumulative_logprob = cum
        if s.logprobs is not None and top is not None:
            s.logprobs += top[:keep]
        if match is not None:
            s.finish_reason, s.stop_reason = "stop", match.stop_str
            s.detok.finish()
            return True
        if engine_stop and st.include_stop:
            s.detok.add_tokens(toks[-1:])
        if sd.finish_reason is not None:
            s.finish_reason, s.stop_reason = sd.finish_reason, sd.stop_reason
            s.detok.finish()
        return False

    @staticmethod
    def _output(rid: str, st: _State, d, finished: bool) -> RequestOutput:
        """The request's cumulative output. Positional arguments, in the dataclasses' field order
        (``rlserve/engine/outputs.py``): 2.7 against 6.5 us with keywords for one sample (2-core
        Xeon, loaded), once per streamed request and step (issue 37). An unfinished output's
        ``token_ids`` / ``logprobs`` are :class:`~rlserve.engine.prefix_view.PrefixView` s of the
        sample's lists (O(1), not O(output length): they only grow by appends, :meth:`_extend`);
        the finished output's are lists."""
        versions = list(d.weight_versions)
        seq = list if finished else _view  # (an unfinished output: O(1) views of lists that only grow)
        outs = [CompletionOutput(i, s.detok.visible_text, seq(s.token_ids), s.cumulative_logprob,
                                 None if s.logprobs is None else seq(s.logprobs),
                                 None if s.finish_reason is None else s.routed.result(
                                     len(st.prompt_token_ids) - st.routed_start + len(s.token_ids) - 1),
                                 s.finish_reason, s.stop_reason,
                                 s.marks if len(s.marks) > 1 else None)  # (a tuple: shared, not copied)
                for i, s in enumerate(st.samples)]
        # request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, weight_version,
        # weight_versions, prompt_logprob_ranks, arrival_time, first_token_time, scheduled_time
        return RequestOutput(rid, st.prompt, st.prompt_token_ids, st.prompt_logprobs, outs, finished,
                             versions[-1] if versions else None, versions, st.prompt_logprob_ranks,
                             st.arrival_time, d.first_token_time, d.scheduled_time)
