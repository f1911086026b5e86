"""The Triton kernels behind :mod:`rlserve.layers.triton_attention` (the paged KV write, the
split-KV decode kernel and its merge, the FlashAttention-2 style prefill kernel): that module
plans, checks and launches them, and its docstring says what each computes and how it rounds.
Imported by it only when Triton is installed; with ``TRITON_INTERPRET=1`` set before this module
is imported they run in Triton's interpreter (the CPU tests)."""

import triton
import triton.language as tl


@triton.jit
def _to_cache(x, SCALE, FP8_MAX: tl.constexpr, dt: tl.constexpr):
    """``x`` as the cache stores it in ``dt``: a plain cast, or for an fp8 cache (``FP8_MAX`` > 0,
    its largest finite value) ``saturate(x / scale)`` in float32 (scale read from ``SCALE``), as
    :func:`rlserve.layers.kv_quant.quantize`: a correctly rounded division (``div_rn``; Triton's
    ``/`` is the approximate one), so the stored bytes are torch's."""
    if FP8_MAX > 0:
        y = tl.clamp(tl.div_rn(x.to(tl.float32), tl.load(SCALE)), -FP8_MAX, FP8_MAX)
        return y.to(dt, fp_downcast_rounding="rtne")
    else:
        return x.to(dt)


# fp8 -> float16, four values a 32-bit register, as inline assembly that Triton treats as having side
# effects (is_pure=False): its layout passes then cannot move the conversion past the shared-memory
# round trip into the dot-operand layout, where an fp8 tile that has to be transposed (V: the p.v dot
# wants consecutive tokens per thread) is read one byte per instruction (``ld.shared.u8``, 128 a thread
# for a 128 x 128 tile) and repacked; converted first, V goes through shared memory as float16 and is
# read with ``ldmatrix.trans`` like a bf16 cache (sm_90 SASS of both: tests/test_kv_fp8_compile.py).
# e4m3: the hardware conversion (cvt.rn.f16x2.e4m3x2, 2 values an instruction); e5m2: its float16 is
# its byte in the high half (prmt).
_E4M3_F16_ASM = tl.constexpr("""{
.reg .b16 lo, hi;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}""")
_E5M2_F16_ASM = tl.constexpr("""{
prmt.b32 $0, 0, $2, 0x5140;
prmt.b32 $1, 0, $2, 0x7362;
}""")


@triton.jit
def _kv_operand(x, q, KV_CVT: tl.constexpr, IS_V: tl.constexpr):
    """A K (``IS_V`` False) or V tile ``x`` as read from the cache, as the dots' operand.
    ``KV_CVT`` (``triton_attention.fp8_operand_mode``): 0 cast to ``q``'s dtype (a model-dtype
    cache, or fp8 cast to bf16: ``cvt.rn.f16x2.e4m3x2`` + 2 ``cvt.bf16.f16`` per pair on sm90);
    1 cast to float16 (``q`` is float16 then); 2 / 3 (e4m3 / e5m2) K cast to float16, V converted
    by :data:`_E4M3_F16_ASM` / :data:`_E5M2_F16_ASM` before it reaches shared memory. Every fp8
    value is a float16 value: all exact."""
    if KV_CVT == 2 and IS_V:
        return tl.inline_asm_elementwise(_E4M3_F16_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.float16, is_pure=False, pack=4)
    elif KV_CVT == 3 and IS_V:
        return tl.inline_asm_elementwise(_E5M2_F16_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.float16, is_pure=False, pack=4)
    elif KV_CVT >= 1:
        return x.to(tl.float16)
    else:
        return x.to(q.dtype)


@triton.jit
def _fp8_query(q, KV_CVT: tl.constexpr):
    """The query tile in the dots' dtype: float16 for ``KV_CVT`` >= 1 (clamped to float16's
    largest finite value; a bf16 value in float16's normal range converts exactly), else as
    loaded."""
    if KV_CVT >= 1:
        return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        return q


