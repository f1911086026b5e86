/* Fused elementwise kernels for the CPU path, float32: what rlserve/layers/fused_ops.py's
 * Triton kernels do on GPUs, one pass over memory instead of several PyTorch ops.
 *
 *   rlserve_rms_norm_f32        (residual add +) RMSNorm of rows
 *   rlserve_silu_mul_f32        silu(x[:, :d]) * x[:, d:]
 *   rlserve_qkv_rope_write_f32  per-head q/k RMSNorm (optional), rotary embedding of q and k
 *                               (rotate_half style) and the write of k, v into the paged cache
 *
 * Rounding follows the op-by-op PyTorch (Hugging Face) code in float32: the residual sum,
 * each product and each sum are rounded as PyTorch rounds them, so with contraction off
 * (the build passes -ffp-contract=off: no fused multiply-adds) rotary and the residual sum
 * are bit-equal to PyTorch; RMSNorm differs only by the order of its float32 mean, SiLU by
 * the exp approximation (exp8 below: Cephes' polynomial, within 2 ulp of expf, as PyTorch's
 * Sleef exp is within 1 ulp).
 *
 * Rows are spread over OpenMP threads when compiled with -fopenmp (torch's own libgomp, so
 * torch.set_num_threads applies); `nthreads` is the caller's torch.get_num_threads().
 * Vector code uses GCC/Clang vector extensions (8 floats): AVX2, AVX-512 or NEON as
 * -march=native allows, with scalar tails for sizes that are not multiples of 8.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  /* unaligned loads/stores */

#define LD(p) (*(const v8u *)(p))
#define ST(p, v) (*(v8u *)(p) = (v))

static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }

static inline float hsum8(v8 x) {
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

/* select(m, a, b): a where the comparison mask m is all ones, else b */
static inline v8 select8(v8i m, v8 a, v8 b) { return (v8)((m & (v8i)a) | (~m & (v8i)b)); }

/* exp(x), 8 lanes: Cephes expf (range reduction by ln2 in two parts, degree-5 polynomial). */
static inline v8 exp8(v8 x) {
    x = select8(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    x = select8(x < splat(-88.3762626647949f), splat(-88.3762626647949f), x);
    v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
    v8i n = __builtin_convertvector(fx, v8i); /* truncation; floor below */
    v8 nf = __builtin_convertvector(n, v8);
    v8i gt = nf > fx;
    n = n + gt; /* gt is -1 where truncation rounded up */
    nf = __builtin_convertvector(n, v8);
    x = x - nf * splat(0.693359375f);
    x = x - nf * splat(-2.12194440e-4f);
    v8 z = x * x;
    v8 y = splat(1.9875691500E-4f);
    y = y * x + splat(1.3981999507E-3f);
    y = y * x + splat(8.3334519073E-3f);
    y = y * x + splat(4.1665795894E-2f);
    y = y * x + splat(1.6666665459E-1f);
    y = y * x + splat(5.0000001201E-1f);
    y = y * z + x + splat(1.0f);
    v8i e = (n + 127) << 23;
    return y * (v8)e;
}

/* ---- RMSNorm ------------------------------------------------------------------------ */

/* out = w * (h * (1 / sqrt(mean(h^2) + eps))) for one row h of n floats */
static inline void norm_row(const float *h, const float *w, float *out, int64_t n, float eps) {
    v8 acc0 = splat(0.f), acc1 = splat(0.f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8 a = LD(h + i), b = LD(h + i + 8);
        acc0 += a * a;
        acc1 += b * b;
    }
    for (; i + 8 <= n; i += 8) {
        v8 a = LD(h + i);
        acc0 += a * a;
    }
    float ss = hsum8(acc0 + acc1);
    for (; i < n; i++) ss += h[i] * h[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    v8 rv = splat(r);
    for (i = 0; i + 8 <= n; i += 8) ST(out + i, LD(w + i) * (LD(h + i) * rv));
    for (; i < n; i++) out[i] = w[i] * (h[i] * r);
}

/* x, res: [T, N] with row strides sx, sr; w: [N]; out, res_out: [T, N] contiguous.
 * res == NULL: out = norm(x). Otherwise res_out = x + res and out = norm(res_out). */
int rlserve_rms_norm_f32(const float *x, const float *res, const float *w, float *out, float *res_out,
                         int64_t T, int64_t N, int64_t sx, int64_t sr, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T * N >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * sx;
        if (res == NULL) {
            norm_row(xr, w, out + t * N, N, eps);
            continue;
        }
        const float *rr = res + t * sr;
        float *s = res_out + t * N;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) ST(s + i, LD(xr + i) + LD(rr + i));
        for (; i < N; i++) s[i] = xr[i] + rr[i];
        norm_row(s, w, out + t * N, N, eps);
    }
    return 0;
}

/* ---- SiLU and multiply ---------------------------------------------------------------- */

/* x: [T, 2d] with row stride sx; out: [T, d] contiguous. out = silu(gate) * up, where
 * silu(g) = g / (1 + exp(-g)) rounded before the multiply (PyTorch's CPU formula). */
int rlserve_silu_mul_f32(const float *x, float *out, int64_t T, int64_t d, int64_t sx, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T * d >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * sx, *u = g + d;
        float *o = out + t * d;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            v8 gv = LD(g + i);
            v8 s = gv / (splat(1.0f) + exp8(-gv));
            ST(o + i, s * LD(u + i));
        }
        for (; i < d; i++) {
            float s = g[i] / (1.0f + expf(-g[i]));
            o[i] = s * u[i];
        }
    }
    return 0;
}

