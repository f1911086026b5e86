"""Batched LoRA kernels (Triton), punica-style: every row of a step under its own adapter, one
launch pair per layer whatever the mix of adapters.

Adapters live in per-layer slot buffers (:class:`rlserve.lora.layers.LoRALinear`, ``slots``
adapters at most, ``--max-loras``; ranks zero-padded to ``max_rank`` = ``--max-lora-rank``):

    A_stack [slots, S * max_rank, in]    slice s's A_s [r, in] in rows s * max_rank ...
    B_stack [slots, out, max_rank]       slice s's B'_s [size_s, r] in rows offset_s ... (scaling folded)

The step's rows are grouped by slot (SGMV's segments; decode rows of one adapter share its
weight reads, which is what a per-row BGMV would not): ``rows [T]`` int32, row indices sorted
by slot; ``seg_start [G + 1]`` int32, segment g's rows are ``rows[seg_start[g] : seg_start[g+1]]``;
``seg_slot [G]`` int32, its slot (-1: nothing to do, e.g. CUDA-graph padding). Base-model rows
are in no segment. Every launch's grid is ``(G, cdiv(max_rows, BLOCK_M), ...)``: with static
buffers and ``max_rows`` = the graph's batch size it is fixed, so a CUDA graph captures it
(programs past their segment's end return at once).

- :func:`lora_shrink`: ``t[:, rows, :]`` = partial sums of ``x[rows] @ A_stack[slot]^T`` (float32
  ``[split, T, S * max_rank]``): split over ``in`` into ``split`` parts when the grid alone would
  leave the GPU idle (decode), each part stored in its own plane: no zero-fill launch, no atomics
  (session 15's version zeroed ``t`` in a launch of its own and added the parts atomically: three
  launches per layer instead of two, and float32 sums in a run-dependent order);
- :func:`lora_expand`: ``y[rows, offset_s : offset_s + size_s] += (sum of t's planes)[rows, s-th rank
  block] @ B_stack[slot, offset_s : ...]^T``, slice by slice (no block-diagonal zeros are multiplied).

All slices of a packed layer (q/k/v, gate/up) share one shrink and one expand launch, and one
step's segments serve every layer: two launches per LoRA-capable linear per step, whatever the
mix of adapters (vLLM's punica ``lora_shrink`` / ``lora_expand`` with stacked slices do the same
work in as many launches).

float32 operands use IEEE products (``input_precision="ieee"``, not TF32), so a float32 model
matches a float32 reference to rounding; bfloat16 / float16 operands accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows per program; tl.dot needs >= 16
BLOCK_M = 16
#: at most this many slices (packed matrices) per layer: q/k/v
MAX_SLICES = 3


@triton.jit
def _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, BLOCK_M: tl.constexpr):
    """This program's segment (grid axis 0) and row tile (axis 1): ``(slot, idle, rows [BLOCK_M]
    int64, row mask)``; ``idle``: an empty segment (slot -1) or a tile past its end."""
    g = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + g)
    end = tl.load(seg_start_ptr + g + 1)
    m0 = tl.load(seg_start_ptr + g) + tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, (slot < 0) | (m0 >= end), rows, m_mask


# Per-step arguments, unspecialised so that one compilation serves every step (an uncompiled key in the middle
# of serving stalls every stream for the compile, BENCHMARKS.md H25): ``stride_ts`` (T x S x max_rank: divisible
# by 16 or not with T), the expand's ``n_split`` (1 or more with the step's segments); the segment tensors are
# per-step uploads read a scalar (or BLOCK_M row ids at a runtime offset) per program, so their 16-byte alignment
# buys nothing. What it costs: the ``t`` plane offset ``p * stride_ts`` is no longer known to be 16-byte aligned,
# so a program's [BLOCK_M, BLOCK_R] float32 tile of ``t`` is stored / read without 128-bit vectors -- a few
# hundred bytes against its K (shrink) or N (expand) columns of weights; not measured (no GPU in session 22)
_SEGMENTS = ["rows_ptr", "seg_start_ptr", "seg_slot_ptr"]


@triton.jit(do_not_specialize=["stride_ts"], do_not_specialize_on_alignment=_SEGMENTS)
def _shrink_kernel(x_ptr, a_ptr, t_ptr, rows_ptr, seg_start_ptr, seg_slot_ptr,
                   K, R, stride_xm, stride_as, stride_ar, stride_ts, stride_tm, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   ATOMIC: tl.constexpr, IEEE: tl.constexpr):
    slot, idle, rows, m_mask = _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, BLOCK_M)
    if idle:
        return
    pid_rk = tl.program_id(2)
    n_r = tl.cdiv(R, BLOCK_R)
    pid_r = pid_rk % n_r
    pid_k = pid_rk // n_r
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0)
        if IEEE:
            acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(at))
    if ATOMIC:  # session 15's form (one zeroed plane), kept for benchmarks/lora_kernels.py's A/B
        tl.atomic_add(t_ptr + rows[:, None] * stride_tm + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])
    else:
        t_ptrs = t_ptr + pid_k.to(tl.int64) * stride_ts + rows[:, None] * stride_tm + offs_r[None, :]
        tl.store(t_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["n_split", "stride_ts"], do_not_specialize_on_alignment=_SEGMENTS)
def _expand_kernel(t_ptr, b_ptr, y_ptr, rows_ptr, seg_start_ptr, seg_slot_ptr,
                   N, MAXR, off1, off2, n_split, stride_ts, stride_tm, stride_bs, stride_bn, stride_ym,
                   NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    slot, idle, rows, m_mask = _segment_rows(rows_ptr, seg_start_ptr, seg_slot_ptr, BLOCK_M)
    if idle:
        return
    n0 = tl.program_id(2) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        lo = 0 if s == 0 else (off1 if s == 1 else off2)
        hi = N if s == NUM_SLICES - 1 else (off1 if s == 0 else off2)
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            cols = n_mask & (offs_n >= lo) & (offs_n < hi)
            for r0 in range(0, MAXR, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < MAXR
                t_ptrs = t_ptr + rows[:, None] * stride_tm + (s * MAXR + offs_r)[None, :]
                t_mask = m_mask[:, None] & r_mask[None, :]
                tt = tl.load(t_ptrs, mask=t_mask, other=0.0)
                for p in range(1, n_split):  # the shrink's split-K planes, summed in a fixed order
                    tt += tl.load(t_ptrs + p * stride_ts, mask=t_mask, other=0.0)
                bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :],
                             mask=cols[:, None] & r_mask[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(tt.to(bt.dtype), tl.trans(bt), input_precision="ieee")
                else:
                    acc += tl.dot(tt.to(bt.dtype), tl.trans(bt))
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, rows: torch.Tensor, seg_start: torch.Tensor,
                seg_slot: torch.Tensor, max_rows: int, split: int | None = None,
                atomic: bool = False) -> torch.Tensor:
    """``t [split, T, R]`` float32 whose planes sum to ``x[i] @ A_stack[slot(i)]^T`` for every row
    ``i`` in a segment (rows in no segment are left unwritten: :func:`lora_expand` never reads
    them). ``split`` (>= 1) is chosen here: the reduction over ``K`` is cut into that many parts
    when segments x row tiles x rank tiles are fewer than the GPU's SMs (decode), part ``p`` stored
    in plane ``p``.

    Args:
        x: ``[T, K]`` the layer's input (row stride free, last dim contiguous).
        a_stack: ``[slots, R, K]`` contiguous, ``x``'s dtype.
        rows / seg_start / seg_slot: the step's segments (module docstring), int32, ``x``'s device.
        max_rows: an upper bound of any segment's row count (the grid's second dimension).
        split: cut the reduction into this many parts (at most, see above) instead of the
            SM-count rule (tests: the interpreter has no SMs).
        atomic: session 15's form instead, for an A/B (``benchmarks/lora_kernels.py``): ``t [1,
            T, R]`` zero-filled by a launch of its own, the parts added into it atomically.
    """
    T, K = x.shape
    R = a_stack.shape[1]
    G = seg_slot.shape[0]
    block_r = _pow2(R, 16, 64)
    block_k = 64 if K >= 64 else _pow2(K, 16, 64)
    n_m = triton.cdiv(max(1, max_rows), BLOCK_M)
    n_r = triton.cdiv(R, block_r)
    # split the reduction when segments x row tiles x rank tiles leave most SMs idle (decode)
    if split is None:
        split = 1
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            while G * n_m * n_r * split < sms and K // (split * 2) >= 256:
                split *= 2
    k_per = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_per)  # no empty part
    t = (torch.zeros if atomic else torch.empty)((1 if atomic else split, T, R), dtype=torch.float32, device=x.device)
    _shrink_kernel[(G, n_m, n_r * split)](
        x, a_stack, t, rows, seg_start, seg_slot, K, R, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        t.stride(0), t.stride(1), k_per, BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
        ATOMIC=atomic and split > 1, IEEE=x.dtype == torch.float32)
    return t


def lora_expand(t: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor, slice_offsets: tuple[int, ...],
                rows: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor, max_rows: int) -> torch.Tensor:
    """``y[i, offset_s : offset_s + size_s] += u[i, s * max_rank : (s + 1) * max_rank] @
    B_stack[slot(i), offset_s : ..., :]^T`` for every row ``i`` in a segment, ``u = t.sum(0)`` (the
    planes added in order inside the kernel); in place, returns ``y``.

    Args:
        t: ``[split, T, S * max_rank]`` float32 (:func:`lora_shrink`).
        b_stack: ``[slots, N, max_rank]`` contiguous.
        y: ``[T, N]`` the base layer's output (last dim contiguous).
        slice_offsets: the slices' first output columns (``(0,)``, ``(0, q, q + k)``, ...).
    """
    N, maxr = b_stack.shape[1], b_stack.shape[2]
    S = len(slice_offsets)
    if S > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} slices per layer, got {S}")
    off1 = slice_offsets[1] if S > 1 else N
    off2 = slice_offsets[2] if S > 2 else N
    G = seg_slot.shape[0]
    block_n = 64 if N >= 64 else _pow2(N, 16, 64)
    block_r = _pow2(maxr, 16, 64)
    n_m = triton.cdiv(max(1, max_rows), BLOCK_M)
    _expand_kernel[(G, n_m, triton.cdiv(N, block_n))](
        t, b_stack, y, rows, seg_start, seg_slot, N, maxr, off1, off2, t.shape[0], t.stride(0), t.stride(1),
        b_stack.stride(0),
        b_stack.stride(1), y.stride(0), NUM_SLICES=S, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
        IEEE=b_stack.dtype == torch.float32)
    return y
