"""Paged attention and KV-cache writes in Triton: the fast GPU backend (``"triton"``).

Three kernels, all reading the paged cache through the block table (layout and
metadata contract in :mod:`rlserve.layers.attention`):

- :func:`triton_write_kv_cache` -- scatter this step's K/V rows into their slots; one
  program per token, rows with ``slot < 0`` (CUDA-graph padding) are skipped. No host
  sync (the torch writer tests ``valid.all()`` on the host, which cannot be captured).
- decode (``max_query_len == 1``): *flash-decoding* (Dao et al., "Flash-Decoding for
  long-context inference", 2023; the split-KV scheme of vLLM's paged attention v2).
  Grid ``(num_kv_heads, B, num_splits)``: one program holds the ``G = heads / kv_heads``
  query heads that share a KV head (grouped-query packing, so each K/V tile is read once
  per group, not once per head), walks its share of the context in tiles of
  ``BLOCK_N`` tokens with an online softmax (Milakov & Gimelshein 2018), and writes a
  partial output and its log-sum-exp; a second kernel merges the splits. With one split
  the first kernel writes the output directly. Programs take the sequences longest
  context first (a permutation sorted once per step on the device and shared by every
  layer: longest-processing-time-first order, so a long context does not start in the last
  wave and leave the other SMs idle), and the KV heads of one sequence are neighbours in
  launch order (they read the same cache rows). Every per-step value (context lengths,
  block ids) is read from device tensors, and the grid depends only on the batch size
  and ``meta.max_seq_len``, so the kernel can be captured in a CUDA graph where the
  runner passes the static upper bound ``max_model_len`` as ``max_seq_len``.
- prefill / varlen (any ``max_query_len``): FlashAttention-2 style (Dao 2023) causal
  attention, grid ``(ceil(max_query_len / BLOCK_M), B, num_heads)``; query row ``i`` of
  sequence ``b`` sits at absolute position ``seq_len - query_len + i`` and sees keys
  ``0..position`` -- this covers plain prompts, prefix-cache hits and chunked prefill
  (context longer than the query) alike, since all K/V, the new tokens' included, are
  read from the cache after :func:`triton_write_kv_cache` stored them.

Numerics: ``q·k`` and ``p·v`` accumulate in float32; float32 inputs use IEEE float32
products (``input_precision="ieee"``, never TF32), so float32 results match the
reference :func:`rlserve.layers.attention.torch_paged_attention` to ~1e-6. bf16/fp16
round ``p`` to the input dtype before ``p·v``, as FlashAttention does.

On tensors that are not on a CUDA device the backend falls back to the torch reference,
unless Triton's interpreter is on (``TRITON_INTERPRET=1`` *before* this module is
imported), which runs the kernels on CPU with numpy -- what the CPU tests use.
"""

from __future__ import annotations

import math
import os

import torch

from rlserve.layers.attention import AttentionMetadata, torch_paged_attention

try:  # Triton is optional: CPU-only installs do not have it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

_LOG2E = 1.4426950408889634

