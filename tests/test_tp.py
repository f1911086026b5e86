"""Tensor parallelism on CPU (gloo): TP=2 greedy outputs equal TP=1 and Hugging Face,
including attention heads that do not divide over the TP size (SmolLM2's 9 heads / 3 KV
heads: GQA groups split 2 + 1 over 2 ranks)."""

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.distributed.head_partition import attention_head_partition, attention_head_partition_sizes
from rlserve.distributed.parallel_state import tp_context
from rlserve.layers.linear import QKVParallelLinear, RowParallelLinear
from tests.test_engine import PROMPTS, hf_greedy

NEW = 24

# SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64) scaled down to head_dim 16.
SMOLLM_9_HEADS = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144)


@pytest.mark.parametrize("arch,overrides", [
    ("opt", {}),
    ("qwen3", {}),
    ("smollm", SMOLLM_9_HEADS),
], ids=["opt", "qwen3", "smollm_9h_3kv"])
def test_tp2_greedy_equals_tp1_and_hf(arch, overrides, tiny_model):
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
    tp2 = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2)
    try:
        if overrides:  # the uneven split really happened: rank 0 holds 2 GQA groups, rank 1 one
            attn = tp2.engine.model.model.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (6, 2)
        out2 = tp2.generate(PROMPTS, params)
    finally:
        tp2.engine.executor.shutdown()
    out1 = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, params)
    ref = hf_greedy(path, [o.prompt_token_ids for o in out1], NEW)
    for a, b, r in zip(out2, out1, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == r
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in db:
                assert abs(da[t] - db[t]) < 1e-4


# ---- the head partition rule ---------------------------------------------------------------

@pytest.mark.parametrize("q,kv,tp,expected", [
    (9, 3, 2, [(0, 6, 0, 2), (6, 3, 2, 1)]),                    # SmolLM2-135M over 2 ranks
    (9, 3, 1, [(0, 9, 0, 3)]),
    (9, 3, 3, [(0, 3, 0, 1), (3, 3, 1, 1), (6, 3, 2, 1)]),
    (8, 2, 2, [(0, 4, 0, 1), (4, 4, 1, 1)]),                    # even: the usual split
    (5, 5, 2, [(0, 3, 0, 3), (3, 2, 3, 2)]),                    # MHA, odd heads
    (10, 5, 4, [(0, 4, 0, 2), (4, 2, 2, 1), (6, 2, 3, 1), (8, 2, 4, 1)]),
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),                    # fewer KV heads: replicated
    (4, 2, 4, [(0, 1, 0, 1), (1, 1, 0, 1), (2, 1, 1, 1), (3, 1, 1, 1)]),
])
def test_attention_head_partition(q, kv, tp, expected):
    got = [attention_head_partition(q, kv, tp, r) for r in range(tp)]
    assert got == expected
    assert attention_head_partition_sizes(q, kv, tp) == [(e[1], e[3]) for e in expected]
    group = q // kv
    for q_start, q_count, kv_start, kv_count in got:
        # every query head of a rank belongs to one of the rank's KV heads
        assert all(kv_start <= h // group < kv_start + kv_count for h in range(q_start, q_start + q_count))
    # query heads are covered exactly once, contiguously in rank order
    assert [h for s, n, _, _ in got for h in range(s, s + n)] == list(range(q))
    if kv >= tp:
        counts = [c for _, _, _, c in got]
        assert max(counts) - min(counts) <= 1 and sum(counts) == kv
        assert [h for _, _, s, n in got for h in range(s, s + n)] == list(range(kv))


@pytest.mark.parametrize("q,kv,tp,match", [
    (9, 3, 4, "tensor_parallel_size=4 is not divisible by num_key_value_heads=3"),
    (6, 2, 4, "num_attention_heads=6 is not divisible by tensor_parallel_size=4"),
    (4, 3, 2, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
])
def test_attention_head_partition_errors(q, kv, tp, match):
    with pytest.raises(ValueError, match=match):
        attention_head_partition(q, kv, tp, 0)
    with pytest.raises(ValueError, match=match), tp_context(0, tp, object()):
        QKVParallelLinear(8, 2, q, kv, bias=False)
    with pytest.raises(ValueError, match="out of range"):
        attention_head_partition(4, 2, 2, 2)


def _arange(*shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_uneven_qkv_and_o_proj_shards_reassemble_the_full_weights():
    """9 query / 3 KV heads over 2 ranks: the qkv rows and o_proj columns each rank loads are
    its heads' slices of the full HF tensors; the ranks' shards put together are the full
    tensors; an already-sliced per-rank tensor loads as is; checkpoint shapes stay full."""
    hd, H, KV, hidden = 2, 9, 3, 5
    q, k, v = _arange(H * hd, hidden), 1000 + _arange(KV * hd, hidden), 2000 + _arange(KV * hd, hidden)
    qb, kb, vb = torch.arange(H * hd * 1.0), 100 + torch.arange(KV * hd * 1.0), 200 + torch.arange(KV * hd * 1.0)
    o = 3000 + _arange(hidden, H * hd)
    sizes = [n * hd for n, _ in attention_head_partition_sizes(H, KV, 2)]
    assert sizes == [12, 6]
    shards = []
    for rank in range(2):
        with tp_context(rank, 2, object()):
            qkv = QKVParallelLinear(hidden, hd, H, KV, bias=True)
            o_proj = RowParallelLinear(H * hd, hidden, bias=False, input_partition_sizes=sizes)
        for sid, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            qkv.weight.weight_loader(qkv.weight, w, sid)
            qkv.bias.weight_loader(qkv.bias, b, sid)
        o_proj.weight.weight_loader(o_proj.weight, o)
        assert qkv.checkpoint_shapes("weight") == {"q": (H * hd, hidden), "k": (KV * hd, hidden),
                                                   "v": (KV * hd, hidden)}
        assert o_proj.checkpoint_shapes("weight") == {None: (hidden, H * hd)}
        nq, nkv = qkv.num_heads * hd, qkv.num_kv_heads * hd
        assert qkv.weight.shape == (nq + 2 * nkv, hidden) and o_proj.weight.shape == (hidden, nq)
        shards.append((qkv.weight.clone(), qkv.bias.clone(), o_proj.weight.clone(), nq, nkv))
        # the fused full tensor gives the same result
        qkv.weight.weight_loader(qkv.weight, torch.cat([q, k, v]))
        assert torch.equal(qkv.weight, shards[-1][0])
        # a per-rank shard of the right shape is taken as is
        o_proj.weight.weight_loader(o_proj.weight, shards[-1][2] + 1)
        assert torch.equal(o_proj.weight, shards[-1][2] + 1)
        with pytest.raises(ValueError):
            o_proj.weight.weight_loader(o_proj.weight, torch.zeros(hidden, H * hd + 1))
    assert [s[3:] for s in shards] == [(12, 4), (6, 2)]
    parts = [s[0].split([s[3], s[4], s[4]]) for s in shards]
    assert torch.equal(torch.cat([p[0] for p in parts]), q)
    assert torch.equal(torch.cat([p[1] for p in parts]), k)
    assert torch.equal(torch.cat([p[2] for p in parts]), v)
    bparts = [s[1].split([s[3], s[4], s[4]]) for s in shards]
    assert torch.equal(torch.cat([p[1] for p in bparts]), kb)
    assert torch.equal(torch.cat([s[2] for s in shards], dim=1), o)


def test_row_parallel_explicit_partition_forward_and_validation():
    """Rank outputs of an unevenly split RowParallelLinear sum to the full matmul; a full
    input (``input_is_parallel=False``) is sliced by the same ranges."""
    w, x = _arange(3, 7) / 10, _arange(2, 7) / 7
    partial = []
    for rank in range(2):
        with tp_context(rank, 2, object()):
            row = RowParallelLinear(7, 3, bias=False, input_is_parallel=False, reduce_results=False,
                                    input_partition_sizes=[4, 3])
        row.weight.weight_loader(row.weight, w)
        partial.append(row(x))
    torch.testing.assert_close(partial[0] + partial[1], x @ w.T)
    for bad in ([4, 4], [7], [7, 0]):
        with tp_context(0, 2, object()), pytest.raises(ValueError, match="input_partition_sizes"):
            RowParallelLinear(7, 3, input_partition_sizes=bad)


@pytest.mark.parametrize("kv", [{}, {"num_kv_blocks": 14, "block_size": 4}], ids=["default-cache", "14-blocks"])
def test_tp2_ranks_see_the_resolved_max_model_len(tiny_model, kv):
    """``max_model_len=-1`` (``--max-model-len auto``) under TP=2: every rank's config holds the length rank 0
    resolved (session 22, FIX item 6: the follower kept -1; with the default CPU cache its KV sizing then
    rounded -1 tokens to 0 blocks and the start failed), and its resolved ``max_num_batched_tokens`` (session 23:
    the follower kept None, so its activation estimate and warm-up used other step sizes than rank 0's). The model's 256 tokens where the cache holds them;
    cut to the cache (56 tokens of 14 blocks of 4) where it does not. Greedy equals TP=1 and Hugging Face."""
    path = tiny_model("qwen3")
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    tp2 = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=-1, **kv)
    try:
        want = 56 if kv else 256
        assert tp2.engine.max_model_len == tp2.engine.config.max_model_len == want
        # and the step budget rank 0 resolved (the CPU default, 1,024 tokens: the follower kept None)
        assert tp2.engine.config.max_num_batched_tokens == 1024
        assert tp2.engine.executor.collective_rpc("tests.test_tp:token_limits_seen") == [[want, 1024]] * 2
        out2 = tp2.generate(PROMPTS, params)
    finally:
        tp2.engine.executor.shutdown()
    ref = hf_greedy(path, [o.prompt_token_ids for o in out2], 8)
    assert [o.outputs[0].token_ids for o in out2] == ref


def token_limits_seen(worker) -> list:
    """(collective_rpc target) a rank's ``[config.max_model_len, config.max_num_batched_tokens]``."""
    return [worker.config.max_model_len, worker.config.max_num_batched_tokens]
