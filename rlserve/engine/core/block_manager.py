"""Paged KV-cache block allocation with prefix caching.

Prefix caching follows the chained-hash scheme of vLLM's automatic prefix caching: the
hash of a *full* block is ``hash((hash_of_previous_block, tuple(block_token_ids)))``, so
equal hashes mean equal whole prefixes. A freed block keeps its hash and content until it
is reused (least-recently-freed first), so a later request with the same prefix can pick
it up again without recomputation.

The chain of a sequence on a LoRA adapter starts from the adapter's id instead of None
(:func:`prefix_root`): KV computed under one adapter (or one load of it: ids are never reused)
is never found by a request on the base model or on another adapter.
"""

from __future__ import annotations

from collections import OrderedDict

from rlserve.engine.core.sequence import Sequence


class Block:
    """One KV-cache block: ``block_size`` token slots in every layer's cache."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the previous block's hash (:func:`prefix_root` for the first block)."""
    return hash((prev_hash, token_ids))


def prefix_root(seq: Sequence) -> int | None:
    """The ``prev_hash`` of ``seq``'s first block: None on the base model, else a hash of its
    LoRA adapter id (``params.lora_int_id``)."""
    adapter = getattr(seq.params, "lora_int_id", 0)
    return hash(("lora", adapter)) if adapter else None


class BlockManager:
    """Hands out KV blocks to sequences and tracks prefix-cache entries.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse blocks whose chained hash matches.

    Counters (for metrics and tests): ``prefix_hit_tokens`` (prompt tokens served from the
    cache), ``prefix_queries`` (prompt tokens looked up).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in reuse order (front first); an ordered dict so that taking back a cached
        # free block on a prefix hit is O(1) (a deque's remove scanned every free block: ~0.6 ms
        # per hit with an H200's ~68k blocks)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # ids of blocks whose ``hash`` is set: reset_prefix_cache visits these, not every block
        # (an H200's KV cache has tens of thousands of blocks: a full walk cost ~10 ms of stall)
        self.hashed_block_ids: set[int] = set()
        self.prefix_hit_tokens = 0
        self.prefix_queries = 0
        # bumped by reset_prefix_cache: KV computed under an older epoch (e.g. old weights)
        # must never be published to the prefix cache again
        self.epoch = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- allocation -------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        block = self.blocks[self.free_block_ids.popitem(last=False)[0]]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]  # evict the cached content
        block.hash = None
        block.token_ids = None
        self.hashed_block_ids.discard(block.block_id)
        block.ref_count = 1
        return block

    def _register(self, block: Block, h: int, token_ids: tuple[int, ...]) -> None:
        block.hash = h
        block.token_ids = token_ids
        self.hashed_block_ids.add(block.block_id)
        if self.enable_prefix_caching:
            self.hash_to_block[h] = block.block_id

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether all of ``seq``'s tokens fit, counting no prefix hits (conservative)."""
        return seq.num_blocks_needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, allow_prefix_hit: bool = True, register: bool = True) -> None:
        """Give ``seq`` blocks for all its current tokens, reusing cached full blocks.

        Sets ``seq.block_table`` and ``seq.num_cached_tokens``. At most the full blocks among
        the first ``len(seq) - 1`` tokens can hit, so every prefill computes >= 1 token.
        ``register``: the new full blocks enter the prefix cache now (their KV is computed in
        the step that allocated them); False (chunked prefill: a later chunk computes them) leaves
        them to :meth:`register_full_blocks` once their chunk is scheduled.

        Raises:
            RuntimeError: if the blocks do not fit (call :meth:`can_allocate` first).
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError("not enough free KV blocks")
        tokens = seq.all_token_ids
        bs = self.block_size
        hittable = (len(tokens) - 1) // bs if (allow_prefix_hit and self.enable_prefix_caching) else 0
        prev: int | None = prefix_root(seq)
        cached = 0
        miss = False
        for i in range(seq.num_blocks_needed):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            full = len(chunk) == bs
            h = chain_hash(prev, chunk) if full else None
            block = None
            if not miss and i < hittable and h is not None:
                bid = self.hash_to_block.get(h)
                if bid is not None and self.blocks[bid].token_ids == chunk:
                    block = self.blocks[bid]
                    if block.ref_count == 0:
                        del self.free_block_ids[bid]
                    block.ref_count += 1
                    cached += bs
                else:
                    miss = True
            if block is None:
                block = self._take_free_block()
                if full and register:
                    self._register(block, h, chunk)
            seq.block_table.append(block.block_id)
            prev = h
        if self.enable_prefix_caching and allow_prefix_hit:
            self.prefix_queries += len(tokens)
            self.prefix_hit_tokens += cached
        seq.num_cached_tokens = cached
        seq.cache_epoch = self.epoch

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; cached content stays reusable until evicted."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[bid] = None
                if block.hash is None:  # nothing worth keeping: reuse first
                    self.free_block_ids.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step (which writes token ``len(seq)-1``) has a slot."""
        return seq.num_blocks_needed <= len(seq.block_table) or self.num_free_blocks >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Make room for ``seq``'s newest token before a decode step; registers the
        previous block's hash once it became full (so generated text is cacheable too)."""
        if seq.num_blocks_needed > len(seq.block_table):
            seq.block_table.append(self._take_free_block().block_id)

    def reserve_decode_slot(self, seq: Sequence) -> bool:
        """:meth:`can_append` then :meth:`append_slot` in one pass (the scheduler's per-sequence
        decode step); False, changing nothing, when no block is free for it."""
        need = (len(seq) + self.block_size - 1) // self.block_size
        if need > len(seq.block_table):
            if not self.free_block_ids:
                return False
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash every full block of ``seq`` not yet hashed (after tokens were computed).

        Nothing is published for a sequence allocated before the last
        :meth:`reset_prefix_cache`: its KV may come from weights that are gone."""
        if not self.enable_prefix_caching or getattr(seq, "cache_epoch", None) != self.epoch:
            return
        bs = self.block_size
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        prev = prefix_root(seq)
        for i in range(n_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                chunk = tuple(seq.block_tokens(i))
                h = chain_hash(prev, chunk)
                if h not in self.hash_to_block:
                    self._register(block, h, chunk)
                else:
                    block.hash, block.token_ids = h, chunk
                    self.hashed_block_ids.add(block.block_id)
            prev = block.hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after a weight update: old KV is stale).

        Blocks in use keep their data but are no longer findable; free blocks lose their
        content. Sequences allocated before the reset never publish their blocks."""
        self.epoch += 1
        self.hash_to_block.clear()
        for bid in self.hashed_block_ids:
            block = self.blocks[bid]
            block.hash = None
            block.token_ids = None
        self.hashed_block_ids.clear()
