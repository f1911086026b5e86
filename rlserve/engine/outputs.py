"""What the engine returns per request (vLLM's shapes: ``RequestOutput`` holding one
``CompletionOutput`` per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: detokenized output (stop string removed unless asked to keep it).
        token_ids: generated token ids (an EOS or stop token id that ended it is included).
        cumulative_logprob: sum of the sampled tokens' logprobs (in the server's
            ``logprobs_mode``; default the raw model distribution, nats); None unless
            ``SamplingParams.logprobs`` was set (vLLM's rule: the sampler scores only the rows
            that asked, :mod:`rlserve.engine.core.lean_sampling`).
        logprobs: per generated token, ``{token_id: logprob}`` holding the sampled token and
            the top-``k`` alternatives; None unless ``SamplingParams.logprobs`` was set.
        routed_experts: with routed-experts replay on, on the final output: numpy
            ``[num_tokens - 1 - routed_experts_prompt_start, num_hidden_layers, top_k]`` uint8 /
            uint16 expert ids (vLLM's field; :mod:`rlserve.engine.routed_experts`); else None.
        finish_reason: "stop", "length", "abort" or None while running.
        stop_reason: the stop string or stop token id that matched, else None.
        version_marks: ``((index of the first token, weight version), ...)``: where in ``token_ids`` each weight
            version that produced them starts, in order (a stream labels a chunk whose tokens span several;
            ``rlserve/server/openai_stream.py``). Exact where the engine core sent a delta per step (streamed
            requests, process mode: :mod:`rlserve.engine.front.output_processor`); None while one version produced
            them all (its ``RequestOutput.weight_version``), and where not tracked. A tuple: a sample's outputs share
            it (the processor replaces it when a version is added, never changes it).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = 0.0
    logprobs: list[dict[int, float]] | None = None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    version_marks: tuple[tuple[int, str], ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """State of one request after an engine step (cumulative, not a delta).

    Attributes:
        request_id: the caller's id.
        prompt: the prompt text (None when given as token ids).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: vLLM format (first entry None, then ``{token_id: logprob}``) when asked.
        prompt_logprob_ranks: with ``prompt_logprobs``: per prompt token its 1-based rank among
            all tokens at its position (first entry None); the top-k entries rank ``1..k``.
        outputs: one ``CompletionOutput`` per sample.
        finished: all samples are finished.
        weight_version: weight version that produced the last token (set by the async front).
        weight_versions: every weight version seen while the request ran, in order.
        arrival_time: when the request arrived (``time.monotonic()`` seconds; set by the async front).
        first_token_time: when its first token was sampled (same clock), None before.
        scheduled_time: when the engine first scheduled it (its first prefill step; same clock),
            None before (vLLM's ``scheduled_ts``: queue time = scheduled - arrival).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    weight_version: str | None = None
    weight_versions: list[str] = field(default_factory=list)
    prompt_logprob_ranks: list[int | None] | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None
