"""Admission of requests into an :class:`~rlserve.engine.core.llm_engine.LLMEngine`: checking a
request against the engine (prompt, context length, vocabulary, logprobs, adapter), building its
samples (per-sample seeds, detokenizers) and queueing them, with a ``structured_outputs``
constraint that compiles slowly finishing its compile beside the steps (:meth:`admit_compiled`).

:class:`RequestAdmission` is a base class of ``LLMEngine``; it uses the engine's ``config``,
``tokenizer``, ``has_tokenizer``, ``vocab_size``, ``max_model_len``, ``eos_token_ids``, ``detokenize``, ``requests``,
``scheduler``, ``sleep_mode``, ``stats_counters``, ``_grammars``, ``_grammar_compiler``,
``_overlap`` and :meth:`abort_request`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging

from rlserve.engine.core.sequence import Request, Sequence
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.sampling_params import SamplingParams
from rlserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

#: arrival order of requests (the scheduler's FCFS key; offline request ids)
_arrival = itertools.count()
# add_request waits this long (seconds) for a constraint's compile, so a cached or quick one,
# and a bad one's InvalidRequestError, come back at once; a longer compile goes on beside the
# steps (issue 33: 100,000 choices compiled inside add_request stopped every request ~45 s)
INLINE_COMPILE_S = 0.05


class _NullDetokenizer:
    """Stands in for the detokenizer (:func:`~rlserve.engine.fast_detokenizer.new_detokenizer`) when there is no tokenizer."""

    output_text = visible_text = ""

    def add_tokens(self, token_ids):
        return None

    def finish(self):
        return None

    def take_delta(self) -> str:
        return ""


def _sub_seed(seed: int | None, index: int) -> int | None:
    """Seed of sample ``index`` of a request: sample 0 keeps the request's seed."""
    if seed is None or index == 0:
        return seed
    return (seed * 1_000_003 + index) & 0x7FFF_FFFF_FFFF_FFFF


class RequestAdmission:
    """``add_request`` and what it needs (see the module docstring)."""

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not self.has_tokenizer:
                raise InvalidRequestError("this engine has no tokenizer (skip_tokenizer_init): pass token ids")
            if prompt == "":
                raise InvalidRequestError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            return prompt, ids
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of integer token ids")
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request.

        Args:
            request_id: unique id (str).
            prompt: text or token ids.
            params: sampling parameters (default ``SamplingParams()``).

        Raises:
            InvalidRequestError: empty prompt, token id outside the vocabulary (prompt or
                ``logit_bias``, ``allowed_token_ids``), a prompt of ``max_model_len`` tokens or more,
                bad sampling parameters, duplicate id. (``max_tokens`` beyond the room the prompt leaves
                is clamped to it, as vLLM does.)
            ModelSleepingError: the engine is asleep (sleep mode).
        """
        if self.sleep_mode is not None:
            self.sleep_mode.check_generate()
        params = params or SamplingParams()
        params.validate()
        if getattr(params, "lora_int_id", 0):  # (LoRA's code: imported at the model's build with --enable-lora)
            from rlserve.lora.engine_ops import check_request_adapter

            check_request_adapter(self, params)
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's maximum context length is {self.max_model_len} "
                "tokens and at least one must be left for the output"
            )
        if params.routed_experts_prompt_start > len(ids):
            raise InvalidRequestError(f"routed_experts_prompt_start must be between 0 and the prompt length "
                                      f"{len(ids)}, got {params.routed_experts_prompt_start}")
        if params.max_tokens is None or len(ids) + params.max_tokens > self.max_model_len:
            # an upper bound, clamped to the room the prompt leaves (vLLM: the scheduler ends a sequence at
            # max_model_len with finish_reason "length"; its server clamps max_tokens the same way)
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in (getattr(params, name) or ()) if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name}: token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        for k in (params.logprobs, params.prompt_logprobs):
            if k is not None and 0 <= self.config.max_logprobs < k:  # max_logprobs -1: no limit
                raise InvalidRequestError(f"logprobs may be at most {self.config.max_logprobs}, got {k}")
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
        pending = None
        if params.structured_outputs is not None:
            pending = self.grammar_compiler().compile_async(params.structured_outputs)
            try:  # a cached or quick compile, and a bad constraint's error, as before
                compiled = pending.result(timeout=INLINE_COMPILE_S)
                pending = None
            except concurrent.futures.TimeoutError:  # the rest compiles beside the steps
                compiled = None
        seqs = []
        for i in range(params.n):
            p = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=_sub_seed(params.seed, i))
            seq = Sequence(request_id, i, ids, p, self.config.block_size)
            if params.structured_outputs is not None and pending is None:
                seq.grammar = self.grammar_compiler().new_state(params.structured_outputs, compiled)
            if not self.detokenize or not self.has_tokenizer:  # (detokenize first: no wait for a deferred load)
                seq.detokenizer = _NullDetokenizer()
                if not self.detokenize and params.logprobs is not None:
                    seq.sampled_logprobs = []
            else:
                from rlserve.engine.fast_detokenizer import new_detokenizer  # (not in the engine-core process)

                seq.detokenizer = new_detokenizer(self.tokenizer, ids, params)
            seqs.append(seq)
        req = Request(request_id, text, ids, params, seqs, next(_arrival))
        self.requests[request_id] = req
        if pending is not None:
            self._grammars.add(request_id, pending)
        else:
            for s in seqs:
                self.scheduler.add(s)
        self.stats_counters["prompt_tokens"] += len(ids)

    def admit_compiled(self) -> list[RequestOutput]:
        """Queue the sequences of requests whose constraint finished compiling (the step calls
        this first). When the engine has nothing else to run it waits up to 10 ms for a compile
        (the driver does not spin). Returns the final "abort" outputs of requests whose
        constraint failed to compile (the API process compiles it first, so only an offline
        caller's slow, bad constraint gets here)."""
        idle = not self.scheduler.has_unfinished() and not (self._overlap is not None and self._overlap.pending)
        outs = []
        for rid, future in self._grammars.ready(wait_s=0.01 if idle else 0.0):
            req = self.requests.get(rid)
            if req is None:
                continue
            try:
                compiled = future.result()
            except Exception as e:  # noqa: BLE001 - this request ends alone
                logger.error("request %s: its structured_outputs constraint did not compile (%s: %s); aborted",
                             rid, type(e).__name__, e)
                outs += self.abort_request(rid)
                continue
            for s in req.seqs:
                if not s.is_finished:
                    s.grammar = self.grammar_compiler().new_state(req.params.structured_outputs, compiled)
                    self.scheduler.add(s)
        return outs

    def grammar_compiler(self):
        """The structured-output compiler of this engine's tokenizer (built on first use).

        Raises:
            InvalidRequestError: no tokenizer (skip_tokenizer_init), or xgrammar missing.
        """
        if self._grammar_compiler is None:
            if not self.has_tokenizer:
                raise InvalidRequestError("structured outputs need a tokenizer (the engine runs with "
                                          "skip_tokenizer_init)")
            from rlserve.engine.core.structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler
