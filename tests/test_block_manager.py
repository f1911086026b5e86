"""Block manager and scheduler: allocation, prefix hits, eviction, preemption."""

import pytest

from rlserve.engine.core.block_manager import BlockManager
from rlserve.engine.sampling_params import SamplingParams
from rlserve.engine.core.scheduler import Scheduler
from rlserve.engine.core.sequence import Sequence, SequenceStatus


def seq(tokens, bs=4):
    return Sequence("r", 0, tokens, SamplingParams(max_tokens=100), bs)


def test_prefix_hit_reuses_full_blocks_but_not_last_token():
    bm = BlockManager(10, 4)
    a = seq(list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_cached_tokens == 0
    a_table = list(a.block_table)
    bm.free(a)
    b = seq(list(range(10)))
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a_table[:2]
    c = seq(list(range(8)))  # exactly two full blocks: only the first may hit (last token is recomputed)
    bm.allocate(c)
    assert c.num_cached_tokens == 4
    assert bm.blocks[c.block_table[0]].ref_count == 2


def test_different_prefix_misses_and_eviction_order():
    bm = BlockManager(4, 4)
    a = seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    bm.free(a)
    b = seq([9, 9, 9, 9, 5])
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    bm.free(b)
    # a's first block was freed first, so it is evicted before b's
    c = seq([7, 7, 7, 7, 7, 7, 7, 7, 7])  # 3 blocks: takes 2 uncached free blocks + evicts a's
    bm.allocate(c)
    bm.free(c)
    d = seq([9, 9, 9, 9, 1])
    bm.allocate(d)
    assert d.num_cached_tokens == 4


def test_reset_prefix_cache_forgets():
    bm = BlockManager(8, 4)
    a = seq(list(range(9)))
    bm.allocate(a)
    bm.free(a)
    running = seq(list(range(100, 113)))  # still holding hashed blocks at the reset
    bm.allocate(running)
    assert bm.hashed_block_ids == {i for i, blk in enumerate(bm.blocks) if blk.hash is not None}
    bm.reset_prefix_cache()
    # every block forgot its content (the reset visits only the hashed ones)
    assert all(blk.hash is None and blk.token_ids is None for blk in bm.blocks)
    assert not bm.hashed_block_ids and not bm.hash_to_block
    bm.free(running)
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_scheduler_preempts_latest_when_blocks_run_out():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    s1, s2 = seq([1, 2, 3], bs=2), seq([4, 5, 6], bs=2)
    sch.add(s1)
    sch.add(s2)
    batch = sch.schedule()
    assert batch.is_prefill and batch.seqs == [s1, s2] and bm.num_free_blocks == 0
    for s in (s1, s2):
        s.num_computed_tokens = len(s)
        s.output_token_ids.append(7)  # 4 tokens: still fits in 2 blocks
    batch = sch.schedule()
    assert not batch.is_prefill and batch.seqs == [s1, s2]
    for s in (s1, s2):
        s.output_token_ids.append(8)  # 5 tokens: each needs a third block, none free
    batch = sch.schedule()
    assert batch.seqs == [s1]
    assert s2.status == SequenceStatus.WAITING and s2.block_table == [] and sch.num_preemptions == 1
    assert list(sch.waiting) == [s2]


def test_sequence_too_long_for_cache_raises():
    bm = BlockManager(2, 2)
    sch = Scheduler(bm, 4, 64)
    sch.add(seq([1, 2, 3, 4, 5, 6], bs=2))
    with pytest.raises(RuntimeError, match="KV blocks"):
        sch.schedule()


def test_sequence_allocated_before_reset_never_publishes_its_blocks():
    bm = BlockManager(8, 4)
    a = seq(list(range(9)))
    bm.allocate(a)
    a.num_computed_tokens = len(a)
    bm.reset_prefix_cache()  # e.g. a weight update while ``a`` is in flight
    bm.register_full_blocks(a)
    bm.free(a)
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    b.num_computed_tokens = len(b)
    bm.register_full_blocks(b)
    bm.free(b)
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_cached_tokens == 8


def test_free_list_order_and_taking_back_a_cached_free_block():
    bm = BlockManager(6, 2)
    a = seq([1, 2, 3, 4, 5], bs=2)  # blocks 0, 1 full (hashed), block 2 partial
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    # the partial block (nothing worth keeping) is reused first, the hashed ones last
    assert list(bm.free_block_ids) == [2, 3, 4, 5, 1, 0]
    b = seq([1, 2, 3, 4, 9], bs=2)  # hits blocks 0 and 1: they leave the free list
    bm.allocate(b)
    assert b.num_cached_tokens == 4 and b.block_table == [0, 1, 2]
    assert list(bm.free_block_ids) == [3, 4, 5]
    c = seq([7, 7], bs=2)
    bm.allocate(c)
    assert c.block_table == [3] and list(bm.free_block_ids) == [4, 5]


def test_scheduler_preemption_order_with_several_running():
    # decode needs a block for every sequence; the latest started ones are preempted first,
    # the earliest keep running, and the waiting queue holds the preempted in start order
    bm = BlockManager(6, 2, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    ss = [seq([i, i], bs=2) for i in range(3)]
    for s in ss:
        sch.add(s)
    assert sch.schedule().seqs == ss and bm.num_free_blocks == 3
    for s in ss:
        s.num_computed_tokens = len(s)
        s.output_token_ids += [9, 9]  # 4 tokens: a second block each, then a third
    assert sch.schedule().seqs == ss and bm.num_free_blocks == 0
    for s in ss:
        s.output_token_ids.append(9)
    batch = sch.schedule()
    # ss[0] needs a block: ss[2] is preempted (2 blocks back); ss[1] takes one of them
    assert batch.seqs == [ss[0], ss[1]] and list(sch.waiting) == [ss[2]]
    assert ss[2].status == SequenceStatus.WAITING and sch.num_preemptions == 1
