"""Continuous batching: which sequences run in the next forward step.

Policy: a step is either a *prefill* step (waiting sequences, FIFO, as many as fit in
``max_num_seqs``, ``max_num_batched_tokens`` and the free KV blocks; with chunked prefill, first
the next chunk of every partially prefilled sequence) or a *decode* step over every running
sequence. A prefill step goes first when something can start, except that at
most ``max_consecutive_prefill_steps`` prefill steps run in a row while sequences are
running: then a decode step comes (1, the engine's default on CUDA: prefill and decode
steps alternate while requests wait; 0, its default on CPU: no bound; ``EngineConfig``). When a decode step lacks a KV block, the most recently started sequence is
preempted by recompute: its blocks are freed and it goes back to the head of the queue, to be
prefilled again over its prompt plus the tokens it already generated.

Why the bound (the tenth session's ``vllm bench serve`` on one H200, BENCHMARKS.md): with
prefill steps first without bound (nano-vllm's and vLLM v0's policy) a burst of 256
512-token prompts took 16 prefill steps (8192 tokens each) before any of them decoded, so all
256 decoded in lock-step and finished in the same step; a closed-loop client then sent the
next 256 at once, and every wave's requests waited for the whole wave's HTTP intake and
prefill: mean TTFT 986 ms against vLLM's 618. vLLM never starves running requests (its
scheduler puts every running request's decode token in each step and fills the rest of
``max_num_batched_tokens`` with prefill chunks), so its requests finish staggered and arrive
staggered. rlserve keeps prefill and decode steps apart (decode steps replay CUDA graphs);
alternating them gives the same staggering: a burst's groups start decoding one decode step
apart, finish one step apart, and their successors arrive spread out. Measured on one H200
(``benchmarks/serve_load.py``, 256 streaming clients, 512-token prompts, 256 tokens out,
SmolLM2-135M shape): mean TTFT 923 -> 700 ms, output 18,154 -> 19,882 tok/s; a burst of 256
requests of random lengths 30,078 -> 30,830 tok/s (BENCHMARKS.md, "Time to first token").

A prefill step stalls every running stream for its whole length (its tokens arrive one decode step
plus one prefill step apart), so while streamed sequences decode a prefill step takes at most
``max_prefill_tokens_while_decoding`` tokens (``--max-prefill-tokens-while-decoding``, default
:data:`DECODING_PREFILL_TOKENS`; :meth:`Scheduler.prefill_budget`). vLLM bounds the same stall with
``--max-num-batched-tokens``, which its decode tokens share with chunked prefill; its tuning guide
names 2048 for better inter-token latency. Issue 37 (session 15): with 8192-token prefill steps
between decode steps of 240 streams, ``vllm bench serve`` at concurrency 256 measured p99 inter-token
latency 45.6 ms against median 12.0 ms (H100, Qwen3-0.6B shape; BENCHMARKS.md). A budget that
shrinks only as the running sequences approach ``max_num_seqs`` (commit 400a92e) was worse at
concurrency 64 in ``benchmarks/stream_schedule_sim.py`` (p99 gap 16.1 ms against 7.8 with 2048:
a p99 sits among the stalled gaps as soon as more than 1% of the gaps are stalled, so the stall's
length decides it, not how many streams it hits). Non-streamed requests (the offline ``LLM``, plain
completions: the rollout case) see no gaps, only the total time, so while only they run prefill steps
take up to ``max_num_batched_tokens`` (2048 would cost the offline nano-vllm workload 1.3% of its
output rate in the same model: ``stream_schedule_sim.py --random-lens 100 1024``).

Chunked prefill (``enable_chunked_prefill``, vLLM's ``--enable-chunked-prefill``; off by default in
``EngineConfig`` since session 17, measured slower on an H100: BENCHMARKS.md, "HTTP serving"): a prompt longer than the step's budget is prefilled over several prefill steps,
each taking ``min(rest of the prompt, tokens left in the budget)`` (at most
``long_prefill_token_threshold`` per sequence when set), so a 32k prompt runs with an 8192 budget
and a stream waits for one chunk at a time instead of the whole prompt. The computed part of the
prompt is read like a prefix-cache hit (its KV is in its blocks; the attention takes queries past
position 0, ``AttentionMetadata``); the prompt's blocks are all allocated at its first chunk, its
full blocks enter the prefix cache as their chunk is scheduled (a later request that hits them runs
in a later step, or in the same step after the chunk's K/V are written). By default a step either
decodes or prefills, as before: decode steps replay CUDA graphs captured for pure decode batches;
alternating chunk steps and decode steps (``max_consecutive_prefill_steps``) bounds the stall by the
chunk, and a stream's gap across a chunk is one prefill step plus one decode step.

Mixed steps (``mixed_prefill_decode``, ``--mixed-prefill-decode``, off by default; session 17): a
prefill step while sequences run also decodes every running sequence (:meth:`Scheduler._schedule_mixed`;
vLLM's way, its decode tokens counted in the step's budget), so the gap is the one eager step. The
decode rows run in the eager prefill path (hundreds of kernel launches from Python, ~10 ms for
Qwen3-0.6B on an H100, s16's step trace); their attention runs in the backend's decode kernel
(``AttentionMetadata.decode_split``), the prompt rows' in the varlen one; the pure decode steps between mixed ones (``max_consecutive_prefill_steps``) keep
their graphs. ``benchmarks/stream_schedule_sim.py --mixed off on`` models both: the c256 p99 gap
20.5 -> 18.8 ms if an eager step's launch cost adds to its GPU work, 19.8 -> 11.5 ms if the work hides
under the launches (both fit s16's trace; BENCHMARKS.md, "HTTP serving", s17). A partial prefill is preempted
first when a decode step lacks a block, and one allocated before a prefix-cache reset (every weight
update resets it) restarts, so no prompt mixes two weight versions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.core.sequence import Sequence, SequenceStatus

DECODING_PREFILL_TOKENS = 2048
"""Default tokens of a prefill step at most while sequences decode: vLLM's default
``--max-num-batched-tokens`` for ``vllm serve`` on GPUs under 70 GB, and the value its tuning guide
gives for better inter-token latency."""


@dataclass
class ScheduledBatch:
    """One step's work.

    Attributes:
        seqs: sequences in batch order.
        is_prefill: prefill step (sequence ``i`` computes tokens ``starts[i]:ends[i]``) or decode
            step (one token each).
        starts / ends: prefill only: per sequence the first and one-past-the-last position
            computed in this step. None: ``num_cached_tokens`` to ``len(seq)`` (the whole rest of
            the prompt). A sequence with ``ends[i] < len(seq)`` is a chunk of a longer prefill
            (chunked prefill): it samples no token in this step.
    """

    seqs: list[Sequence]
    is_prefill: bool
    starts: list[int] | None = None
    ends: list[int] | None = None
    num_decodes: int = 0

    def span(self, i: int) -> tuple[int, int]:
        """Positions ``[start, end)`` sequence ``i`` computes in this step."""
        seq = self.seqs[i]
        if not self.is_prefill:
            return len(seq) - 1, len(seq)
        if self.starts is None:
            return seq.num_cached_tokens, len(seq)
        return self.starts[i], self.ends[i]

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that sample a token in this step (all but unfinished prefill chunks)."""
        if self.ends is None:
            return self.seqs
        return [s for s, e in zip(self.seqs, self.ends) if e == len(s)]

    @property
    def num_tokens(self) -> int:
        if not self.is_prefill:
            return len(self.seqs)
        return sum(e - b for b, e in map(self.span, range(len(self.seqs))))


