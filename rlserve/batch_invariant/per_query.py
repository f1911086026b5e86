"""Every query token of a step as its own decode row: how the batch-invariant mode runs the
attention of steps with prefills on the decode kernels (CPU and CUDA), so that a token's
attention does not depend on whether it was in a prompt, a prefix-cache hit or a decode step.
"""

from __future__ import annotations

import torch


def _lists(meta) -> tuple[list[int], list[int]]:
    """Per query token: its sequence's index and its context length (position + 1)."""
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    rows, ctx = [], []
    for b, s in enumerate(lens):
        q = qsl[b + 1] - qsl[b]
        rows.extend([b] * q)
        ctx.extend(range(s - q + 1, s + 1))
    return rows, ctx


def per_query_tables(meta) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_tables [T, max_blocks] int32, seq_lens [T] int32)`` on ``meta``'s device: query
    token ``t`` of sequence ``b`` gets ``b``'s block table and its own context length (its
    position + 1). Built from the host lists once per step (``meta.backend_cache``).

    ``meta``: an :class:`rlserve.layers.attention.AttentionMetadata` (not imported here: the
    attention module imports this one)."""
    got = meta.backend_cache.get("bi_per_query")
    if got is None:
        rows, ctx = _lists(meta)
        dev = meta.block_tables.device
        bt = meta.block_tables.index_select(0, torch.tensor(rows, dtype=torch.long).to(dev))
        got = (bt.to(torch.int32).contiguous(), torch.tensor(ctx, dtype=torch.int32).to(dev), ctx)
        meta.backend_cache["bi_per_query"] = got
    return got[0], got[1]


def per_query_meta(meta):
    """``meta`` with every query token as a one-token sequence (:func:`per_query_tables`): the
    metadata of a decode step over ``T`` rows that computes the same attention (built once per
    step, kept in ``meta.backend_cache``)."""
    got = meta.backend_cache.get("bi_per_query_meta")
    if got is None:
        bt, ctx = per_query_tables(meta)
        T = bt.shape[0]
        got = meta.backend_cache["bi_per_query_meta"] = type(meta)(
            slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(T + 1, dtype=torch.int32, device=bt.device),
            seq_lens=ctx, block_tables=bt, max_query_len=1, max_seq_len=meta.max_seq_len,
            block_size=meta.block_size, query_start_loc_cpu=list(range(T + 1)),
            seq_lens_cpu=meta.backend_cache["bi_per_query"][2])
    return got