# SLOT is the step's slot mapping (a view at an offset of a step's upload where a step is split) and K_SCALE /
# V_SCALE alias it without an fp8 cache: one int64 / float32 load per program, which 16-byte alignment does not
# speed up; unmarked, a view at another alignment would compile a second variant in the middle of serving
@triton.jit(do_not_specialize_on_alignment=["SLOT", "K_SCALE", "V_SCALE"])
def _write_kv_kernel(
    K, V, KC, VC, SLOT, K_SCALE, V_SCALE,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    HEAD_DIM: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """One program per token: copy its ``num_kv_heads * head_dim`` K and V values to
    ``cache[slot]`` (cache viewed as ``[num_slots, num_kv_heads * head_dim]``); an fp8 cache
    (``FP8_MAX`` > 0) stores them quantized with ``K_SCALE`` / ``V_SCALE`` (:func:`_to_cache`)."""
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
    tl.store(KC + dst, _to_cache(k, K_SCALE, FP8_MAX, KC.dtype.element_ty), mask=mask)
    tl.store(VC + dst, _to_cache(v, V_SCALE, FP8_MAX, VC.dtype.element_ty), mask=mask)

# stride_bt (the block-table width) and NUM_SPLITS change from step to step outside CUDA
# graphs: not specialised, so one compilation serves every step (see fused_kernels). BT, SEQ_LENS, ORDER (and
# K_SCALE / V_SCALE, which alias SEQ_LENS without an fp8 cache) are per-step views (a mixed step's decode rows:
# AttentionMetadata.sequences) read a scalar per program, or BLOCK_N / PAGE block ids at ``BT + b * stride_bt``
# whose alignment stride_bt (unspecialised) already hides: their alignment buys nothing, and a view at another
# one compiled another variant in the middle of serving (the prefill kernel's miss, BENCHMARKS.md H25). The
# constexprs that follow the batch (SPLIT, ORDERED, PDL; the merge's S_PAD) are warmed by
# triton_attention.warm_up_decode
@triton.jit(do_not_specialize=["stride_bt", "NUM_SPLITS"],
            do_not_specialize_on_alignment=["BT", "SEQ_LENS", "ORDER", "K_SCALE", "V_SCALE"])
def _decode_kernel(
    Q, KC, VC, BT, SEQ_LENS, ORDER, OUT, PART_O, PART_LSE, K_SCALE, V_SCALE,
    qk_scale,  # softmax scale x log2(e)
    stride_qt, stride_qh,
    stride_cs, stride_ch,  # cache: slot stride, kv-head stride (head_dim stride is 1)
    stride_bt,
    stride_ot, stride_oh,
    NUM_HEADS, GROUP, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ORDERED: tl.constexpr,
    KV_FP8: tl.constexpr, PDL: tl.constexpr = False, KV_CVT: tl.constexpr = 0,
):
    """Program ``(kv_head, i, split)``: GROUP query heads of sequence ``b = ORDER[i]``
    (``i`` itself when not ``ORDERED``) x one split of its context. ``KV_FP8``: the cache holds
    fp8, turned into dot operands in registers as ``KV_CVT`` says (:func:`_kv_operand`);
    ``k_scale`` joins ``qk_scale`` and ``v_scale`` multiplies the output (both exact:
    dequantization is ``fp8 * scale``, linear in the dots).
    ``PDL``: launched with programmatic dependent launch (:mod:`rlserve.layers.pdl`): wait for the
    kernel before, then let the next one launch; nothing is read before the wait."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(ORDER + b)
    split = tl.program_id(2)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(K_SCALE)
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
    q = _fp8_query(q, KV_CVT)

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
        k = _kv_operand(tl.load(KC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0), q, KV_CVT, False)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_operand(tl.load(VC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0), q, KV_CVT, True)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
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
    NUM_SPLITS, S_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program ``(b, head)``: merge the splits, ``o = sum_s 2^(lse_s - M) o_s / sum_s
    2^(lse_s - M)``; a row whose splits are all empty (context 0, graph padding) gets 0.
    ``PDL``: as ``_decode_kernel``'s."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    KV_CVT: tl.constexpr,
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
    k = _kv_operand(tl.load(KC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0), q, KV_CVT, False)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # rows with nothing visible yet (padding rows) keep m = -inf: avoid inf - inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _kv_operand(tl.load(VC + slot[:, None] * stride_cs + kv_off, mask=kv_mask, other=0.0), q, KV_CVT, True)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc

# BT, SEQ_LENS and QSL are views of one per-step metadata upload at offsets that follow the batch (and K_SCALE /
# V_SCALE alias SEQ_LENS without an fp8 cache): unmarked, Triton compiled another variant of this kernel for a
# batch whose views were not 16-byte aligned, in the middle of serving (session 21's H100 c256 streams: one
# compile, 675-891 ms with 42-86 streams running, in 3 of 4 runs; the warm-up's one-sequence prefill had them aligned)
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["BT", "SEQ_LENS", "QSL", "K_SCALE", "V_SCALE"])
def _prefill_kernel(
    Q, KC, VC, BT, SEQ_LENS, QSL, OUT, K_SCALE, V_SCALE,
    qk_scale,
    stride_qt, stride_qh,
    stride_cs, stride_ch,
    stride_bt,
    stride_ot, stride_oh,
    GROUP,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KV_CVT: tl.constexpr = 0,
):
    """Program ``(m_tile, b, head)``: BLOCK_M query rows of one head of sequence b. ``KV_FP8``,
    ``KV_CVT``: an fp8 cache, as in :func:`_decode_kernel` (``k_scale`` into ``qk_scale``,
    ``v_scale`` onto the output)."""
    mt = tl.program_id(0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(K_SCALE)
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
    q = _fp8_query(q, KV_CVT)
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
            PAGE, BLOCK_N, False, DOT_PRECISION, KV_CVT,
        )
    # the diagonal band: causal and length masks
    for n0 in range(full_end, end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(
            q, KC, VC, bt_row, kv_off, n0, end, q_pos, d_mask, m_i, l_i, acc, qk_scale, stride_cs,
            PAGE, BLOCK_N, True, DOT_PRECISION, KV_CVT,
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
    tl.store(
        OUT + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
        o.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )
