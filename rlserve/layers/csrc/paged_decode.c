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
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

static void one_task(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     const int32_t *seq_lens, float *out, int b, int H, int Hkv, int D, int block_size,
                     int max_blocks, float scale) {
    const int G = H / Hkv;
    const int L = seq_lens[b];
    const int32_t *bt = block_tables + (int64_t)b * max_blocks;
    const int64_t row = (int64_t)Hkv * D;
    const int64_t block_floats = (int64_t)block_size * row;
    float qs[MAX_HD] __attribute__((aligned(32)));
    float acc[MAX_HD] __attribute__((aligned(32)));
    float s[MAX_H][MAX_BS];
    float m[MAX_H], l[MAX_H];
    const float *qb = q + (int64_t)b * H * D;
    for (int i = 0; i < H * D; i++) { qs[i] = qb[i] * scale; acc[i] = 0.f; }
    for (int i = 0; i < H; i++) { m[i] = -INFINITY; l[i] = 0.f; }
    for (int j = 0; j * block_size < L; j++) {
        const int n = L - j * block_size < block_size ? L - j * block_size : block_size;
        const float *kb = k_cache + (int64_t)bt[j] * block_floats;
        const float *vb = v_cache + (int64_t)bt[j] * block_floats;
        for (int t = 0; t < n; t++)
            for (int i = 0; i < H; i++) s[i][t] = dot(qs + i * D, kb + t * row + (i / G) * D, D);
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
        for (int t = 0; t < n; t++)
            for (int i = 0; i < H; i++) axpy(acc + i * D, s[i][t], vb + t * row + (i / G) * D, D);
    }
    float *ob = out + (int64_t)b * H * D;
    for (int i = 0; i < H; i++) { const float inv = 1.f / l[i]; for (int d = 0; d < D; d++) ob[i * D + d] = acc[i * D + d] * inv; }
}

int rlserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, const int32_t *seq_lens, float *out, int B, int H,
                             int Hkv, int D, int block_size, int max_blocks, float scale, int num_threads) {
    if (Hkv <= 0 || H % Hkv || H > MAX_H || H * D > MAX_HD || D % 8 || D > MAX_D || block_size > MAX_BS || block_size < 1)
        return 1;
    for (int b = 0; b < B; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > max_blocks * block_size) return 2;
    const int tasks = B;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && tasks > 1)
#endif
    for (int task = 0; task < tasks; task++)
        one_task(q, k_cache, v_cache, block_tables, seq_lens, out, task, H, Hkv, D, block_size,
                 max_blocks, scale);
    (void)num_threads;
    return 0;
}
