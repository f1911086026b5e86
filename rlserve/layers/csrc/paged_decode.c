/* Paged decode attention for CPU, float32: one query token per sequence, keys and values
 * read in place from the paged KV cache through each sequence's block table (no gather of
 * the context, no padding to the longest sequence).
 *
 * Layouts (all contiguous, row-major):
 *   q            [B, H, D]                        float32
 *   k_cache      [num_blocks, block_size, Hkv, D] float32 (v_cache the same)
 *   block_tables [B, max_blocks]                  int32
 *   seq_lens     [B]                              int32 (context length incl. this token)
 *   out          [B, H, D]                        float32
 * Query head i attends with KV head i / (H / Hkv) (grouped-query attention as HF's
 * repeat_kv and SDPA's enable_gqa lay it out).
 *
 * One task = one sequence: all its heads walk its blocks once, in table order, with an
 * online (running-max) softmax per block, so every K/V byte is read from memory once per
 * step and each block is read front to back (one task per (sequence, KV head) reads a
 * third of each row at a stride and measured ~1.4x slower for 3 KV heads). Tasks are spread over OpenMP threads when compiled
 * with -fopenmp (the process's libgomp: torch's own, so torch.set_num_threads applies).
 *
 * Vector code uses GCC/Clang vector extensions (8 floats), so one source compiles to
 * AVX2, AVX-512 or NEON as -march=native allows. Returns 0, or a nonzero code for shapes
 * this kernel does not take (the caller falls back to PyTorch).
 *
 * Compiled for AVX-512 (-march=native on such a CPU) and with D a multiple of 16, tasks run
 * one_task16 instead (paged_decode_avx512.c: explicit FMAs, a KV head's query heads summing its
 * V rows together; its header has the figures): one layer, batch 64, contexts 128-512, one
 * thread, CPU time on the Zen 5 2-core machine (2026-12-02, load ~2): 3.08 -> 1.04 ms with the KV
 * in L2, 6.9 -> 3.8-4.0 ms with 8 layers' shuffled blocks from memory (its first version);
 * outputs within 4.2e-7 of one_task.
 *
 * Compiled with AVX2 + FMA (-march=native on such a CPU, AVX-512 ones for D not a multiple of 16),
 * tasks run task8 (below): task16's scheme on 8 lanes. One layer, batch 16, contexts 128-512
 * (SmolLM2's 9 / 3 heads of 64, benchmarks/cpu_decode_step.py's case), one thread, SCHED_FIFO, the
 * AMD EPYC Zen 3 2-core machine at load 13-16 (2026-12-07, session 20), 3 interleaved runs, CPU
 * medians: KV in cache 0.65 -> 0.44 ms, 8 layers' KV from memory 0.84-0.85 -> 0.80-0.81 ms (the
 * memory's share is left); callgrind, batch 16, contexts 128-248: 5.58 -> 2.19 M instructions a
 * call. Outputs within 3.6e-7 of one_task_portable (the portable path, kept without FMA).
 *
 * Both paths prefetch the next block while they work on the current one (one share of its
 * K lines per query head / token row while scoring, of its V lines while summing; the AVX-512
 * path a few lines per row). Same
 * case, 8 layers from memory, one thread (2026-12-02, ninth session, load ~1.3-2.4):
 * AVX-512 path, shuffled blocks 3.7-4.4 -> 2.6-2.9 ms per layer (32 MB of K/V: 8 -> 12 GB/s;
 * reading the same bytes in the same order without the math takes 2.2 ms), blocks in order
 * 3.1-3.5 -> 1.9-2.2 ms; the portable path built without AVX-512 (-mno-avx512f, as on an
 * AVX2 machine), shuffled 6.6-6.7 -> 3.5-3.6 ms, in order 2.1 -> 2.1 ms. Prefetching all of
 * the next block at its start, or two blocks ahead, measured no faster than none / than one.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_H 128
#define MAX_HD 16384
#define MAX_D 256
#define MAX_BS 128

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads/stores */

