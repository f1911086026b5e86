"""The Triton kernel behind :mod:`rlserve.layers.gemv` (imported on first use; see that module for
what it computes, how it rounds and when it runs)."""

import triton
import triton.language as tl


@triton.jit
def _prologue_chunk(X, R, NW, offs, m, rstd, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                    dt: tl.constexpr):
    """Columns ``offs`` of the GEMV's input vector, float32, rounded as the unfused ops round."""
    if PROLOGUE == 1:  # RMSNorm((x + r)) * w, HF order: sum rounded, norm rounded, product rounded
        h = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            h = (h + tl.load(R + offs, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        h = (h * rstd).to(dt).to(tl.float32)
        x = (tl.load(NW + offs, mask=m, other=0.0).to(tl.float32) * h).to(dt).to(tl.float32)
    elif PROLOGUE == 2:  # silu(gate) rounded, times up, rounded; X = [gate (K) | up (K)]
        g = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(X + K + offs, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        x = (s * u).to(dt).to(tl.float32)
    else:
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit
def _residual_sum(X, R, RES_OUT, offs, m, pid, HAS_RES: tl.constexpr, dt: tl.constexpr):
    """``x + r`` at ``offs`` rounded to the model dtype (``x`` without a residual), as float32;
    program 0 stores it to ``RES_OUT`` (the next residual)."""
    h = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        h = (h + tl.load(R + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
        tl.store(RES_OUT + offs, h, mask=m & ((offs * 0 + pid) == 0))  # program 0 only
        h = h.to(tl.float32)
    return h


@triton.jit
def _gemv_kernel(
    X, R, NW, W, B, OUT, RES_OUT,
    N, stride_w, eps,
    K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_ONE_CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Program ``p``: output rows ``[p*BLOCK_N, (p+1)*BLOCK_N)`` of ``W [N, K] @ x``, the whole
    ``K`` in ``cdiv(K, BLOCK_K)`` unrolled chunks (``K`` is a compile-time constant); float32
    accumulation. The first chunk's weights are loaded before anything else, so their HBM
    latency overlaps the prologue (``PROLOGUE == 1``: every program reduces ``sum((x + r)^2)``
    over ``K`` itself, from L2 -- in registers when ``K`` is one chunk, else in a first pass;
    program 0 also stores ``x + r`` to ``RES_OUT``).

    ``PDL`` (launched with programmatic dependent launch, sm_90+): the weights are read before
    ``gdc_wait`` (nothing writes them during a step), every input after it, nothing is written
    before it; ``gdc_launch_dependents`` right after the first weight load lets the next kernel
    (the next GEMV, also ``PDL``) start loading its weights while this one runs."""
    dt = X.dtype.element_ty  # the model dtype (OUT may be float32: logits)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_w
    offs0 = tl.arange(0, BLOCK_K)
    w0 = tl.load(w_rows + offs0[None, :], mask=rmask[:, None] & (offs0 < K)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs (x, r) are complete and visible
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if NORM_ONE_CHUNK:  # PROLOGUE == 1 and K <= BLOCK_K: x + r read once, kept in registers
        m0 = offs0 < K
        h = _residual_sum(X, R, RES_OUT, offs0, m0, pid, HAS_RES, dt)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        h = (h * rstd).to(dt).to(tl.float32)
        x = (tl.load(NW + offs0, mask=m0, other=0.0).to(tl.float32) * h).to(dt).to(tl.float32)
        acc += tl.sum(w0.to(tl.float32) * x[None, :], axis=1)
    else:
        rstd = 0.0
        if PROLOGUE == 1:  # several chunks: sum((x + r)^2) first, then the chunks again
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                h = _residual_sum(X, R, RES_OUT, offs, offs < K, pid, HAS_RES, dt)
                ss += h * h
            rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            m = offs < K
            if k0 == 0:
                w = w0
            else:
                w = tl.load(w_rows + offs[None, :], mask=rmask[:, None] & m[None, :], other=0.0)
            x = _prologue_chunk(X, R, NW, offs, m, rstd, K, PROLOGUE, HAS_RES, dt)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(OUT + rows, acc.to(OUT.dtype.element_ty), mask=rmask)
