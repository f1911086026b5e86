"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlserve.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, step: int) -> int:
    """Deterministic 63-bit seed for the draw at output index ``step`` of a seeded request
    (the ``seed`` field): the key of that row's draw in both samplers, the general one's
    ``torch.Generator`` and the one-pass sampler's Philox noise.

    SplitMix64 finaliser (Steele et al. 2014) over a combination of ``seed`` and ``step``;
    any Python int seed (negative too) is accepted.
    """
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema, serialised as a string (the output is a JSON value it accepts).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose root rule the output matches.
        json_object: any JSON object.
        reasoning_end_ids: token ids that end the model's reasoning: while any of these or of
            ``reasoning_implicit_end_ids`` is set, the constraint waits (unconstrained tokens)
            until one of them is generated; after one of these it starts with the next token
            (vLLM's ``--reasoning-parser`` gate: ``</think>``). Empty: from the first token.
        reasoning_implicit_end_ids: ids that end the reasoning and are the constraint's first
            token (Qwen3's ``<tool_call>``, vLLM's implicit end).

    Enforced by :mod:`rlserve.engine.core.structured` as a mask on the logits; the output ends
    (finish reason ``stop``) with the EOS token once the constraint is complete.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning_end_ids: tuple[int, ...] = ()
    reasoning_implicit_end_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        for k in ("reasoning_end_ids", "reasoning_implicit_end_ids"):
            object.__setattr__(self, k, tuple(int(t) for t in getattr(self, k) or ()))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) if given else "none"))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


#: OpenAI's range of a ``logit_bias`` value; vLLM clips to it (``SamplingParams.from_optional``)
LOGIT_BIAS_MAX = 100.0


def clip_logit_bias(bias) -> dict[int, float]:
    """``logit_bias`` as ``{int token id: float bias}``: keys may be ints or strings of ints
    (JSON's), values numbers, clipped to [-100, 100] (vLLM's rule).

    Raises:
        InvalidRequestError: not a dict, a key that is not an integer >= 0 (or its string),
            a value that is not a finite number.
    """
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be an object {{token id: bias}}, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            t = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
        except ValueError:
            t = k
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidRequestError(f"logit_bias values must be finite numbers, got {v!r} for token {t}")
        out[t] = min(LOGIT_BIAS_MAX, max(-LOGIT_BIAS_MAX, float(v)))
    return out


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Attributes:
        n: completions per prompt (>= 1).
        temperature: 0 means greedy; must be >= 0.
        top_p: nucleus probability mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables; below -1 is refused (as vLLM).
        min_p: drop tokens whose probability is below ``min_p`` x the top probability; [0, 1].
        repetition_penalty: > 0; 1 disables (CTRL paper's rule: divide positive logits,
            multiply negative ones, for tokens seen in prompt or output).
        presence_penalty / frequency_penalty: in [-2, 2], OpenAI's definitions, applied over
            output tokens only.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        max_tokens: new tokens at most (>= 1); None means up to ``max_model_len``.
        min_tokens: EOS and stop tokens are suppressed until this many were generated.
        stop: stop strings (not included in the text unless ``include_stop_str_in_output``).
        stop_token_ids: extra token ids that end the completion (included in token ids).
        ignore_eos: keep going past EOS.
        logprobs: number of top alternatives to return per sampled token (0 = only the
            sampled token's logprob); None disables.
        prompt_logprobs: same, for prompt tokens.
        skip_special_tokens: drop special tokens from the text.
        include_stop_str_in_output: keep the matched stop string in the text.
        structured_outputs: constrain the output to a regex / JSON schema / choice / grammar
            (:class:`StructuredOutputsParams`); None: unconstrained.
        lora_int_id: the LoRA adapter the request runs under (:mod:`rlserve.lora`): the id the
            server gave it at ``/v1/load_lora_adapter``, set from the request's ``model`` name; 0
            (default): the base model. Ids are never reused, so a reloaded adapter has another.
        stream_interval: new tokens per streamed output at least (vLLM's field, >= 1): raises
            the server's ``--stream-interval`` for this request (a smaller value counts as the
            server's); the first and the last output go out at once. None: the server's.
            Read by the async front (:func:`rlserve.engine.front.front_request.put`), not the engine.
        routed_experts_prompt_start: with routed-experts replay on, leave out the routing of the
            first this many prompt tokens (vLLM's field: a multi-turn caller that has them from
            an earlier turn); in ``[0, prompt length]``, checked by the engine.
        logit_bias: OpenAI's ``logit_bias``: ``{token id: bias}`` added to that token's logit
            before sampling (after the structured-output mask, with ``min_tokens``, before the
            penalties: vLLM's ``LogitBiasLogitsProcessor``); each bias clipped to [-100, 100]
            as vLLM's ``SamplingParams.from_optional`` does; ids checked against the vocabulary
            by the engine. Raw logprobs do not see it (vLLM's rule); processed ones do.
        allowed_token_ids: vLLM's: only these token ids may be drawn (every other logit is
            ``-inf`` before the bias and penalties, as vLLM's ``allowed_token_ids_mask``); a
            non-empty list, ids checked against the vocabulary by the engine; None: any.
        bad_words_token_ids: vLLM's ``bad_words`` as token-id sequences (the API tokenizes the
            words: :func:`rlserve.server.request_fields.bad_words_token_ids`): at each step, a
            sequence's last id is banned (``-inf``) when the output so far ends with the rest of
            it (after ``allowed_token_ids``, before the bias and penalties: vLLM's
            ``apply_bad_words``). Ids outside the vocabulary are never drawn anyway.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    stream_interval: int | None = None
    lora_int_id: int = 0
    routed_experts_prompt_start: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = clip_logit_bias(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:  # -1 = 0 = off, as in vLLM; below -1 refused
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Check every field's range (``logit_bias`` is checked and clipped when set:
        :func:`clip_logit_bias`).

        Raises:
            InvalidRequestError: naming the field and the allowed range.
        """

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be >= 1, got {self.n}")
        # NaN passes every comparison and JSON bodies may carry NaN / Infinity (Python's json
        # reads them): non-finite values are refused here, not left to sample garbage.
        if self.temperature is None or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:  # vLLM 0.32's message
            bad(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.stream_interval is not None and (not isinstance(self.stream_interval, int) or self.stream_interval < 1):
            bad(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not isinstance(self.routed_experts_prompt_start, int) or self.routed_experts_prompt_start < 0:
            bad(f"routed_experts_prompt_start must be an integer >= 0, got {self.routed_experts_prompt_start!r}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be >= 0, got {self.logprobs}")
        if self.bad_words_token_ids is not None and not all(
                isinstance(w, list) and w and all(isinstance(t, int) and t >= 0 for t in w)
                for w in self.bad_words_token_ids):
            bad("bad_words_token_ids must be lists of token ids (integers >= 0), none empty")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop strings must be non-empty strings")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 0:
            bad(f"lora_int_id must be an integer >= 0, got {self.lora_int_id!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            bad(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got {self.allowed_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