static inline float hsum8(v8 x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

static inline float dot(const float *a, const float *b, int d) {
    v8 acc0 = {0}, acc1 = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        acc0 += *(const v8u *)(a + i) * *(const v8u *)(b + i);
        acc1 += *(const v8u *)(a + i + 8) * *(const v8u *)(b + i + 8);
    }
    for (; i + 8 <= d; i += 8) acc0 += *(const v8u *)(a + i) * *(const v8u *)(b + i);
    return hsum8(acc0 + acc1);
}

static inline void axpy(float *y, float a, const float *x, int d) {
    v8 av = {a, a, a, a, a, a, a, a};
    for (int i = 0; i < d; i += 8) *(v8u *)(y + i) += av * *(const v8u *)(x + i);
}

static inline void scale_vec(float *y, float a, int d) {
    v8 av = {a, a, a, a, a, a, a, a};
    for (int i = 0; i < d; i += 8) *(v8u *)(y + i) *= av;
}

/* prefetch 64-byte lines [lo, hi) of p into L1 */
static inline void prefetch_lines(const char *p, int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; o++) __builtin_prefetch(p + 64 * o, 0, 3);
}

/* Block j of a sequence's table (context length L): its rows n, its K and V rows, and the next
 * block's (nk, nv; NULL after the last block: nothing to prefetch). */
typedef struct {
    int n;
    const float *kb, *vb;
    const char *nk, *nv;
} kv_block;

static inline kv_block block_at(const float *k_cache, const float *v_cache, const int32_t *bt, int j, int L,
                                int block_size, int64_t block_floats) {
    kv_block r;
    r.n = L - j * block_size < block_size ? L - j * block_size : block_size;
    r.kb = k_cache + (int64_t)bt[j] * block_floats;
    r.vb = v_cache + (int64_t)bt[j] * block_floats;
    const int more = (j + 1) * block_size < L;
    r.nk = more ? (const char *)(k_cache + (int64_t)bt[j + 1] * block_floats) : 0;
    r.nv = more ? (const char *)(v_cache + (int64_t)bt[j + 1] * block_floats) : 0;
    return r;
}

/* Sequence b's place in the inputs: the set-up every task (one_task_portable, task8, task16 in
 * paged_decode_avx512.c, which this file includes: one translation unit, as block_at's) starts with.
 * Inlined, the AVX-512 and AVX2 builds' object code is byte for byte that of the three copies it
 * replaced (the portable build's differs in stack slots only; outputs bit-equal in all builds); the
 * softmax's m/l start stays in each task: moved in here it changed the AVX builds' registers. */
typedef struct {
    int G;                     /* query heads per KV head (H / Hkv) */
    int L;                     /* context length (tokens, this one included): seq_lens[b] */
    const int32_t *bt;         /* its block table row, [max_blocks] int32 */
    int64_t row;               /* floats per cache token row: Hkv * D */
    int64_t block_floats;      /* floats per cache block: block_size * row */
    const float *qb;           /* its query, [H, D] float32 */
} seq_view;

static inline __attribute__((always_inline)) seq_view seq_at(const float *q, const int32_t *block_tables,
        const int32_t *seq_lens, int b, int H, int Hkv, int D, int block_size, int max_blocks) {
    seq_view s;
    s.G = H / Hkv;
    s.L = seq_lens[b];
    s.bt = block_tables + (int64_t)b * max_blocks;
    s.row = (int64_t)Hkv * D;
    s.block_floats = (int64_t)block_size * s.row;
    s.qb = q + (int64_t)b * H * D;
    return s;
}

typedef int32_t i8v __attribute__((vector_size(32)));

static inline v8 bcast8(float a) {
    v8 r = {a, a, a, a, a, a, a, a};
    return r;
}

/* a * b + c with one rounding per lane (the library builds with contraction off: -std=c11), the
 * same bits with AVX2 + FMA, with AVX-512 (the same 8-lane instruction) and in the portable
 * fallback (fmaf per lane) */
