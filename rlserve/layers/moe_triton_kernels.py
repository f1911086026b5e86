"""The fused-MoE Triton kernel (vLLM's design; the launch, permutation and the tile
configurations are in :mod:`rlserve.layers.moe_kernels`). Imported on first use only.

The integer arguments that follow the batch (the pair count, the padded length) are in each
kernel's ``do_not_specialize``: Triton would otherwise compile a kernel again for each class of
``(value == 1, value % 16 == 0)``, so an odd token count after the warm-up's even ones compiled
in the middle of serving (BENCHMARKS.md, MoE, session 14 window 2). They only bound loops and
masks, so the specialization bought nothing. What is left to compile is one kernel per tile
configuration, GEMM (gate/up or down) and dtype: :func:`rlserve.layers.moe_kernels.warm_up`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["EM", "num_valid"])
def fused_moe_kernel(
    A, B, C, A_SCALE, B_SCALE, TOPK_W, SORTED_IDS, EXPERT_IDS, NUM_POST,
    N, K, EM, num_valid,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_se, stride_sn,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_SCALED: tl.constexpr, B_SCALED: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``C[pair, n] = sum_k A[pair // TOP_K, k] * B[e, n, k]`` for the pairs of one sorted block
    (expert ``e``) and one ``BLOCK_N`` tile of output columns; times ``A_SCALE[pair // TOP_K]``,
    ``B_SCALE[e, n]``, ``TOPK_W[pair]`` when asked; float32 accumulator."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    if pid_m * BLOCK_M >= tl.load(NUM_POST):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SORTED_IDS + offs_m).to(tl.int64)
    mask_m = pair < num_valid
    e = tl.load(EXPERT_IDS + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    row = pair // TOP_K
    a_ptrs = A + row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + e * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if A_SCALED:
        acc = acc * tl.load(A_SCALE + row, mask=mask_m, other=0.0)[:, None]
    if B_SCALED:
        acc = acc * tl.load(B_SCALE + e * stride_se + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(TOPK_W + pair, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["N", "P"])
def moe_align_counts_kernel(
    IDS, CURSOR, OFFS, EXPERT_IDS, NUM_POST, SORTED_IDS, N, E, P,
    E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, MB_CHUNK: tl.constexpr,
):
    """Program ``pid`` of ``ceil(P / BLOCK_M / MB_CHUNK)``: per-expert counts of the ``N`` pair ids
    (``tl.histogram``; ``E_PAD >= E + 1`` bins, masked lanes land in the last one; every program
    counts them all, the ids are read from L2 after the first), each padded to a multiple of
    ``BLOCK_M``; program 0 writes ``CURSOR[e]`` (padded start of expert ``e``'s run), ``OFFS[e]``
    (unpadded end) and ``NUM_POST`` (padded total); each program writes ``EXPERT_IDS[b]`` for its
    ``MB_CHUNK`` blocks and fills their ``MB_CHUNK * BLOCK_M`` entries of ``SORTED_IDS[:P]`` with
    ``N`` (padding). One program did it all before: 9.75 us a launch at decode sizes on the H100,
    2% of the 48-layer offline workload (BENCHMARKS.md, MoE), its loops serial."""
    pid = tl.program_id(0)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(IDS + offs, mask=offs < N, other=E_PAD - 1).to(tl.int32)
        counts += tl.histogram(ids, E_PAD)
    e = tl.arange(0, E_PAD)
    counts = tl.where(e < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    if pid == 0:
        tl.store(CURSOR + e, ends - padded, mask=e < E)
        tl.store(OFFS + e, tl.cumsum(counts, 0), mask=e < E)
        tl.store(NUM_POST, tl.sum(padded, 0))
    b = pid * MB_CHUNK + tl.arange(0, MB_CHUNK)
    past = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < E)
    expert = tl.minimum(tl.sum(past.to(tl.int32), 1), E - 1)
    tl.store(EXPERT_IDS + b, expert, mask=b < P // BLOCK_M)
    lo = pid * MB_CHUNK * BLOCK_M
    hi = tl.minimum(lo + MB_CHUNK * BLOCK_M, P)
    for p0 in range(lo, hi, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(SORTED_IDS + p, tl.zeros((CHUNK,), dtype=tl.int32) + N, mask=p < hi)


@triton.jit(do_not_specialize=["N", "P"])
def moe_align_scatter_kernel(IDS, CURSOR, SORTED_IDS, N, P, BLOCK: tl.constexpr):
    """Each pair takes the next slot of its expert's run (``atomic_add`` on ``CURSOR``): the
    order within an expert's run is arbitrary (each row's GEMM result does not depend on it).
    Slots outside ``[0, P)`` are not written: never with real counts, but the warm-up's recording
    pass (:func:`rlserve.layers.moe_kernels.warm_up`) may launch this kernel after skipping the
    counts kernel, with ``CURSOR`` uninitialized."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ids = tl.load(IDS + offs, mask=mask, other=0)
    pos = tl.atomic_add(CURSOR + ids, 1, mask=mask)
    tl.store(SORTED_IDS + pos, offs.to(tl.int32), mask=mask & (pos >= 0) & (pos < P))


@triton.jit
def topk_softmax_kernel(LOGITS, W, IDS, E, stride_l, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        RENORM: tl.constexpr):
    """One token per program: softmax of its ``E`` router logits in float32, the ``K`` largest
    probabilities (largest first; ties to the lower expert id), optionally renormalized to sum 1;
    weights stored in ``W``'s dtype, ids as int64."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    x = tl.load(LOGITS + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(e < E, p / tl.sum(p, 0), -1.0)
    kk = tl.arange(0, K_PAD)
    wv = tl.zeros((K_PAD,), dtype=tl.float32)
    iv = tl.zeros((K_PAD,), dtype=tl.int64)
    for k in tl.static_range(K):
        best = tl.max(p, 0)
        idx = tl.argmax(p, 0, tie_break_left=True)
        wv = tl.where(kk == k, best, wv)
        iv = tl.where(kk == k, idx.to(tl.int64), iv)
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        wv = wv / tl.sum(wv, 0)
    tl.store(W + t * K + kk, wv.to(W.dtype.element_ty), mask=kk < K)
    tl.store(IDS + t * K + kk, iv, mask=kk < K)
