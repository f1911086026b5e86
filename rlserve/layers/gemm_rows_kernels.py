"""The Triton kernel behind :func:`rlserve.layers.gemv.linear` / :func:`~rlserve.layers.gemv.silu_mul_linear`
at 2..``RLSERVE_DECODE_GEMM_ROWS`` rows (imported on first use; :mod:`rlserve.layers.gemv` says when it runs
and how it rounds).

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
def _rows_input(X, rows, offs, mm, km, stride_x, K: tl.constexpr, PROLOGUE: tl.constexpr, dt: tl.constexpr):
    """``[BLOCK_M, BLOCK_K]`` of the GEMM's input at ``rows`` x ``offs`` in ``dt`` (masked entries 0).
    ``PROLOGUE == 2``: ``X`` row = ``[gate (K) | up (K)]``, ``silu(gate)`` rounded to ``dt``, times up,
    rounded (as ``SiluAndMul``); else the row as it is."""
    base = X + rows[:, None].to(tl.int64) * stride_x + offs[None, :]
    m = mm[:, None] & km[None, :]
    if PROLOGUE == 2:
        g = tl.load(base, mask=m, other=0.0).to(tl.float32)
        u = tl.load(base + K, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        x = (s * u).to(dt)
    else:
        x = tl.load(base, mask=m, other=0.0)
    return x


@triton.jit(do_not_specialize=["M"])  # one compile for every M of a row tile
def _gemm_rows_kernel(
    X, W, B, OUT, WS, CNT,
    M, N, stride_x, stride_o, stride_w,
    K: tl.constexpr, K_PER: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Program ``(n, s, m)``: output columns ``[n*BLOCK_N, (n+1)*BLOCK_N)`` of rows
    ``[m*BLOCK_M, (m+1)*BLOCK_M)`` (those below ``M``), over ``K`` columns ``[s*K_PER, (s+1)*K_PER)``
    (``K_PER`` a multiple of ``BLOCK_K``; ``SPLIT = cdiv(K, K_PER)``). ``out = x @ W.T (+ bias)``,
    ``W [N, K]``, ``OUT [M, N]`` (row stride ``stride_o``). ``SPLIT > 1``: ``WS`` float32
    ``[SPLIT, cdiv(M, BLOCK_M) * BLOCK_M, N]`` partials, ``CNT`` int32 tile counters (zero on entry,
    zero again on exit), see the module docstring. ``PDL``: wait for the kernel before (and let the
    next one launch) before anything is read or written."""
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
    k_lo = s * K_PER
    for k0 in tl.range(k_lo, k_lo + K_PER, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        km = offs < K
        w = tl.load(w_rows + offs[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        x = _rows_input(X, rows, offs, mm, km, stride_x, K, PROLOGUE, dt)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_ptr = OUT + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    om = mm[:, None] & nm[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr, acc.to(OUT.dtype.element_ty), mask=om)
    else:
        m_pad = tl.num_programs(2) * BLOCK_M
        ws = WS + (rows[:, None].to(tl.int64) * N + cols[None, :])
        tl.store(ws + s.to(tl.int64) * m_pad * N, acc, mask=om)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        tile = pm * tl.num_programs(0) + pn
        ticket = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last of the tile's splits: reduce in split order
            tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                tot += tl.load(ws + j * m_pad * N, mask=om, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(B + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr, tot.to(OUT.dtype.element_ty), mask=om)
            tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")