static inline __attribute__((always_inline)) v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__) && defined(__AVX__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int j = 0; j < 8; j++) c[j] = fmaf(a[j], b[j], c[j]);
    return c;
#endif
}

static inline v8 sel8(i8v m, v8 a, v8 b) { return (v8)(((i8v)a & m) | ((i8v)b & ~m)); }

/* e^x for x <= 0 (clamped at -87.3: e^-87.3 ~ 1e-38), relative error ~1e-7: exp16's (below,
 * AVX-512) Cody-Waite reduction and degree-7 Taylor polynomial on 8 lanes. exp8(0) = 1 exactly. */
static inline v8 exp8(v8 x) {
    x = sel8(x < bcast8(-87.3f), bcast8(-87.3f), x);
    v8 n = x * 1.44269504088896341f;
    n = (n + 12582912.f) - 12582912.f; /* round to nearest */
    v8 f = fma8(n, bcast8(-0.693359375f), x);
    f = fma8(n, bcast8(2.12194440e-4f), f);
    v8 p = fma8(f, bcast8(1.f / 5040), bcast8(1.f / 720));
    p = fma8(p, f, bcast8(1.f / 120));
    p = fma8(p, f, bcast8(1.f / 24));
    p = fma8(p, f, bcast8(1.f / 6));
    p = fma8(p, f, bcast8(0.5f));
    p = fma8(p, f, bcast8(1.f));
    p = fma8(p, f, bcast8(1.f));
    i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;
    return p * (v8)e;
}

