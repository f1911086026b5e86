"""The Triton kernels behind :mod:`rlserve.layers.fused_ops` (imported on first use, so that
importing the model code never imports Triton; see that module for what each kernel
computes and how it rounds).

Integer arguments that change from step to step (the sampler's chunking, which follows the
batch size) are marked ``do_not_specialize``, and pointers that may start at any offset of
a buffer ``do_not_specialize_on_alignment``: Triton otherwise compiles one variant per
"divisible by 16 / equal to 1 / other" class of each such argument, and the first process on
a machine paid those compilations inside its first timed workload (one H200, 2026-12-01:
17,171 tok/s against 24,218 for the next process). One compilation at startup now serves
every batch size."""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, RES_OUT,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    """Program ``t``: one row of ``N`` values (``BLOCK >= N``)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)  # rounded like x + r
        tl.store(RES_OUT + t * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    h = h * (tl.rsqrt(var + eps))
    h = h.to(X.dtype.element_ty).to(tl.float32)  # .to(input dtype) before the weight
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_o + offs, (w * h).to(OUT.dtype.element_ty), mask=mask)

@triton.jit
def _silu_mul_kernel(X, OUT, stride_x, stride_o, D, BLOCK: tl.constexpr):
    """Program ``(t, j)``: columns ``[j*BLOCK, (j+1)*BLOCK)`` of row ``t``."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + t * stride_o + offs, (s * u).to(OUT.dtype.element_ty), mask=mask)

