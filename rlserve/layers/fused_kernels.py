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

from rlserve.layers.triton_attention_kernels import _to_cache


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

@triton.jit
def _rope_lanes(HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr):
    """The lane vectors of one head, shared by both ``_qkv_norm_rope_write`` kernels: ``d``
    (``[D_PAD]`` int32 dims), ``d_mask`` (``d < HEAD_DIM``), ``rot_mask`` (``d < ROT``, the
    rotated dims), ``partner`` (the dim ``rotate_half`` reads for ``d``: ``d + ROT/2`` in the
    first half, ``d - ROT/2`` in the second) and ``sign`` (float32 -1 / +1: ``rotate_half``'s
    ``(-x2, x1)``)."""
    half: tl.constexpr = ROT // 2
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    rot_mask = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    return d, d_mask, rot_mask, partner, sign

@triton.jit
def _rope_cos_sin(COS, SIN, pos, d, rot_mask, ROT: tl.constexpr, dt: tl.constexpr):
    """Row ``pos`` (int64) of the ``[max_position, ROT]`` float32 cos / sin caches, rounded to
    ``dt`` (the activations' dtype, as ``RotaryEmbedding`` casts them) and back to float32;
    lanes past ``ROT`` read cos 1 and sin 0."""
    cos = tl.load(COS + pos * ROT + d, mask=rot_mask, other=1.0).to(dt).to(tl.float32)
    sin = tl.load(SIN + pos * ROT + d, mask=rot_mask, other=0.0).to(dt).to(tl.float32)
    return cos, sin

