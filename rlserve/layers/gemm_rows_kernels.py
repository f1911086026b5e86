"""The Triton kernel behind :func:`rlserve.layers.gemv.linear` / :func:`~rlserve.layers.gemv.silu_mul_linear`
at 2..``RLSERVE_DECODE_GEMM_ROWS`` rows (imported on first use; :mod:`rlserve.layers.gemv` says when it runs
and how it rounds).

The prologues run only with ``RLSERVE_DECODE_GEMM_ROWS_FOLD=1`` (:func:`rlserve.layers.gemv.set_rows_fold`);
by default the norm / SiLU-and-mul are their own fused kernel and this one runs ``PROLOGUE == 0``: each
program redoes its ``K`` range of a prologue for its own column tile, in the MMA's operand layout where
every warp holds the whole input tile (``benchmarks/rows_sass.py``; BENCHMARKS.md D5).

``PROLOGUE == 1`` folds the decoder layer's add + RMSNorm in: ``y = W @ (w_norm * rmsnorm(x + r))`` is
``rstd * (W @ (w_norm * h))`` with ``h = x + r`` (``rstd`` a per-row scalar), so each program multiplies
``w_norm * h`` of its own ``K`` range, sums ``h^2`` over it on the side, and the ``rstd`` scaling waits
for the epilogue (after the split's reduction, which sums the ``h^2`` partials too). No program reads more
of ``x`` than its ``K`` range; programs of the first column tile store ``h`` (the next residual).
Rounding: ``h`` rounded to the model dtype (as the unfused add), ``w_norm * h`` rounded (the tensor-core
operand); the unfused path rounds ``h * rstd`` and then its product with ``w_norm`` instead, so in bf16 a
product may differ by one rounding (2^-9 relative) from the reference; in float32 only float32 rounding.

A small-batch decode step reads every weight once for a handful of rows: the GEMM is the weight
read, and cuBLAS at these shapes leaves bandwidth unused (Qwen3-8B's o_proj at 1.71 TB/s on an H100,
BENCHMARKS.md D2) and splits K into a second reduce kernel (72 a Qwen3-8B step). Here one kernel
streams ``W`` tile by tile (``BLOCK_N`` output columns x ``BLOCK_K``, software-pipelined), multiplies
the ``BLOCK_M`` rows on the tensor cores (``tl.dot``, float32 accumulation; ``input_precision="ieee"``
for float32 weights: no TF32), and, where ``K`` is split over ``SPLIT`` programs to put enough loads in
flight, reduces the split in the same launch: each program stores its float32 partial to a
workspace, takes a ticket on its tile's counter (``atomic_add``, acquire-release), and the program
that draws the last ticket sums the ``SPLIT`` partials in split order (a fixed order: the result does
not depend on which program came last), adds the bias, stores the output and resets the counter to 0
(so the counters are zero between launches: CUDA-graph replays need no memset).
"""

import triton
import triton.language as tl


