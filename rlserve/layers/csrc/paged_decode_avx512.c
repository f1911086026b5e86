/* The AVX-512 path of paged_decode.c's decode attention (included by it where the build has
 * AVX-512F, for D a multiple of 16): one sequence's task, one_task16. Layouts, GQA mapping and
 * the online softmax are paged_decode.c's (see its header).
 *
 * Per KV block (n <= block_size rows):
 *   scores, head by head: the scores of 16 rows as 16 dot products whose D-long sums are
 *     explicit FMA chains (_mm512_fmadd_ps; the library builds with contraction off, so a
 *     plain `a += x * y` is a multiply and an add), reduced together by one transpose-add tree
 *     (no horizontal sum per dot), the query's D16 vectors in registers; a K row is read from
 *     memory once and by the other query heads of its KV head from L1;
 *   the block's max per head as one vector max and one reduction, exp16 over 16 scores at once;
 *   values, GT query heads of one KV head together: each V row's D16 vectors are loaded once
 *     for the GT heads, and the GT x D16 accumulators (independent FMA chains: 12 for SmolLM2's
 *     3 heads of 64) stay in registers over the block's rows.
 * The next block's K lines are prefetched a few per (query head, row) scored, its V lines a few
 * per (value pass, row) summed, by a cursor over each (paged_decode.c's header: why one block
 * ahead). Not here: prefetching the next sequence's first block during a sequence's last (the first
 * block of every task is cold) measured 0.973x (BENCHMARKS.md issue 37 (s24)) but needs the batch size
 * in this task's arguments, which cpu_team.c's attention chunk passes (left for a change of both).
 *
 * Measured (benchmarks/cpu_attn_ab.py against the version before, SmolLM2's 9 / 3 heads of 64,
 * batch 16, 30 layers' caches, one thread, CPU time, the 2-core AVX-512 Xeon at load 5-7,
 * 2026-12-07 s24; BENCHMARKS.md issue 37 (s24)): contexts 128-256 from memory (146 MB of K/V)
 * 25.9 -> 22.5 ms (0.87x, lower in 8 of 8 turns; 0.91x and 0.93x in two runs with the next-sequence
 * prefetch below), 128-512 31.0 -> 30.8 ms (0.99x); contexts 32-64 in L2 3.7 -> 3.3 ms (0.89x). The version before (no explicit FMA: the library builds
 * with contraction off, so `a += x * y` was a multiply and an add; the 16 dots stored to the
 * stack; one query head's 4 accumulators per value pass, 4 dependent chains; a burst of
 * prefetches per head) ran at 10-11% of the FMA peak even with its K/V in L2. From memory
 * both are near a plain read of the same bytes in the same order (14.5-16.8 ms).
 */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16 fma16(v16 a, v16 b, v16 c) {
    return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

static inline v16 bcast16(float a) { return (v16)_mm512_set1_ps(a); }

/* lane l of the result = sum of all lanes of a[l] (for l < 16) */
static inline v16 reduce16(const v16 *a) {
    v16 r1[8], r2[4], r3[2];
    for (int k = 0; k < 8; k++)
        r1[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
              + __builtin_shufflevector(a[2 * k], a[2 * k + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int k = 0; k < 4; k++)
        r2[k] = __builtin_shufflevector(r1[2 * k], r1[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
              + __builtin_shufflevector(r1[2 * k], r1[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int k = 0; k < 2; k++)
        r3[k] = __builtin_shufflevector(r2[2 * k], r2[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
              + __builtin_shufflevector(r2[2 * k], r2[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + __builtin_shufflevector(r3[0], r3[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}

/* e^x for x <= 0 (x >= -87.3 after clamping: e^-87.3 ~ 1e-38), relative error ~1e-7:
 * Cody-Waite reduction x = n ln2 + f, |f| <= ln2/2, degree-7 Taylor polynomial of e^f (exp8's
 * scheme on 16 lanes) */
static inline v16 exp16(v16 x) {
    x = (v16)_mm512_max_ps((__m512)x, _mm512_set1_ps(-87.3f));
    v16 n = x * 1.44269504088896341f;
    n = (n + 12582912.f) - 12582912.f; /* round to nearest */
    v16 f = fma16(n, bcast16(-0.693359375f), x);
    f = fma16(n, bcast16(2.12194440e-4f), f);
    v16 p = fma16(f, bcast16(1.f / 5040), bcast16(1.f / 720));
    p = fma16(p, f, bcast16(1.f / 120));
    p = fma16(p, f, bcast16(1.f / 24));
    p = fma16(p, f, bcast16(1.f / 6));
    p = fma16(p, f, bcast16(0.5f));
    p = fma16(p, f, bcast16(1.f));
    p = fma16(p, f, bcast16(1.f));
    i16v e = (__builtin_convertvector(n, i16v) + 127) << 23;
    return p * (v16)e;
}

/* One sequence (b) of the batch; D16 = D / 16 and GT (query heads per value pass, dividing
 * H / Hkv) are constants at the call sites so that the vectors stay in registers. */
static inline __attribute__((always_inline)) void task16(
        const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, float *out, int b, int H, int Hkv, const int D16, const int GT, int block_size,
        int max_blocks, float scale) {
    const int D = 16 * D16;
    const seq_view sv = seq_at(q, block_tables, seq_lens, b, H, Hkv, D, block_size, max_blocks);
    const int G = sv.G;
    const int64_t row = sv.row, block_floats = sv.block_floats;
    v16 qs[MAX_HD / 16], acc[MAX_HD / 16];
    float s[MAX_H][MAX_BS + 16] __attribute__((aligned(64)));
    float m[MAX_H], l[MAX_H];
    for (int i = 0; i < H * D16; i++) { qs[i] = *(const v16u *)(sv.qb + 16 * i) * scale; acc[i] = bcast16(0.f); }
    for (int i = 0; i < H; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    for (int j = 0; j * block_size < sv.L; j++) {
        const kv_block blk = block_at(k_cache, v_cache, sv.bt, j, sv.L, block_size, block_floats);
        const int n = blk.n, more = blk.nk != 0;
        const float *kb = blk.kb, *vb = blk.vb;
        /* the next block's K lines, a few per (query head, row) scored; its V lines likewise per
           (pass, row) summed: a cursor over each, so that no burst of prefetches fills the line
           fill buffers (one share per head or pass at once measured 13% of the samples) */
        const int passes = H / GT;
        const int64_t lines = more ? block_floats / 16 : 0;
        const int64_t kstep = (lines + (int64_t)H * n - 1) / ((int64_t)H * n);
        const int64_t vstep = (lines + (int64_t)passes * n - 1) / ((int64_t)passes * n);
        int64_t kpf = 0, vpf = 0;
        /* scores and the online softmax, one query head at a time */
        for (int i = 0; i < H; i++) {
            v16 qi[MAX_D / 16];
            for (int c = 0; c < D16; c++) qi[c] = qs[i * D16 + c];
            const float *kh = kb + (i / G) * D;
            v16 mxv = bcast16(-INFINITY);
            for (int t0 = 0; t0 < n; t0 += 16) {
                v16 parts[16];
                const int tn = n - t0 < 16 ? n - t0 : 16;
#define ROW_DOT(tt)                                                                              \
    do {                                                                                         \
        const float *kr = kh + (int64_t)(t0 + (tt)) * row;                                       \
        v16 a = bcast16(0.f);                                                                    \
        for (int c = 0; c < D16; c++) a = fma16(qi[c], *(const v16u *)(kr + 16 * c), a);         \
        parts[tt] = a;                                                                           \
        for (int64_t e = kpf + kstep < lines ? kpf + kstep : lines; kpf < e; kpf++)              \
            __builtin_prefetch(blk.nk + 64 * kpf, 0, 3);                                         \
    } while (0)
                if (tn == 16) {
#pragma GCC unroll 16
                    for (int tt = 0; tt < 16; tt++) ROW_DOT(tt);
                } else {
                    for (int tt = 0; tt < tn; tt++) ROW_DOT(tt);
                    for (int tt = tn; tt < 16; tt++) parts[tt] = bcast16(0.f);
                }
#undef ROW_DOT
                const __mmask16 valid = (__mmask16)((1u << tn) - 1);
                const v16 sc = (v16)_mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), (__m512)reduce16(parts));
                *(v16 *)(s[i] + t0) = sc;
                mxv = (v16)_mm512_max_ps((__m512)mxv, (__m512)sc);
            }
            const float mx = _mm512_reduce_max_ps((__m512)mxv);
            if (mx > m[i]) {
                const float alpha = expf(m[i] - mx);
                l[i] *= alpha;
                for (int c = 0; c < D16; c++) acc[i * D16 + c] *= alpha;
                m[i] = mx;
            }
            v16 sum = bcast16(0.f);
            for (int t0 = 0; t0 < n; t0 += 16) {
                const int tn = n - t0 < 16 ? n - t0 : 16;
                const v16 p = (v16)_mm512_maskz_mov_ps((__mmask16)((1u << tn) - 1),
                                                       (__m512)exp16(*(v16 *)(s[i] + t0) - m[i]));
                *(v16 *)(s[i] + t0) = p;
                sum += p;
            }
            l[i] += _mm512_reduce_add_ps((__m512)sum);
        }
        /* values: GT query heads of one KV head per pass, their accumulators in registers */
        for (int pass = 0; pass < passes; pass++) {
            const int i0 = pass * GT;
            const float *vh = vb + (i0 / G) * D;
            v16 a[3][MAX_D / 16];
            for (int h = 0; h < GT; h++)
                for (int c = 0; c < D16; c++) a[h][c] = acc[(i0 + h) * D16 + c];
            for (int t = 0; t < n; t++) {
                const float *vr = vh + (int64_t)t * row;
                v16 p[3];
                for (int h = 0; h < GT; h++) p[h] = bcast16(s[i0 + h][t]);
                for (int c = 0; c < D16; c++) {
                    const v16 v = *(const v16u *)(vr + 16 * c);
                    for (int h = 0; h < GT; h++) a[h][c] = fma16(p[h], v, a[h][c]);
                }
                for (int64_t e = vpf + vstep < lines ? vpf + vstep : lines; vpf < e; vpf++)
                    __builtin_prefetch(blk.nv + 64 * vpf, 0, 3);
            }
            for (int h = 0; h < GT; h++)
                for (int c = 0; c < D16; c++) acc[(i0 + h) * D16 + c] = a[h][c];
        }
    }
    float *ob = out + (int64_t)b * H * D;
    for (int i = 0; i < H; i++) {
        const float inv = 1.f / l[i];
        for (int c = 0; c < D16; c++) *(v16u *)(ob + i * D + 16 * c) = acc[i * D16 + c] * inv;
    }
}

/* One sequence's decode attention on the AVX-512 path (D a multiple of 16): constant D16 and
 * heads per value pass (3 or 2 where they divide the group and fit the registers, else 1). */
static void one_task16(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                       const int32_t *seq_lens, float *out, int b, int H, int Hkv, int D, int block_size,
                       int max_blocks, float scale) {
    const int G = H / Hkv;
#define T16(D16, GT) task16(q, k_cache, v_cache, block_tables, seq_lens, out, b, H, Hkv, D16, GT, block_size, \
                            max_blocks, scale)
    if (D == 64 && G % 3 == 0) T16(4, 3);
    else if (D == 64 && G % 2 == 0) T16(4, 2);
    else if (D == 64) T16(4, 1);
    else if (D == 128 && G % 2 == 0) T16(8, 2);
    else if (D == 128) T16(8, 1);
    else T16(D / 16, 1);
#undef T16
}