# The qkv kernels' per-step pointers: positions and slots (whole-step tensors, or views at an offset of a
# static buffer), and the scales that alias the slots without an fp8 cache. Each program loads one value (TOKENS
# of them) of each: their 16-byte alignment buys nothing, and a view at another alignment would compile another
# variant in the middle of serving. The per-program constexprs (TOKENS, HEADS, PDL) follow T: the warm-up runs
# one forward per launch class (fused_ops.qkv_warm_token_counts)
_QKV_PER_STEP = ["POS", "SLOT", "K_SCALE", "V_SCALE"]


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=_QKV_PER_STEP)
def _qkv_norm_rope_write_kernel(
    QKV, POS, COS, SIN, QW, KW, Q_OUT, KC, VC, SLOT, K_SCALE, V_SCALE,
    stride_t, stride_qo, stride_cs,
    NUM_HEADS, NUM_KV_HEADS, eps, T,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, QK_NORM: tl.constexpr,
    TOKENS: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(i, j)``: tokens ``[i*TOKENS, (i+1)*TOKENS)`` (those below ``T``); query head
    ``j < NUM_HEADS`` -> ``Q_OUT``; otherwise KV head ``j - NUM_HEADS``: its k (normed,
    rotated) and v go to ``cache[slot]`` (skipped for ``slot < 0``). Several tokens per program
    on long (prefill) batches: one program per token and head was bound by the programs' own
    cost (an 8192-token prefill step: 114 us per layer, ~1 TB/s). ``PDL``: launched with
    programmatic dependent launch (:mod:`rlserve.layers.pdl`): wait for the kernel before, then
    let the next one launch; nothing is read before the wait."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(1)
    d, d_mask, rot_mask, partner, sign = _rope_lanes(HEAD_DIM, D_PAD, ROT)
    for i in tl.static_range(TOKENS):
        t = tl.program_id(0).to(tl.int64) * TOKENS + i
        if t < T:
            pos = tl.load(POS + t).to(tl.int64)
            cos, sin = _rope_cos_sin(COS, SIN, pos, d, rot_mask, ROT, Q_OUT.dtype.element_ty)
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
                    tl.store(KC + dst, _to_cache(y, K_SCALE, FP8_MAX, KC.dtype.element_ty), mask=d_mask)
                    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + d, mask=d_mask, other=0.0)
                    tl.store(VC + dst, _to_cache(v, V_SCALE, FP8_MAX, VC.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["T"], do_not_specialize_on_alignment=_QKV_PER_STEP)
def _qkv_norm_rope_write_heads_kernel(
    QKV, POS, COS, SIN, QW, KW, Q_OUT, KC, VC, SLOT, K_SCALE, V_SCALE,
    stride_t, stride_qo, stride_cs,
    NUM_HEADS, NUM_KV_HEADS, eps, T,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, QK_NORM: tl.constexpr,
    HEADS: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(t, g)``: heads ``[g*HEADS, (g+1)*HEADS)`` of token ``t``, counting the
    ``NUM_HEADS`` query heads first and the ``NUM_KV_HEADS`` key heads after them (their order
    in ``QKV``); query heads go to ``Q_OUT``, key heads (normed, rotated) and the matching value
    heads to ``cache[slot]`` (skipped for ``slot < 0``). Each head goes through
    :func:`_norm_rope_head` exactly as in ``_qkv_norm_rope_write_kernel`` (same vectors, same
    reductions: bit-identical results); which heads exist, which are queries and whether the
    slot is valid are masks, not branches, so the heads' loads are independent. Decode batches:
    one program per token and head ran ~10,000 one-warp programs per Qwen3-8B layer at batch
    256 (8.2 us per call on an H200, 2026-12-02), bound by each program's dependent loads.
    ``PDL``: as ``_qkv_norm_rope_write_kernel``'s."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    d, d_mask, rot_mask, partner, sign = _rope_lanes(HEAD_DIM, D_PAD, ROT)
    pos = tl.load(POS + t).to(tl.int64)
    cos, sin = _rope_cos_sin(COS, SIN, pos, d, rot_mask, ROT, Q_OUT.dtype.element_ty)
    row = QKV + t * stride_t
    slot = tl.load(SLOT + t).to(tl.int64)
    kv_dst = slot * stride_cs + d
    zero = tl.zeros([D_PAD], dtype=tl.int32)  # per-head conditions as vectors (masks)
    slot_ok = (zero + slot) >= 0
    for i in tl.static_range(HEADS):
        h = zero + (tl.program_id(1) * HEADS + i)
        ok = h < NUM_HEADS + NUM_KV_HEADS
        is_q = h < NUM_HEADS
        y = _norm_rope_head(row + h * HEAD_DIM, tl.where(is_q, QW, KW), cos, sin, d, partner, sign, d_mask & ok,
                            rot_mask & ok, eps, HEAD_DIM, QK_NORM)
        tl.store(Q_OUT + t * stride_qo + h * HEAD_DIM + d, y.to(Q_OUT.dtype.element_ty), mask=d_mask & ok & is_q)
        kv = d_mask & ok & (h >= NUM_HEADS) & slot_ok
        dst = kv_dst + (h - NUM_HEADS) * HEAD_DIM
        tl.store(KC + dst, _to_cache(y, K_SCALE, FP8_MAX, KC.dtype.element_ty), mask=kv)
        # value head kvh sits at (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM = (h + NUM_KV_HEADS) * HEAD_DIM
        v = tl.load(row + (h + NUM_KV_HEADS) * HEAD_DIM + d, mask=kv, other=0.0)
        tl.store(VC + dst, _to_cache(v, V_SCALE, FP8_MAX, VC.dtype.element_ty), mask=kv)


@triton.jit
def _log(x, FAST: tl.constexpr):
    """Natural log: ``lg2.approx`` (~2^-22 relative error, a few instructions) when ``FAST``,
    else ``tl.log`` (an accurate software sequence; the interpreter has no libdevice)."""
    if FAST:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _lse_step(m, s, x):
    """One element per lane into per-lane running (max, sum of ``exp(x - max)``) with one
    ``exp``: ``exp(-|x - m|)`` rescales the sum when ``x`` is the new max and is the new term
    otherwise. ``x = -inf`` adds nothing (also while ``m`` is still ``-inf``)."""
    d = x - m
    e = tl.where(x > -float("inf"), tl.exp(-tl.abs(d)), 0.0)
    return tl.maximum(m, x), tl.where(d > 0, s * e + 1.0, s + e)


@triton.jit
def _argmax_step(best, best_i, score, idx):
    """Per-lane running max of ``score`` and its index (strictly greater: a lane keeps its first
    maximum, the lowest index, since a lane's indices only grow)."""
    take = score > best
    return tl.where(take, score, best), tl.where(take, idx, best_i)


@triton.jit(do_not_specialize=["CHUNK", "S"], do_not_specialize_on_alignment=["SEED", "ROW_OFF"])
def _sample_partial_kernel(
    LOGITS, stride_l, V, CHUNK, TEMP, SEED, ROW_OFF, PART_F, PART_I, S,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Program ``(b, c)``: vocabulary chunk ``[c*CHUNK, (c+1)*CHUNK)`` of row ``b`` (``CHUNK`` a
    multiple of ``BLOCK``), read as four sub-blocks of ``Q = BLOCK / 4`` entries per block.
    Keeps per lane (one of ``Q``) the running max and sum of ``exp`` of the raw logits (for
    their log-sum-exp) and the running max of ``logits / T + Gumbel`` with its index
    (``T == 0``: of the logits themselves, no noise drawn), and merges the lanes once at the
    end. The Gumbel noise ``-log(-log(u))`` takes ``u`` from Philox keyed by the row's seed:
    one ``randint4x`` call at counter ``ROW_OFF[b] + v0 / 4 + j`` gives the four draws of the
    vocabulary entries ``v0 + j``, ``v0 + Q + j``, ``v0 + 2Q + j`` and ``v0 + 3Q + j`` of the
    block starting at ``v0`` (a multiple of ``BLOCK``), so the noise of an entry does not
    depend on the chunking, and Philox runs once per four entries. Writes ``PART_F[b, c] =
    (max, sum, best score)`` and ``PART_I[b, c] = best index`` (the lowest index among equal
    best scores). Per-lane state replaced four cross-warp reductions per block and the
    interleaving of the four draws into one vector (was 145.6 us per call at batch 256 on an
    H200, 2026-12-02; BENCHMARKS.md, issue 16, ninth session)."""
    Q: tl.constexpr = BLOCK // 4
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = LOGITS + b.to(tl.int64) * stride_l
    t = tl.load(TEMP + b)
    seed = tl.load(SEED + b)
    off0 = tl.load(ROW_OFF + b)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    lane = tl.arange(0, Q)
    m = tl.full([Q], -float("inf"), tl.float32)
    s = tl.zeros([Q], tl.float32)
    best = tl.full([Q], -float("inf"), tl.float32)
    best_i = tl.zeros([Q], tl.int32)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    for start in range(lo, hi, BLOCK):
        i0 = start + lane
        i1 = i0 + Q
        i2 = i1 + Q
        i3 = i2 + Q
        x0 = tl.load(row + i0, mask=i0 < hi, other=-float("inf")).to(tl.float32)
        x1 = tl.load(row + i1, mask=i1 < hi, other=-float("inf")).to(tl.float32)
        x2 = tl.load(row + i2, mask=i2 < hi, other=-float("inf")).to(tl.float32)
        x3 = tl.load(row + i3, mask=i3 < hi, other=-float("inf")).to(tl.float32)
        m, s = _lse_step(m, s, x0)
        m, s = _lse_step(m, s, x1)
        m, s = _lse_step(m, s, x2)
        m, s = _lse_step(m, s, x3)
        if greedy:
            best, best_i = _argmax_step(best, best_i, x0, i0)
            best, best_i = _argmax_step(best, best_i, x1, i1)
            best, best_i = _argmax_step(best, best_i, x2, i2)
            best, best_i = _argmax_step(best, best_i, x3, i3)
        else:
            r0, r1, r2, r3 = tl.randint4x(seed, (off0 + start // 4 + lane).to(tl.uint32))
            g0 = -_log(-_log(tl.random.uint_to_uniform_float(r0), FAST_LOG), FAST_LOG)
            g1 = -_log(-_log(tl.random.uint_to_uniform_float(r1), FAST_LOG), FAST_LOG)
            g2 = -_log(-_log(tl.random.uint_to_uniform_float(r2), FAST_LOG), FAST_LOG)
            g3 = -_log(-_log(tl.random.uint_to_uniform_float(r3), FAST_LOG), FAST_LOG)
            best, best_i = _argmax_step(best, best_i, tl.where(i0 < hi, x0 * inv_t + g0, -float("inf")), i0)
            best, best_i = _argmax_step(best, best_i, tl.where(i1 < hi, x1 * inv_t + g1, -float("inf")), i1)
            best, best_i = _argmax_step(best, best_i, tl.where(i2 < hi, x2 * inv_t + g2, -float("inf")), i2)
            best, best_i = _argmax_step(best, best_i, tl.where(i3 < hi, x3 * inv_t + g3, -float("inf")), i3)
    mx = tl.max(m, 0)
    total = tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - mx), 0.0), 0)
    top = tl.max(best, 0)
    top_i = tl.min(tl.where(best == top, best_i, 2147483647), 0)
    base = (b * S + c) * 3
    tl.store(PART_F + base, mx)
    tl.store(PART_F + base + 1, total)
    tl.store(PART_F + base + 2, top)
    tl.store(PART_I + b * S + c, top_i)


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