# Tile sizes. Decode is bandwidth-bound: 64-token K/V tiles give each program enough bytes
# in flight; prefill tiles are the FlashAttention-2 defaults for head_dim <= 128 on sm80+.
# Defaults measured on an H200 (Triton 3.6, bf16, 1024-token contexts; numbers in
# benchmarks/results/decode_step-h200-2026-11-29.md): decode BLOCK_N=64 / 4 warps was the
# fastest of {32, 64, 128} x {4, 8 warps} for a Qwen3-0.6B layer (256 us at batch 256, 4.2
# TB/s of K/V) and a SmolLM2 layer (57 us); prefill BLOCK_M=128 / BLOCK_N=64 was the fastest
# of four tilings for 8 x 1024-token prompts (223 us). float32 (tests) uses smaller tiles.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
PREFILL_BLOCK_M = 128
PREFILL_BLOCK_N = 64
# Split-K planning: aim for this many programs per SM, never split below this many
# tokens per split, and never use more splits than this. Contexts of unequal length (every
# real batch) leave SMs idle at the end of a step unless there are a few programs per SM
# to balance over; RLSERVE_DECODE_PROGRAMS_PER_SM overrides it (A/B runs).
_PROGRAMS_PER_SM = int(os.environ.get("RLSERVE_DECODE_PROGRAMS_PER_SM", "4"))
# Longest context first (see the module docstring); RLSERVE_DECODE_LPT=0 keeps batch order.
_LONGEST_FIRST = os.environ.get("RLSERVE_DECODE_LPT", "1") != "0"
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 32


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def is_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA with triton importable, or
    any device in interpreter mode)."""
    if not HAS_TRITON:
        return False
    if interpreter_enabled():
        return True
    dev = torch.device(device) if device is not None else None
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: keep the split logic exercised on tiny inputs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def plan_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Number of KV splits for a decode batch (a pure function of its arguments, so a
    CUDA graph captured for a batch size keeps its plan).

    Splits only when ``num_seqs * num_kv_heads`` programs would leave SMs idle: the target
    is ``_PROGRAMS_PER_SM x SMs`` programs, with at least ``_MIN_TOKENS_PER_SPLIT`` tokens
    per split and at most ``_MAX_SPLITS`` splits.
    """
    base = max(1, num_seqs * num_kv_heads)
    want = math.ceil(_PROGRAMS_PER_SM * _num_sms(device) / base)
    by_len = math.ceil(max(1, max_seq_len) / _MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(want, by_len, _MAX_SPLITS)))


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        K, V, KC, VC, SLOT,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
        HEAD_DIM: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One program per token: copy its ``num_kv_heads * head_dim`` K and V values to
        ``cache[slot]`` (cache viewed as ``[num_slots, num_kv_heads * head_dim]``)."""
        t = tl.program_id(0)
        slot = tl.load(SLOT + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        h = offs // HEAD_DIM
        d = offs % HEAD_DIM
        # a padded token (slot < 0) writes nothing. Not ``(offs < N) & (slot >= 0)``: Triton 3.9's
        # interpreter gives a block & scalar of int1 an int32 mask, which its load refuses
        mask = offs < tl.where(slot >= 0, N, 0)
        t64 = t.to(tl.int64)
        k = tl.load(K + t64 * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t64 * stride_vt + h * stride_vh + d, mask=mask)
        dst = slot * stride_cs + offs
        tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=mask)

    # stride_bt (the block-table width) and NUM_SPLITS change from step to step outside CUDA
    # graphs: not specialised, so one compilation serves every step (see fused_kernels)
    @triton.jit(do_not_specialize=["stride_bt", "NUM_SPLITS"])
    def _decode_kernel(
        Q, KC, VC, BT, SEQ_LENS, ORDER, OUT, PART_O, PART_LSE,
        qk_scale,  # softmax scale x log2(e)
        stride_qt, stride_qh,
        stride_cs, stride_ch,  # cache: slot stride, kv-head stride (head_dim stride is 1)
        stride_bt,
        stride_ot, stride_oh,
        NUM_HEADS, GROUP, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ORDERED: tl.constexpr,
    ):
        """Program ``(kv_head, i, split)``: GROUP query heads of sequence ``b = ORDER[i]``
        (``i`` itself when not ``ORDERED``) x one split of its context."""
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        if ORDERED:
            b = tl.load(ORDER + b)
        split = tl.program_id(2)
        seq_len = tl.load(SEQ_LENS + b)
        # tokens per split, a multiple of BLOCK_N so tiles never straddle splits
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kvh * GROUP + g
        b64 = b.to(tl.int64)
        q = tl.load(
            Q + b64 * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
        kv_off = kvh * stride_ch + d[None, :]
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            blk = tl.load(BT + b64 * stride_bt + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            slot = blk * PAGE + offs_n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(KC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_mask = g_mask[:, None] & d_mask[None, :]
        if not SPLIT:
            tl.store(
                OUT + b64 * stride_ot + heads[:, None] * stride_oh + d[None, :],
                o.to(OUT.dtype.element_ty), mask=o_mask,
            )
        else:
            # partials: PART_O [B, H, NUM_SPLITS, D_PAD], PART_LSE [B, H, NUM_SPLITS] (log2 units)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            row = (b64 * NUM_HEADS + heads) * NUM_SPLITS + split
            tl.store(PART_O + row[:, None] * D_PAD + d[None, :], o, mask=o_mask)
            tl.store(PART_LSE + row, lse, mask=g_mask)

    @triton.jit(do_not_specialize=["NUM_SPLITS"])
    def _decode_reduce_kernel(
        PART_O, PART_LSE, OUT,
        stride_ot, stride_oh,
        NUM_HEADS, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        NUM_SPLITS, S_PAD: tl.constexpr,
    ):
        """Program ``(b, head)``: merge the splits, ``o = sum_s 2^(lse_s - M) o_s / sum_s
        2^(lse_s - M)``; a row whose splits are all empty (context 0, graph padding) gets 0."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_mask = s < NUM_SPLITS
        row0 = (b * NUM_HEADS + h) * NUM_SPLITS
        lse = tl.load(PART_LSE + row0 + s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_safe))
        o = tl.load(
            PART_O + (row0 + s)[:, None] * D_PAD + d[None, :],
            mask=s_mask[:, None] & (w > 0)[:, None] & (d < HEAD_DIM)[None, :], other=0.0,
        )
        den = tl.sum(w, 0)
        den = tl.where(den > 0, den, 1.0)
        out = tl.sum(o * w[:, None], 0) / den
        tl.store(OUT + b * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _prefill_tile(
        q, KC, VC, bt_row, kv_off, n0, end, q_pos, d_mask, m_i, l_i, acc, qk_scale, stride_cs,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One BLOCK_N-key step of the online softmax for a query tile (FlashAttention-2's
        inner loop). ``MASKED``: apply the causal / length masks (diagonal tiles only)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = offs_n < end
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            blk = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
            kv_mask = d_mask[None, :]
        slot = blk * PAGE + offs_n % PAGE
        k = tl.load(KC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            keep = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows with nothing visible yet (padding rows) keep m = -inf: avoid inf - inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["stride_bt"])
    def _prefill_kernel(
        Q, KC, VC, BT, SEQ_LENS, QSL, OUT,
        qk_scale,
        stride_qt, stride_qh,
        stride_cs, stride_ch,
        stride_bt,
        stride_ot, stride_oh,
        GROUP,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Program ``(m_tile, b, head)``: BLOCK_M query rows of one head of sequence b."""
        mt = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        kvh = h // GROUP
        q_start = tl.load(QSL + b)
        q_len = tl.load(QSL + b + 1) - q_start
        seq_len = tl.load(SEQ_LENS + b)
        ctx = seq_len - q_len  # tokens before this step's first query (cached prefix)

        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        d = tl.arange(0, D_PAD)
        d_mask = d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        )
        q_pos = ctx + offs_m
        # causal bound for this tile; a tile past the query's end does no work
        end = tl.minimum(seq_len, ctx + (mt + 1) * BLOCK_M)
        end = tl.where(mt * BLOCK_M < q_len, end, 0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_bt
        kv_off = kvh * stride_ch + d[None, :]
        # keys below the tile's first query position are visible to every row: no masks
        full_end = (ctx + mt * BLOCK_M) // BLOCK_N * BLOCK_N
        full_end = tl.where(mt * BLOCK_M < q_len, full_end, 0)
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, KC, VC, bt_row, kv_off, n0, end, q_pos, d_mask, m_i, l_i, acc, qk_scale, stride_cs,
                PAGE, BLOCK_N, False, DOT_PRECISION,
            )
        # the diagonal band: causal and length masks
        for n0 in range(full_end, end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, KC, VC, bt_row, kv_off, n0, end, q_pos, d_mask, m_i, l_i, acc, qk_scale, stride_cs,
                PAGE, BLOCK_N, True, DOT_PRECISION,
            )

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            OUT + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
            o.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
        )


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if not k_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim]")


def decode_order(meta: AttentionMetadata) -> torch.Tensor:
    """The decode batch's rows sorted by context length, longest first (``[B]`` int32 on the
    device; no host sync, so it can be captured in a CUDA graph). Computed once per step and
    kept in ``meta.backend_cache`` for the other layers."""
    order = meta.backend_cache.get("decode_order")
    if order is None:
        order = torch.argsort(meta.seq_lens, descending=True).to(torch.int32)
        meta.backend_cache["decode_order"] = order
    return order


def triton_write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter K/V rows into the paged cache (drop-in for ``write_kv_cache``, no host sync).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` any float dtype (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous;
            values are cast to the cache dtype.
        slot_mapping: ``[T]`` int64 flat slots; ``< 0`` rows are skipped.
    """
    if not (k.is_cuda or interpreter_enabled()):
        from rlserve.layers.attention import write_kv_cache

        return write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    T = k.shape[0]
    if T == 0:
        return
    _check_cache(k_cache, v_cache)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2]:
        k, v = k.contiguous(), v.contiguous()
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    n = Hkv * D
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        HEAD_DIM=D, N=n, BLOCK=triton.next_power_of_2(n), num_warps=4 if n >= 1024 else 1,
    )


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Paged causal grouped-query attention (drop-in for ``torch_paged_attention``).

    Args:
        q: ``[T, num_heads, head_dim]`` float32 / bf16 / fp16 (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
            already holding this step's K/V.
        meta: the step's metadata; only its tensors (``seq_lens``, ``query_start_loc``,
            ``block_tables``) and the ints ``max_query_len``, ``max_seq_len`` (an upper
            bound is fine), ``block_size`` are read -- never the CPU lists, so the decode
            path can be captured in a CUDA graph.
        scale: softmax scale.
        num_splits: force the decode split count (tests); default :func:`plan_num_splits`.

    Returns:
        ``[T, num_heads, head_dim]`` in ``q.dtype``.
    """
    if not (q.is_cuda or interpreter_enabled()):
        return torch_paged_attention(q, k_cache, v_cache, meta, scale)
    _check_cache(k_cache, v_cache)
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    if H % Hkv:
        raise ValueError(f"num_heads={H} is not a multiple of num_kv_heads={Hkv}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = H // Hkv
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    D_PAD = _pow2(D)
    page = meta.block_size
    qk_scale = float(scale) * _LOG2E
    prec = _dot_precision(q.dtype)
    bt = meta.block_tables
    if meta.max_query_len == 1:
        B = T
        S = num_splits or plan_num_splits(B, Hkv, meta.max_seq_len, q.device)
        if S > 1:
            part_o = torch.empty((B, H, S, D_PAD), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
        else:
            part_o = part_lse = out  # unused
        order = decode_order(meta) if _LONGEST_FIRST and B > 1 else None
        _decode_kernel[(Hkv, B, S)](
            q, k_cache, v_cache, bt, meta.seq_lens, order if order is not None else meta.seq_lens, out, part_o,
            part_lse,
            qk_scale,
            q.stride(0), q.stride(1),
            k_cache.stride(1), k_cache.stride(2),
            bt.stride(0),
            out.stride(0), out.stride(1),
            NUM_HEADS=H, GROUP=G, GROUP_PAD=_pow2(G), HEAD_DIM=D, D_PAD=D_PAD,
            PAGE=page, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=S, SPLIT=S > 1, DOT_PRECISION=prec,
            ORDERED=order is not None, num_warps=DECODE_NUM_WARPS,
        )
        if S > 1:
            _decode_reduce_kernel[(B, H)](
                part_o, part_lse, out, out.stride(0), out.stride(1),
                NUM_HEADS=H, HEAD_DIM=D, D_PAD=D_PAD, NUM_SPLITS=S, S_PAD=triton.next_power_of_2(S),
                num_warps=4,
            )
        return out
    B = meta.seq_lens.shape[0]
    block_m = PREFILL_BLOCK_M
    block_n = PREFILL_BLOCK_N
    if q.dtype == torch.float32:  # keep float32 tiles within registers / shared memory
        block_m = min(block_m, 64)
        block_n = min(block_n, 32 if D_PAD > 64 else 64)
    grid = (triton.cdiv(meta.max_query_len, block_m), B, H)
    _prefill_kernel[grid](
        q, k_cache, v_cache, bt, meta.seq_lens, meta.query_start_loc, out,
        qk_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        bt.stride(0),
        out.stride(0), out.stride(1),
        GROUP=G, HEAD_DIM=D, D_PAD=D_PAD,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=prec,
        num_warps=4 if D_PAD * block_m <= 64 * 64 else 8, num_stages=2,
    )
    return out


def register() -> bool:
    """Add ``"triton"`` to ``ATTENTION_BACKENDS`` (and its KV writer to
    ``KV_CACHE_WRITERS``). Returns False when Triton is not importable."""
    if not HAS_TRITON:
        return False
    from rlserve.layers import attention

    attention.ATTENTION_BACKENDS["triton"] = triton_paged_attention
    writers = getattr(attention, "KV_CACHE_WRITERS", None)
    if writers is not None:
        writers["triton"] = triton_write_kv_cache
    return True
