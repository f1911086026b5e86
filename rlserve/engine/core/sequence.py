"""Request and sequence state inside the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from rlserve.engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample being generated: its tokens, KV blocks and sampling state.

    Attributes:
        seq_id: engine-unique integer id.
        request_id / index: the owning request and this sample's index in it.
        prompt_token_ids / output_token_ids: token ids.
        block_table: KV-cache block ids holding this sequence's tokens in order.
        num_cached_tokens: prompt tokens whose KV came from the prefix cache at the last
            (re)allocation; prefill computes only the rest.
        num_computed_tokens: tokens whose KV is in the cache (0 after preemption).
        streamed: its request streams (set by the engine core): the scheduler bounds prefill
            steps while streamed sequences decode (``Scheduler.prefill_budget``).
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self._num_prompt = len(self.prompt_token_ids)  # the prompt never changes
        self.output_token_ids: list[int] = []
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.streamed = False
        self.cache_epoch = -1  # BlockManager.epoch at the last allocation
        # None unless the request asked for logprobs (vLLM's rule: the sampler scores only the
        # rows that asked, rlserve.engine.core.lean_sampling)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # per output token its logprob (the terms of cumulative_logprob), kept only where the
        # engine does not detokenize (LLMEngine.detokenize False: the API process sums them) and
        # the request asked for logprobs
        self.sampled_logprobs: list[float] | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.detokenizer = None  # set by the engine
        self.grammar = None  # structured-output state (rlserve.engine.core.structured.GrammarState), set by the engine
        self.num_preemptions = 0
        # routed-experts replay: [tokens, layers, top_k] ids, read when the sequence finished
        # (rlserve.engine.routed_experts); None otherwise
        self.routed_experts = None

    def __len__(self) -> int:
        return self._num_prompt + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_blocks_needed(self) -> int:
        """Blocks needed to hold all current tokens."""
        return (len(self) + self.block_size - 1) // self.block_size

    def block_tokens(self, i: int) -> list[int]:
        """Token ids stored in the ``i``-th block of this sequence: slices of the prompt and the
        output, O(block_size) (``all_token_ids`` copies the whole sequence: registering a 3,891-token
        prompt's blocks chunk by chunk, one call per block, cost ~10 ms of CPU, session 17)."""
        a, b, p = i * self.block_size, (i + 1) * self.block_size, self._num_prompt
        if b <= p:
            return self.prompt_token_ids[a:b]
        if a >= p:
            return self.output_token_ids[a - p : b - p]
        return self.prompt_token_ids[a:] + self.output_token_ids[: b - p]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass
class Request:
    """A user request: a prompt and ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_order: int
    prompt_logprobs: list | None = None
    prompt_logprobs_done: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True