static __attribute__((unused)) void one_task_portable(
        const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, float *out, int b, int H, int Hkv, int D, int block_size, int max_blocks, float scale) {
    const seq_view sv = seq_at(q, block_tables, seq_lens, b, H, Hkv, D, block_size, max_blocks);
    const int G = sv.G;
    const int64_t row = sv.row, block_floats = sv.block_floats;
    float qs[MAX_HD] __attribute__((aligned(32)));
    float acc[MAX_HD] __attribute__((aligned(32)));
    float s[MAX_H][MAX_BS];
    float m[MAX_H], l[MAX_H];
    for (int i = 0; i < H * D; i++) { qs[i] = sv.qb[i] * scale; acc[i] = 0.f; }
    for (int i = 0; i < H; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    for (int j = 0; j * block_size < sv.L; j++) {
        const kv_block blk = block_at(k_cache, v_cache, sv.bt, j, sv.L, block_size, block_floats);
        const int n = blk.n, more = blk.nk != 0;
        const float *kb = blk.kb, *vb = blk.vb;
        const char *nk = blk.nk, *nv = blk.nv;
        const int64_t lines = block_floats / 16, per = (lines + n - 1) / n;
        for (int t = 0; t < n; t++) {
            if (more) prefetch_lines(nk, t * per, (t + 1) * per < lines ? (t + 1) * per : lines);
            for (int i = 0; i < H; i++) s[i][t] = dot(qs + i * D, kb + t * row + (i / G) * D, D);
        }
        for (int i = 0; i < H; i++) {
            float mx = s[i][0];
            for (int t = 1; t < n; t++) mx = s[i][t] > mx ? s[i][t] : mx;
            if (mx > m[i]) {
                const float alpha = expf(m[i] - mx);
                l[i] *= alpha;
                scale_vec(acc + i * D, alpha, D);
                m[i] = mx;
            }
            float sum = 0.f;
            for (int t = 0; t < n; t++) { const float p = expf(s[i][t] - m[i]); s[i][t] = p; sum += p; }
            l[i] += sum;
        }
        for (int t = 0; t < n; t++) {
            if (more) prefetch_lines(nv, t * per, (t + 1) * per < lines ? (t + 1) * per : lines);
            for (int i = 0; i < H; i++) axpy(acc + i * D, s[i][t], vb + t * row + (i / G) * D, D);
        }
    }
    float *ob = out + (int64_t)b * H * D;
    for (int i = 0; i < H; i++) { const float inv = 1.f / l[i]; for (int d = 0; d < D; d++) ob[i * D + d] = acc[i * D + d] * inv; }
}

#if defined(__FMA__) && defined(__AVX__)
/* ---- AVX2 + FMA path (8-float vectors; D a multiple of 8, which attn_check requires): exp16's
 * scheme on 8 lanes. Per block and query head, the scores of 8 keys as 8 dot products (one FMA
 * chain over d each) reduced together by a transpose-add tree (no horizontal sum per dot), exp8
 * over 8 scores at once, and each query head's accumulator held in registers while it walks the
 * block's V rows (one_task_portable: a horizontal sum per dot, a scalar expf per score, the
 * accumulator loaded and stored for every V row). Same math, online softmax over blocks, every
 * K/V row read from memory once per step. */

/* lane l of the result = sum of all lanes of a[l] (for l < 8) */
static inline v8 reduce8(const v8 *a) {
    v8 r1[4], r2[2];
    for (int k = 0; k < 4; k++)
        r1[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14)
              + __builtin_shufflevector(a[2 * k], a[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; k++)
        r2[k] = __builtin_shufflevector(r1[2 * k], r1[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13)
              + __builtin_shufflevector(r1[2 * k], r1[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(r2[0], r2[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(r2[0], r2[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline __attribute__((always_inline)) void task8(
        const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, float *out, int b, int H, int Hkv, const int D8, int block_size,
        int max_blocks, float scale) {
    const int D = 8 * D8;
    const seq_view sv = seq_at(q, block_tables, seq_lens, b, H, Hkv, D, block_size, max_blocks);
    const int G = sv.G;
    const int64_t row = sv.row, block_floats = sv.block_floats;
    v8 qs[MAX_HD / 8], acc[MAX_HD / 8];
    float s[MAX_H][MAX_BS + 8] __attribute__((aligned(32)));
    float m[MAX_H], l[MAX_H];
    for (int i = 0; i < H * D8; i++) { qs[i] = *(const v8u *)(sv.qb + 8 * i) * scale; acc[i] = bcast8(0.f); }
    for (int i = 0; i < H; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    for (int j = 0; j * block_size < sv.L; j++) {
        const kv_block blk = block_at(k_cache, v_cache, sv.bt, j, sv.L, block_size, block_floats);
        const int n = blk.n, more = blk.nk != 0;
        const float *kb = blk.kb, *vb = blk.vb;
        /* the next block's K and V lines (blk.nk, blk.nv), a share per query head (see the header) */
        const int64_t lines = block_floats / 16, per = (lines + H - 1) / H;
        /* scores */
        for (int i = 0; i < H; i++) {
            const v8 *qi = qs + i * D8;
            const float *kh = kb + (i / G) * D;
            if (more) prefetch_lines(blk.nk, i * per, (i + 1) * per < lines ? (i + 1) * per : lines);
            for (int t0 = 0; t0 < n; t0 += 8) {
                v8 parts[8];
                const int tn = n - t0 < 8 ? n - t0 : 8;
                for (int tt = 0; tt < 8; tt++) {
                    v8 a = bcast8(0.f);
                    if (tt < tn) {
                        const float *kr = kh + (int64_t)(t0 + tt) * row;
                        for (int c = 0; c < D8; c++) a = fma8(qi[c], *(const v8u *)(kr + 8 * c), a);
                    }
                    parts[tt] = a;
                }
                *(v8 *)(s[i] + t0) = reduce8(parts);
            }
        }
        /* online softmax over this block */
        for (int i = 0; i < H; i++) {
            float mx = -INFINITY;
            for (int t = 0; t < n; t++) mx = s[i][t] > mx ? s[i][t] : mx;
            if (mx > m[i]) {
                const float alpha = expf(m[i] - mx);
                l[i] *= alpha;
                for (int c = 0; c < D8; c++) acc[i * D8 + c] *= alpha;
                m[i] = mx;
            }
            v8 sum = bcast8(0.f);
            for (int t0 = 0; t0 < n; t0 += 8) {
                v8 p = exp8(*(v8 *)(s[i] + t0) - m[i]);
                const int tn = n - t0 < 8 ? n - t0 : 8;
                for (int tt = tn; tt < 8; tt++) p[tt] = 0.f;
                *(v8 *)(s[i] + t0) = p;
                sum += p;
            }
            l[i] += hsum8(sum);
        }
        /* values: each query head's accumulator in registers over the block's rows */
        for (int i = 0; i < H; i++) {
            const float *vh = vb + (i / G) * D;
            if (more) prefetch_lines(blk.nv, i * per, (i + 1) * per < lines ? (i + 1) * per : lines);
            v8 a[MAX_D / 8];
            for (int c = 0; c < D8; c++) a[c] = acc[i * D8 + c];
            for (int t = 0; t < n; t++) {
                const v8 p = bcast8(s[i][t]);
                const float *vr = vh + (int64_t)t * row;
                for (int c = 0; c < D8; c++) a[c] = fma8(p, *(const v8u *)(vr + 8 * c), a[c]);
            }
            for (int c = 0; c < D8; c++) acc[i * D8 + c] = a[c];
        }
    }
    float *ob = out + (int64_t)b * H * D;
    for (int i = 0; i < H; i++) {
        const v8 inv = bcast8(1.f / l[i]);
        for (int c = 0; c < D8; c++) *(v8u *)(ob + i * D + 8 * c) = acc[i * D8 + c] * inv;
    }
}
#endif

/* One sequence's decode attention (the callers' task): task8 where the build has AVX2 + FMA,
 * else the portable code. */
static void one_task(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     const int32_t *seq_lens, float *out, int b, int H, int Hkv, int D, int block_size,
                     int max_blocks, float scale) {
#if defined(__FMA__) && defined(__AVX__)
    switch (D) { /* constant trip counts: the compiler keeps a head's vectors in registers */
    case 64: task8(q, k_cache, v_cache, block_tables, seq_lens, out, b, H, Hkv, 8, block_size, max_blocks, scale); break;
    case 128: task8(q, k_cache, v_cache, block_tables, seq_lens, out, b, H, Hkv, 16, block_size, max_blocks, scale); break;
    default: task8(q, k_cache, v_cache, block_tables, seq_lens, out, b, H, Hkv, D / 8, block_size, max_blocks, scale);
    }
#else
    one_task_portable(q, k_cache, v_cache, block_tables, seq_lens, out, b, H, Hkv, D, block_size, max_blocks, scale);
#endif
}

#if defined(__AVX512F__)
#include "paged_decode_avx512.c" /* one_task16: the AVX-512 path */
#endif

/* The entry points' checks: 0 ok; 1 shapes this kernel does not take; 2 a context length outside
 * 1..max_blocks * block_size. */
static int attn_check(const int32_t *seq_lens, int B, int H, int Hkv, int D, int block_size, int max_blocks) {
    if (Hkv <= 0 || H % Hkv || H > MAX_H || H * D > MAX_HD || D % 8 || D > MAX_D || block_size > MAX_BS || block_size < 1)
        return 1;
    for (int b = 0; b < B; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * block_size) return 2;
    return 0;
}

int rlserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, const int32_t *seq_lens, float *out, int B, int H,
                             int Hkv, int D, int block_size, int max_blocks, float scale, int num_threads) {
    const int rc = attn_check(seq_lens, B, H, Hkv, D, block_size, max_blocks);
    if (rc) return rc;
    const int tasks = B;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
#endif
    for (int task = 0; task < tasks; task++)
#if defined(__AVX512F__)
        if (D % 16 == 0)
            one_task16(q, k_cache, v_cache, block_tables, seq_lens, out, task, H, Hkv, D, block_size,
                       max_blocks, scale);
        else
#endif
        one_task(q, k_cache, v_cache, block_tables, seq_lens, out, task, H, Hkv, D, block_size,
                 max_blocks, scale);
    (void)num_threads;
    return 0;
}