@triton.jit
def _norm_rope_head(
    SRC, W, cos, sin, offs, partner, sign, d_mask, rot_mask, eps,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
):
    """One head: optional RMSNorm (float32, rounded, times the weight, rounded), then
    ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dims with every
    product and the sum rounded to the source dtype; float32 result."""
    dt = SRC.dtype.element_ty
    x = tl.load(SRC + offs, mask=d_mask, other=0.0).to(tl.float32)
    xp = tl.load(SRC + partner, mask=rot_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        var = tl.sum(x * x, axis=0) / HEAD_DIM
        inv = tl.rsqrt(var + eps)
        w = tl.load(W + offs, mask=d_mask, other=0.0).to(tl.float32)
        wp = tl.load(W + partner, mask=rot_mask, other=0.0).to(tl.float32)
        x = (w * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    a = (x * cos).to(dt).to(tl.float32)
    b = (xp * sin).to(dt).to(tl.float32)
    y = (a + sign * b).to(dt).to(tl.float32)
    return tl.where(rot_mask, y, x)

@triton.jit(do_not_specialize=["T"])
def _qkv_norm_rope_write_kernel(
    QKV, POS, COS, SIN, QW, KW, Q_OUT, KC, VC, SLOT,
    stride_t, stride_qo, stride_cs,
    NUM_HEADS, NUM_KV_HEADS, eps, T,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, QK_NORM: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """Program ``(i, j)``: tokens ``[i*TOKENS, (i+1)*TOKENS)`` (those below ``T``); query head
    ``j < NUM_HEADS`` -> ``Q_OUT``; otherwise KV head ``j - NUM_HEADS``: its k (normed,
    rotated) and v go to ``cache[slot]`` (skipped for ``slot < 0``). Several tokens per program
    on long (prefill) batches: one program per token and head was bound by the programs' own
    cost (an 8192-token prefill step: 114 us per layer, ~1 TB/s)."""
    j = tl.program_id(1)
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    rot_mask = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    for i in tl.static_range(TOKENS):
        t = tl.program_id(0).to(tl.int64) * TOKENS + i
        if t < T:
            pos = tl.load(POS + t).to(tl.int64)
            cos = tl.load(COS + pos * ROT + d, mask=rot_mask, other=1.0).to(Q_OUT.dtype.element_ty).to(tl.float32)
            sin = tl.load(SIN + pos * ROT + d, mask=rot_mask, other=0.0).to(Q_OUT.dtype.element_ty).to(tl.float32)
            row = QKV + t * stride_t
            if j < NUM_HEADS:
                y = _norm_rope_head(row + j * HEAD_DIM, QW, cos, sin, d, partner, sign, d_mask, rot_mask, eps,
                                    HEAD_DIM, QK_NORM)
                tl.store(Q_OUT + t * stride_qo + j * HEAD_DIM + d, y.to(Q_OUT.dtype.element_ty), mask=d_mask)
            else:
                kvh = j - NUM_HEADS
                slot = tl.load(SLOT + t).to(tl.int64)
                if slot >= 0:
                    k_src = row + (NUM_HEADS + kvh) * HEAD_DIM
                    y = _norm_rope_head(k_src, KW, cos, sin, d, partner, sign, d_mask, rot_mask, eps,
                                        HEAD_DIM, QK_NORM)
                    dst = slot * stride_cs + kvh * HEAD_DIM + d
                    tl.store(KC + dst, y.to(KC.dtype.element_ty), mask=d_mask)
                    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + d, mask=d_mask, other=0.0)
                    tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=d_mask)


@triton.jit
def _log(x, FAST: tl.constexpr):
    """Natural log: ``lg2.approx`` (~2^-22 relative error, a few instructions) when ``FAST``,
    else ``tl.log`` (an accurate software sequence; the interpreter has no libdevice)."""
    if FAST:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit(do_not_specialize=["CHUNK", "S"], do_not_specialize_on_alignment=["SEED", "ROW_OFF"])
def _sample_partial_kernel(
    LOGITS, stride_l, V, CHUNK, TEMP, SEED, ROW_OFF, PART_F, PART_I, S,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Program ``(b, c)``: vocabulary chunk ``[c*CHUNK, (c+1)*CHUNK)`` of row ``b`` (``CHUNK`` a
    multiple of ``BLOCK``). Keeps the running max and sum of ``exp`` of the raw logits (for
    their log-sum-exp) and the running argmax of ``logits / T + Gumbel`` (``T == 0``: of the
    logits themselves, no noise drawn). The Gumbel noise ``-log(-log(u))`` takes ``u`` from
    Philox keyed by the row's seed: one ``randint4x`` call at counter ``ROW_OFF[b] + v0 / 4 +
    j`` gives the four draws of the vocabulary entries ``v0 + 4j .. v0 + 4j + 3`` of the block
    starting at ``v0`` (a multiple of ``BLOCK``), so the noise of an entry does not depend on
    the chunking, and Philox runs once per four entries (``tl.rand`` ran it once per entry: its
    integer multiplies bounded this kernel, 158 us per call over the offline workload on an
    H200, 2026-12-02). Writes ``PART_F[b, c] = (max, sum, best score)`` and ``PART_I[b, c] =
    best index``."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = LOGITS + b.to(tl.int64) * stride_l
    t = tl.load(TEMP + b)
    seed = tl.load(SEED + b)
    off0 = tl.load(ROW_OFF + b)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_i = 0
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        x = tl.load(row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(x - m_new), 0.0), 0)
        m = m_new
        if greedy:
            score = x
        else:
            ctr = (off0 + start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
            r0, r1, r2, r3 = tl.randint4x(seed, ctr)
            r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
            u = tl.random.uint_to_uniform_float(r)
            score = x * inv_t - _log(-_log(u, FAST_LOG), FAST_LOG)
        score = tl.where(mask, score, -float("inf"))
        blk = tl.max(score, 0)
        take = blk > best
        best_i = tl.where(take, start + tl.argmax(score, 0), best_i)
        best = tl.where(take, blk, best)
    base = (b * S + c) * 3
    tl.store(PART_F + base, m)
    tl.store(PART_F + base + 1, s)
    tl.store(PART_F + base + 2, best)
    tl.store(PART_I + b * S + c, best_i)


@triton.jit(do_not_specialize=["S"])
def _sample_reduce_kernel(LOGITS, stride_l, PART_F, PART_I, S, OUT_TOK, OUT_LP, S_PAD: tl.constexpr):
    """Program ``b``: merge row ``b``'s chunks -- log-sum-exp of the raw logits, the best
    score's index (the lowest chunk on ties, so the lowest vocabulary index) -- and write the
    token and its raw log-probability ``logit - lse``."""
    b = tl.program_id(0)
    j = tl.arange(0, S_PAD)
    mask = j < S
    base = (b * S + j) * 3
    m = tl.load(PART_F + base, mask=mask, other=-float("inf"))
    s = tl.load(PART_F + base + 1, mask=mask, other=0.0)
    best = tl.load(PART_F + base + 2, mask=mask, other=-float("inf"))
    idx = tl.load(PART_I + b * S + j, mask=mask, other=0)
    M = tl.max(m, 0)
    lse = M + tl.log(tl.sum(tl.where(mask, s * tl.exp(m - M), 0.0), 0))
    tok = tl.sum(tl.where(j == tl.argmax(best, 0), idx, 0), 0)
    x_tok = tl.load(LOGITS + b.to(tl.int64) * stride_l + tok).to(tl.float32)
    tl.store(OUT_TOK + b, tok.to(tl.int64))
    tl.store(OUT_LP + b, x_tok - lse)
