"""The batch-invariant mode's attention for steps with prefill tokens (CUDA, Triton): several
query tokens of one sequence share a program and its K/V reads, and each token gets the bits
the one-split decode kernel gives it as a decode row.

The mode needs a token's attention to be the same in a prompt, a prefix-cache hit, a chunked
prefill and a decode step. The first form (``"per_query"``, :mod:`rlserve.batch_invariant.per_query`)
ran every prefill token as its own decode row: right, but each of ``T`` tokens re-read its whole
context (``T x context`` K/V rows per KV head). Here (``"tiles"``, the default, :data:`FORM`)
a program takes one KV head and a tile of ``QT = GROUP_PAD // GROUP`` consecutive query tokens
of one sequence (``GROUP`` query heads per KV head, ``GROUP_PAD = max(16, next power of 2)``):
its ``[GROUP_PAD, head_dim]`` query block holds row ``r`` = token ``r // GROUP``, head
``r % GROUP`` instead of the decode kernel's ``GROUP`` heads of one token plus padding. Every
operation is the decode kernel's (:func:`rlserve.layers.triton_attention_kernels._decode_kernel`)
with the same shapes, tile ``BLOCK_N``, warps and dot precision, so each row is computed by the
same instructions in the same order:

- ``s = q @ k^T`` over ``head_dim`` (one ``tl.dot`` of the same ``[GROUP_PAD, D_PAD] x [D_PAD,
  BLOCK_N]`` shape: a tensor-core row's result depends on that row's inputs only);
- keys at or past a row's own context length are ``-inf`` (the decode kernel's length mask);
- the K/V walk starts at key 0 in ``BLOCK_N`` steps for every row; a row whose context ended
  earlier than the tile's last token sees only masked tiles after it, which leave its state
  bit for bit unchanged (``max(m, -inf) = m``, ``alpha = exp2(0) = 1``, ``p = 0``: ``l * 1 + 0``,
  ``acc * 1 + 0``);
- ``o = acc / l`` rounded once to the output dtype.

So the K/V reads drop by ``QT`` (8 for Qwen3-0.6B's 16 / 8 heads, 4 for Qwen3-8B's 32 / 8).
Decode steps (``max_query_len == 1``) keep the decode kernel itself with one split (CUDA-graph
captured); ``tests/gpu/test_batch_invariant_gpu.py`` checks prefill against decode bitwise on
the GPU, ``tests/test_batch_invariant_triton.py`` the masks and the row mapping in Triton's
interpreter.
"""

from __future__ import annotations

import torch

#: which prefill form the mode runs: "tiles" (this module) or "per_query" (every token as a
#: decode row; A/B runs and tests set it)
FORM = ["tiles"]

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False


def query_tiles(meta, qt: int) -> torch.Tensor:
    """``[num_tiles, 4]`` int32 on ``meta``'s device: per tile (sequence ``b``, its first query
    token's row in the step, number of query tokens ``<= qt``, that token's position = its
    context length - 1), from the host lists ``meta.query_start_loc_cpu`` / ``seq_lens_cpu``;
    built once per step (``meta.backend_cache``)."""
    key = ("bi_query_tiles", qt)
    got = meta.backend_cache.get(key)
    if got is None:
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        rows = []
        for b, s in enumerate(lens):
            q0, q_len = qsl[b], qsl[b + 1] - qsl[b]
            for i in range(0, q_len, qt):
                rows.append((b, q0 + i, min(qt, q_len - i), s - q_len + i))
        got = torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(meta.block_tables.device)
        meta.backend_cache[key] = got
    return got


if HAS_TRITON:

    @triton.jit(do_not_specialize=["stride_bt"])
    def _query_tile_kernel(
        Q, KC, VC, BT, TILES, OUT,
        qk_scale,  # softmax scale x log2(e)
        stride_qt, stride_qh,
        stride_cs, stride_ch,
        stride_bt,
        stride_ot, stride_oh,
        GROUP, QT, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Program ``(tile, kv_head)``: rows ``r < QT * GROUP`` of the query block are token
        ``r // GROUP`` of the tile, head ``kv_head * GROUP + r % GROUP`` (tiles on the first grid
        axis: its limit is 2**31 - 1, the second's 65,535)."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.load(TILES + t * 4)
        row0 = tl.load(TILES + t * 4 + 1)
        n_q = tl.load(TILES + t * 4 + 2)
        pos0 = tl.load(TILES + t * 4 + 3)

        r = tl.arange(0, GROUP_PAD)
        qi = r // GROUP
        heads = kvh * GROUP + r % GROUP
        r_mask = (qi < n_q) & (r < QT * GROUP)
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        tok = (row0 + qi).to(tl.int64)
        q = tl.load(
            Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=r_mask[:, None] & d_mask[None, :], other=0.0,
        )
        ctx = pos0 + qi + 1  # each row's own context length, as a decode row's seq_len
        end = pos0 + n_q

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
        kv_off = kvh * stride_ch + d[None, :]
        bt_row = BT + b.to(tl.int64) * stride_bt
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            slot = blk * PAGE + offs_n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(KC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(offs_n[None, :] < ctx[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            OUT + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(OUT.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :],
        )


def tiled_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, qk_scale: float,
                    group_pad: int, d_pad: int, block_n: int, num_warps: int, precision: str) -> torch.Tensor:
    """Causal paged attention of a step with prefill tokens, each token's row bitwise what the
    one-split decode kernel gives it (see the module docstring).

    Args:
        q: ``[T, H, D]`` (last dim contiguous); ``k_cache``, ``v_cache``: ``[num_blocks,
            block_size, Hkv, D]`` contiguous, holding this step's K/V.
        meta: the step's :class:`rlserve.layers.attention.AttentionMetadata` (host lists read).
        qk_scale: softmax scale x log2(e).
        group_pad, d_pad, block_n, num_warps, precision: the decode kernel's ``GROUP_PAD``,
            ``D_PAD``, ``BLOCK_N``, warps and dot precision (they must be the same: the
            caller passes its own).

    Returns:
        ``[T, H, D]`` in ``q.dtype``.
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    qt = group_pad // G
    tiles = query_tiles(meta, qt)
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    bt = meta.block_tables
    _query_tile_kernel[(tiles.shape[0], Hkv)](
        q, k_cache, v_cache, bt, tiles, out,
        qk_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        bt.stride(0),
        out.stride(0), out.stride(1),
        GROUP=G, QT=qt, GROUP_PAD=group_pad, HEAD_DIM=D, D_PAD=d_pad,
        PAGE=meta.block_size, BLOCK_N=block_n, DOT_PRECISION=precision, num_warps=num_warps,
    )
    return out