/* ---- q/k norm + rotary + KV-cache write --------------------------------------------- */

/* One head in place-free form: dst = rope(norm?(src)). rot: rotated leading dims (even). */
static inline void rope_head(const float *src, float *dst, const float *nw, float eps, const float *cs,
                             const float *sn, int64_t hd, int64_t rot, float *tmp) {
    if (nw != NULL) {
        norm_row(src, nw, tmp, hd, eps);
        src = tmp;
    }
    int64_t half = rot / 2;
    /* x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): each product rounded,
     * then the sum (no contraction) */
    for (int64_t i = 0; i < half; i++) dst[i] = src[i] * cs[i] + (-src[i + half]) * sn[i];
    for (int64_t i = half; i < rot; i++) dst[i] = src[i] * cs[i] + src[i - half] * sn[i];
    if (rot < hd) memmove(dst + rot, src + rot, (size_t)(hd - rot) * sizeof(float));
}

/* qkv: [T, (H + 2 Hkv) hd] with row stride sqkv; positions [T] int64; cos/sin caches
 * [max_pos, rot]; qw/kw: [hd] norm weights or NULL; q_out [T, H hd] contiguous; k_cache,
 * v_cache [num_blocks, block_size, Hkv, hd] contiguous, addressed by flat slot
 * (slot * Hkv * hd); slots [T] int64, < 0 = write nothing. Returns 0, or 1 when hd > 1024. */
int rlserve_qkv_rope_write_f32(const float *qkv, const int64_t *positions, const float *cos_cache,
                               const float *sin_cache, const float *qw, const float *kw, float *q_out,
                               float *k_cache, float *v_cache, const int64_t *slots, int64_t T, int64_t H,
                               int64_t Hkv, int64_t hd, int64_t rot, int64_t sqkv, float eps, int nthreads) {
    if (hd > 1024) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T * (H + 2 * Hkv) * hd >= 65536)
    for (int64_t t = 0; t < T; t++) {
        float tmp[1024];
        const float *row = qkv + t * sqkv;
        const float *cs = cos_cache + positions[t] * rot, *sn = sin_cache + positions[t] * rot;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * hd, q_out + (t * H + h) * hd, qw, eps, cs, sn, hd, rot, tmp);
        int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *k = row + H * hd, *v = k + Hkv * hd;
        for (int64_t h = 0; h < Hkv; h++)
            rope_head(k + h * hd, k_cache + (slot * Hkv + h) * hd, kw, eps, cs, sn, hd, rot, tmp);
        memcpy(v_cache + slot * Hkv * hd, v, (size_t)(Hkv * hd) * sizeof(float));
    }
    return 0;
}