class Scheduler:
    """Args:
    block_manager: the KV block allocator.
    max_num_seqs: sequences per step at most.
    max_num_batched_tokens: tokens per prefill step at most (without chunked prefill a single
        prompt longer than this still runs alone).
    max_consecutive_prefill_steps: prefill steps in a row at most while sequences are running
        (then a decode step); 0: no bound (prefill steps first whenever something can start).
    max_prefill_tokens_while_decoding: tokens of a prefill step at most while sequences are
        running (capped at ``max_num_batched_tokens``); None: :data:`DECODING_PREFILL_TOKENS`.
        Without chunked prefill a single prompt longer than the budget still runs alone.
    enable_chunked_prefill: split a prompt's prefill over steps in chunks of at most the step's
        budget (:meth:`prefill_budget`; vLLM's ``--enable-chunked-prefill``).
    long_prefill_token_threshold: with chunked prefill, tokens of one sequence's chunk at most
        (vLLM's ``--long-prefill-token-threshold``); 0: no bound beyond the step's budget.
    mixed_prefill_decode: a prefill step while sequences run also decodes every running sequence
        (vLLM's mixed steps: :meth:`_schedule_mixed`); its decode tokens count against the step's
        prefill budget.

Raises:
    ValueError: ``max_consecutive_prefill_steps`` below 0, ``max_prefill_tokens_while_decoding``
        below 1, ``long_prefill_token_threshold`` below 0.
"""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_consecutive_prefill_steps: int = 1, max_prefill_tokens_while_decoding: int | None = None,
                 enable_chunked_prefill: bool = False, long_prefill_token_threshold: int = 0,
                 mixed_prefill_decode: bool = False):
        if max_num_batched_tokens < 1:  # chunked prefill with 0 would schedule no prefill, ever
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_consecutive_prefill_steps < 0:
            raise ValueError(f"max_consecutive_prefill_steps must be >= 0 (0: no bound), "
                             f"got {max_consecutive_prefill_steps}")
        if max_prefill_tokens_while_decoding is not None and max_prefill_tokens_while_decoding < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {max_prefill_tokens_while_decoding}")
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no bound), got {long_prefill_token_threshold}")
        self.max_prefill_tokens_while_decoding = (DECODING_PREFILL_TOKENS if max_prefill_tokens_while_decoding is None
                                                  else max_prefill_tokens_while_decoding)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_consecutive_prefill_steps = max_consecutive_prefill_steps
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.mixed_prefill_decode = mixed_prefill_decode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # chunked prefill: sequences part-way through their prefill, oldest first; they hold the
        # KV blocks of their whole prompt and are in neither ``waiting`` nor ``running``
        self.prefilling: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_steps_in_a_row = 0  # prefill steps since the last decode step

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def prefill_budget(self) -> int:
        """Tokens the next prefill step may take: ``min(max_num_batched_tokens,
        max_prefill_tokens_while_decoding)`` while a streamed sequence (``Sequence.streamed``, set by
        the engine core for a streamed request) is running, else ``max_num_batched_tokens``: a
        non-streamed request (the offline ``LLM``, a rollout's plain completion) sees no gaps, only
        the total time, which fewer, larger prefill steps shorten."""
        if self.max_prefill_tokens_while_decoding < self.max_num_batched_tokens and \
                any(s.streamed for s in self.running):
            return self.max_prefill_tokens_while_decoding
        return self.max_num_batched_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks: decoding or part-way through a chunked prefill."""
        return len(self.running) + len(self.prefilling)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch; None when there is nothing to run.

        Raises:
            RuntimeError: if a single sequence cannot fit in the whole KV cache.
        """
        if self.prefilling:
            self._restart_stale_prefills()
        limit = self.max_consecutive_prefill_steps
        decode_due = bool(self.running) and limit > 0 and self.prefill_steps_in_a_row >= limit
        if not decode_due and (self.waiting or self.prefilling):
            if self.mixed_prefill_decode and self.running:
                batch = self._schedule_mixed()
                if batch is None or not batch.is_prefill:  # nothing could start: a plain decode step (or None)
                    self.prefill_steps_in_a_row = 0
                    return batch
            else:
                batch = self._schedule_chunks() if self.enable_chunked_prefill else self._schedule_prefill()
            if batch is not None:
                self.prefill_steps_in_a_row += 1
                return batch
        self.prefill_steps_in_a_row = 0
        return self._schedule_decode()

    def _schedule_mixed(self) -> ScheduledBatch | None:
        """A mixed step: one decode token for every running sequence (as :meth:`_schedule_decode`,
        preempting when a block is missing), then prefill work as :meth:`_schedule_chunks` /
        :meth:`_schedule_prefill` in what is left of :meth:`prefill_budget` after the decode tokens
        (vLLM's scheduler: decodes and chunks share ``--max-num-batched-tokens``). When no prefill
        work fits, :meth:`_schedule_decode`'s batch alone (``is_prefill`` False; None when nothing runs)."""
        decode = self._schedule_decode()
        decodes = [] if decode is None else decode.seqs
        room = self.prefill_budget() - len(decodes)
        part = None
        if room > 0:
            part = self._schedule_chunks(room) if self.enable_chunked_prefill else self._schedule_prefill(room)
        if part is None:
            return decode
        seqs = part.seqs
        starts = [s.num_cached_tokens for s in seqs] if part.starts is None else part.starts
        ends = [len(s) for s in seqs] if part.ends is None else part.ends
        return ScheduledBatch(decodes + seqs, True, [len(s) - 1 for s in decodes] + starts,
                              [len(s) for s in decodes] + ends, num_decodes=len(decodes))

    def _schedule_prefill(self, budget: int | None = None) -> ScheduledBatch | None:
        """Whole prompts (chunked prefill off): FIFO while they fit the budget
        (:meth:`prefill_budget` unless given); a prompt longer than the budget runs alone."""
        prefill: list[Sequence] = []
        tokens = 0
        budget = self.prefill_budget() if budget is None else budget
        while self.waiting and len(self.running) + len(prefill) < self.max_num_seqs:
            seq = self.waiting[0]
            if prefill and tokens + len(seq) > budget:
                break
            if not self._allocate_head(seq, first=not prefill):
                break
            tokens += len(seq) - seq.num_cached_tokens
            prefill.append(seq)
        if not prefill:
            return None
        self.running.extend(prefill)
        return ScheduledBatch(prefill, is_prefill=True)

    def _chunk_end(self, start: int, seq: Sequence, room: int) -> int:
        """End of the chunk of ``seq`` from ``start`` in a step with ``room`` tokens left."""
        n = min(len(seq) - start, room)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return start + n

    def _schedule_chunks(self, budget: int | None = None) -> ScheduledBatch | None:
        """Chunked prefill: first the next chunk of each partial prefill (oldest first), then
        waiting sequences FIFO, each taking ``min(rest of its prompt, tokens left in the step's
        budget)`` (:meth:`prefill_budget` unless given); a sequence whose chunk ends before its
        prompt does stays in ``prefilling``.
        The blocks of the whole prompt are allocated at its first chunk; full blocks enter the
        prefix cache as their chunk is scheduled (a later step, which reads them, runs after it)."""
        budget = self.prefill_budget() if budget is None else budget
        out: tuple[list, list, list] = ([], [], [])  # sequences, starts, ends
        tokens = 0
        partial, self.prefilling = self.prefilling, []
        for seq in partial:
            if tokens >= budget:
                self.prefilling.append(seq)
            else:
                tokens += self._add_chunk(seq, seq.num_computed_tokens, budget - tokens, out)
        while self.waiting and tokens < budget and self.num_running < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._allocate_head(seq, first=not out[0], register=False):
                break
            tokens += self._add_chunk(seq, seq.num_cached_tokens, budget - tokens, out)
        seqs, starts, ends = out
        if not seqs:
            return None
        return ScheduledBatch(seqs, True, starts, ends)

    def _add_chunk(self, seq: Sequence, start: int, room: int, out: tuple[list, list, list]) -> int:
        """Put ``seq``'s chunk from ``start`` (at most ``room`` tokens) into ``out`` (sequences,
        starts, ends), register its full blocks in the prefix cache and file ``seq`` under
        ``prefilling`` (its prompt goes on) or ``running``. Returns the chunk's tokens."""
        end = self._chunk_end(start, seq, room)
        seq.num_computed_tokens = end
        self.block_manager.register_full_blocks(seq)
        for lst, x in zip(out, (seq, start, end)):
            lst.append(x)
        (self.prefilling if end < len(seq) else self.running).append(seq)
        return end - start

    def _allocate_head(self, seq: Sequence, first: bool, register: bool = True) -> bool:
        """Allocate the blocks of ``waiting[0]`` (``seq``) and pop it; False when they do not fit.

        Raises:
            RuntimeError: ``first`` and nothing runs, and ``seq`` needs more blocks than the cache has.
        """
        if not self.block_manager.can_allocate(seq):
            if first and not self.running and not self.prefilling \
                    and seq.num_blocks_needed > self.block_manager.num_blocks:
                raise RuntimeError(
                    f"sequence of {len(seq)} tokens needs {seq.num_blocks_needed} KV blocks; the cache has "
                    f"{self.block_manager.num_blocks}"
                )
            return False
        self.waiting.popleft()
        allow_hit = not (seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0)
        self.block_manager.allocate(seq, allow_prefix_hit=allow_hit, register=register)
        seq.status = SequenceStatus.RUNNING
        return True

    def _restart_stale_prefills(self) -> None:
        """A partial prefill allocated before the last prefix-cache reset (every weight update
        resets it) starts over: its prompt is computed under one weight version, never half under
        the old weights and half under the new ones."""
        epoch = self.block_manager.epoch
        stale = [s for s in self.prefilling if s.cache_epoch != epoch]
        if stale:
            self.prefilling = [s for s in self.prefilling if s.cache_epoch == epoch]
            for seq in reversed(stale):  # back to the head of the queue in their order
                self._preempt(seq)

    def _schedule_decode(self) -> ScheduledBatch | None:
        """One token for every running sequence; when a KV block is missing, partial prefills
        are preempted first (newest first), then the most recently started running sequences."""
        decode: list[Sequence] = []
        queue = self.running
        bm = self.block_manager
        i, end = 0, len(queue)  # queue[i:end] still to place; preempted ones are cut off the end
        while i < end:
            seq = queue[i]
            i += 1
            while not bm.reserve_decode_slot(seq):
                if self.prefilling:
                    self._preempt(self.prefilling.pop())
                elif end > i:
                    end -= 1
                    self._preempt(queue[end])
                else:
                    self._preempt(seq)
                    seq = None
                    break
            if seq is None:
                break
            decode.append(seq)
        self.running = decode
        if not decode:
            return None
        return ScheduledBatch(list(decode), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` finished and release its blocks (running, part-way through its prefill,
        or waiting)."""
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.register_full_blocks(seq)
            self.block_manager.free(seq)
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.prefilling:
                self.prefilling.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