@triton.jit
def _rows_input(X, R, NW, RES_OUT, rows, offs, mm, km, stride_x, stride_r, stride_ro, pn,
                K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, dt: tl.constexpr):
    """``([BLOCK_M, BLOCK_K] of the GEMM's input at rows x offs in dt, [BLOCK_M] float32 sum of h^2)``
    (masked entries 0). ``PROLOGUE == 2``: ``X`` row = ``[gate (K) | up (K)]``, ``silu(gate)`` rounded to
    ``dt``, times up, rounded (as ``SiluAndMul``). ``PROLOGUE == 1``: ``h = x (+ r)`` rounded to ``dt``
    (stored to ``RES_OUT`` by the first column tile's programs, ``pn == 0``), the input ``w_norm * h`` rounded, and the sum of ``h^2``
    over these columns (module docstring). Else the row as it is (sum 0)."""
    base = X + rows[:, None].to(tl.int64) * stride_x + offs[None, :]
    m = mm[:, None] & km[None, :]
    ss = tl.zeros([rows.shape[0]], dtype=tl.float32)
    if PROLOGUE == 2:
        g = tl.load(base, mask=m, other=0.0).to(tl.float32)
        u = tl.load(base + K, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        x = (s * u).to(dt)
    elif PROLOGUE == 1:
        h = tl.load(base, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + rows[:, None].to(tl.int64) * stride_r + offs[None, :], mask=m, other=0.0)
            hd = (h + r.to(tl.float32)).to(dt)
            tl.store(RES_OUT + rows[:, None].to(tl.int64) * stride_ro + offs[None, :], hd,
                     mask=m & ((offs[None, :] * 0 + pn) == 0))
            h = hd.to(tl.float32)
        ss = tl.sum(h * h, axis=1)
        # the norm weight as a [BLOCK_M, BLOCK_K] tile (rows broadcast): 16-byte vectors a thread, so it is
        # software-pipelined with the other tiles (a [BLOCK_K] load is 2 bytes a thread: no cp.async, an
        # L2 round trip and a CTA barrier every K step, on the loop's critical path)
        nw = tl.load(NW + (rows[:, None] * 0 + offs[None, :]), mask=m, other=0.0)
        x = (nw.to(tl.float32) * h).to(dt)
    else:
        x = tl.load(base, mask=m, other=0.0)
    return x, ss


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a row tile
def _gemm_rows_kernel(
    X, R, NW, W, B, OUT, RES_OUT, WS, WSS, CNT,
    M, N, stride_x, stride_r, stride_o, stride_ro, stride_w, eps,
    K: tl.constexpr, K_PER: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Program ``(n, s, m)``: output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)`` of rows
    ``[m*BLOCK_M, (m+1)*BLOCK_M)`` (those below ``M``), over ``K`` columns ``[s*K_PER, (s+1)*K_PER)``
    (``K_PER`` a multiple of ``BLOCK_K``; ``SPLIT = cdiv(K, K_PER)``). ``out = x @ W.T (+ bias)``,
    ``W [N, K]``, ``OUT [M, N]`` (row stride ``stride_o``); ``PROLOGUE`` 1 / 2: the folded RMSNorm /
    SiLU-and-mul (:func:`_rows_input`; 1: ``R`` the residual, ``NW [K]`` the norm weight, ``RES_OUT`` the
    next residual, ``eps`` the norm's). ``SPLIT > 1``: ``WS`` float32 ``[SPLIT, cdiv(M, BLOCK_M) *
    BLOCK_M, N]`` partials, ``WSS`` float32 ``[tiles, SPLIT, BLOCK_M]`` partial sums of ``h^2``
    (``PROLOGUE`` 1), ``CNT`` int32 tile counters (zero on entry, zero again on exit), see the module
    docstring. ``PDL``: wait for the kernel before (and let the next one launch) before anything is read
    or written."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = W.dtype.element_ty
    pn = tl.program_id(0)
    s = tl.program_id(1)
    pm = tl.program_id(2)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rows < M
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = cols < N
    w_rows = W + cols[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_lo = s * K_PER
    for k0 in tl.range(k_lo, k_lo + K_PER, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        km = offs < K
        w = tl.load(w_rows + offs[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        x, ss_k = _rows_input(X, R, NW, RES_OUT, rows, offs, mm, km, stride_x, stride_r, stride_ro, pn,
                              K, PROLOGUE, HAS_RES, dt)
        ss += ss_k
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_ptr = OUT + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    om = mm[:, None] & nm[None, :]
    if SPLIT == 1:
        if PROLOGUE == 1:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr, acc.to(OUT.dtype.element_ty), mask=om)
    else:
        m_pad = tl.num_programs(2) * BLOCK_M
        ws = WS + (rows[:, None].to(tl.int64) * N + cols[None, :])
        tl.store(ws + s.to(tl.int64) * m_pad * N, acc, mask=om)
        tile = pm * tl.num_programs(0) + pn
        wss = WSS + (tile * SPLIT) * BLOCK_M + tl.arange(0, BLOCK_M)
        if PROLOGUE == 1:
            tl.store(wss + s * BLOCK_M, ss)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last of the tile's splits: reduce in split order
            tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            ss_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                tot += tl.load(ws + j * m_pad * N, mask=om, other=0.0, cache_modifier=".cg")
                if PROLOGUE == 1:
                    ss_tot += tl.load(wss + j * BLOCK_M, cache_modifier=".cg")
            if PROLOGUE == 1:
                tot = tot * tl.rsqrt(ss_tot / K + eps)[:, None]
            if HAS_BIAS:
                tot += tl.load(B + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr, tot.to(OUT.dtype.element_ty), mask=om)
            tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")
