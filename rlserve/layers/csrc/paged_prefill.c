/* Causal prefill attention for CPU, float32, over the paged KV cache, on the CPU team (included
 * by cpu_team.c after paged_decode.c, whose v8 type, vector helpers (fma8, exp8), MAX_* limits and
 * one_task it uses; entry point rlserve_team_paged_prefill_f32, called by rlserve/layers/cpu_gemm.py
 * and cpu_stack.c).
 *
 * Arguments and layouts are paged_decode.c's per-query form (rlserve/batch_invariant/per_query.py:
 * every query token a row with its sequence's block table and its own context length, position
 * + 1): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
 * [T, max_blocks] int32; seq_lens [T] int32. Rows that continue the row before them (context
 * length one more, the same blocks) form a query tile of up to PF_ROWS rows (fewer when the
 * group of query heads per KV head, G = H / Hkv, is large: at most PF_QV query vectors a tile);
 * a tile of 2+ rows and one KV head is one team chunk, tiles of the latest rows first (the
 * longest contexts); a row alone (a decode row of a mixed step) runs paged_decode.c's one_task,
 * the decode kernel's bits.
 *
 * A tile reads each key and value row of its context once for all its rows and query heads:
 * scores S[t][v] = K[t] . q_v for 16 keys at a time with the query vectors transposed (8 per
 * vector register, keys broadcast: no horizontal sums), an online (running-max) softmax per 16
 * keys vectorised over query vectors with a polynomial exp (exp8, relative error ~1e-7), keys
 * past a row's context (the causal mask) at weight 0, then acc_v += p[t][v] * V[t]. Query vector
 * v's result depends only on its own query, its context and the key chunks (16 keys from each
 * block's start): not on the tile it is in, the tile's other rows or the thread, so a prompt's
 * token gets the same bits whether it came in one step or in chunks of 2+ tokens (a chunk of one
 * token, as a prefix-cache hit that leaves one, computes as a decode row). Against paged_decode.c it
 * sums the dot products and the softmax in another order and with another exp: not bit-equal
 * (the batch-invariant mode, where a prompt token must equal a decoded one, keeps the decode
 * kernel: rlserve/models/llama_cpu.py).
 *
 * Work per query vector and key: 2 x D multiply-adds (scores and values), as SDPA's; the decode
 * kernel per query row read every key once per row with a horizontal sum per dot product and a
 * scalar expf per score (~1.4x SDPA's CPU at 128-512 tokens, 2.7x at 1,024: llama_cpu.py).
 */

#define PF_ROWS 32 /* query rows per tile at most */
#define PF_QV 96   /* query vectors (rows x query heads of one KV head) per tile at most */
#define PF_KC 16   /* keys per chunk (scores, softmax step) */

/* One tile: rows 0..n-1 of q / out / sl (pointers at the tile's first row), KV head g, bt the
 * block table of its last row (the longest context).
 * Query vector v = i * G + hh: row i, query head g * G + hh. D = 8 * D8. */
static inline __attribute__((always_inline)) void pf_tile(
        const float *q, const float *k_cache, const float *v_cache, const int32_t *bt, const int32_t *sl, float *out,
        int n, int g, int H, int Hkv, const int D8, int block_size, float scale) {
    const int D = 8 * D8, G = H / Hkv, nv = n * G, nvv = (nv + 7) / 8, nvp = 8 * nvv;
    const int64_t row = (int64_t)Hkv * D, block_floats = (int64_t)block_size * row;
    float qt[MAX_D * PF_QV] __attribute__((aligned(32))); /* [D][nvp] */
    float acc[PF_QV * MAX_D] __attribute__((aligned(32))); /* [nv][D] */
    float s[PF_KC * PF_QV] __attribute__((aligned(32)));   /* [t][nvp] */
    v8 m[PF_QV / 8], l[PF_QV / 8], lenf[PF_QV / 8], alpha[PF_QV / 8];
    int lmin = sl[0], lmax = sl[0];
    for (int i = 1; i < n; i++) {
        lmin = sl[i] < lmin ? sl[i] : lmin;
        lmax = sl[i] > lmax ? sl[i] : lmax;
    }
    for (int v = 0; v < nvp; v++) {
        const int i = v / G, hh = v % G;
        const float *src = q + (int64_t)i * H * D + (int64_t)(g * G + hh) * D;
        for (int d = 0; d < D; d++) qt[d * nvp + v] = v < nv ? src[d] * scale : 0.f;
        ((float *)lenf)[v] = (float)(v < nv ? sl[i] : lmax); /* padding lanes: a copy of the longest row */
    }
    for (int w = 0; w < nvv; w++) { m[w] = bcast8(-INFINITY); l[w] = bcast8(0.f); }
    memset(acc, 0, sizeof(float) * nv * D);
    for (int j = 0; j * block_size < lmax; j++) {
        const int nb = lmax - j * block_size < block_size ? lmax - j * block_size : block_size;
        const float *kb = k_cache + (int64_t)bt[j] * block_floats + (int64_t)g * D;
        const float *vb = v_cache + (int64_t)bt[j] * block_floats + (int64_t)g * D;
        for (int c0 = 0; c0 < nb; c0 += PF_KC) {
            const int nk = nb - c0 < PF_KC ? nb - c0 : PF_KC, key0 = j * block_size + c0;
            const float *kr = kb + (int64_t)c0 * row, *vr = vb + (int64_t)c0 * row;
            /* scores: 4 keys x 2 vectors of query vectors per register tile, one FMA chain over d each */
            int t = 0;
            for (; t + 4 <= nk; t += 4) {
                int w = 0;
                for (; w + 2 <= nvv; w += 2) {
                    v8 a[4][2];
                    for (int u = 0; u < 4; u++) a[u][0] = a[u][1] = bcast8(0.f);
                    for (int d = 0; d < D; d++) {
                        const v8 q0 = *(const v8 *)(qt + d * nvp + 8 * w), q1 = *(const v8 *)(qt + d * nvp + 8 * w + 8);
                        for (int u = 0; u < 4; u++) {
                            const v8 k = bcast8(kr[(t + u) * row + d]);
                            a[u][0] = fma8(k, q0, a[u][0]);
                            a[u][1] = fma8(k, q1, a[u][1]);
                        }
                    }
                    for (int u = 0; u < 4; u++) {
                        *(v8 *)(s + (t + u) * nvp + 8 * w) = a[u][0];
                        *(v8 *)(s + (t + u) * nvp + 8 * w + 8) = a[u][1];
                    }
                }
                for (; w < nvv; w++) {
                    v8 a[4] = {0};
                    for (int d = 0; d < D; d++) {
                        const v8 q0 = *(const v8 *)(qt + d * nvp + 8 * w);
                        for (int u = 0; u < 4; u++) a[u] = fma8(bcast8(kr[(t + u) * row + d]), q0, a[u]);
                    }
                    for (int u = 0; u < 4; u++) *(v8 *)(s + (t + u) * nvp + 8 * w) = a[u];
                }
            }
            for (; t < nk; t++)
                for (int w = 0; w < nvv; w++) {
                    v8 a = {0};
                    for (int d = 0; d < D; d++) a = fma8(bcast8(kr[t * row + d]), *(const v8 *)(qt + d * nvp + 8 * w), a);
                    *(v8 *)(s + t * nvp + 8 * w) = a;
                }
            /* online softmax over the chunk, 8 query vectors per register */
            const int masked = key0 + nk > lmin;
            for (int w = 0; w < nvv; w++) {
                v8 mx = m[w];
                for (t = 0; t < nk; t++) {
                    v8 x = *(v8 *)(s + t * nvp + 8 * w);
                    if (masked) *(v8 *)(s + t * nvp + 8 * w) = x = sel8(bcast8((float)(key0 + t)) < lenf[w], x,
                                                                        bcast8(-INFINITY));
                    mx = sel8(x > mx, x, mx);
                }
                alpha[w] = exp8(m[w] - mx);
                m[w] = mx;
                v8 sum = {0};
                for (t = 0; t < nk; t++) {
                    v8 x = *(v8 *)(s + t * nvp + 8 * w);
                    v8 p = exp8(x - mx);
                    if (masked) p = sel8(bcast8((float)(key0 + t)) < lenf[w], p, bcast8(0.f));
                    *(v8 *)(s + t * nvp + 8 * w) = p;
                    sum += p;
                }
                l[w] = fma8(l[w], alpha[w], sum);
            }
            /* values: each query vector's accumulator in registers over the chunk's rows */
            for (int v = 0; v < nv; v++) {
                const float al = ((const float *)alpha)[v];
                v8 a[MAX_D / 8];
                for (int c = 0; c < D8; c++) a[c] = *(const v8 *)(acc + v * D + 8 * c) * al;
                for (t = 0; t < nk; t++) {
                    const v8 p = bcast8(s[t * nvp + v]);
                    const float *vt = vr + (int64_t)t * row;
                    for (int c = 0; c < D8; c++) a[c] = fma8(p, *(const v8u *)(vt + 8 * c), a[c]);
                }
                for (int c = 0; c < D8; c++) *(v8 *)(acc + v * D + 8 * c) = a[c];
            }
        }
    }
    for (int v = 0; v < nv; v++) {
        const int i = v / G, hh = v % G;
        const v8 inv = bcast8(1.f / ((const float *)l)[v]);
        float *dst = out + (int64_t)i * H * D + (int64_t)(g * G + hh) * D;
        for (int c = 0; c < D8; c++) *(v8u *)(dst + 8 * c) = *(const v8 *)(acc + v * D + 8 * c) * inv;
    }
}

static void pf_tile_any(const float *q, const float *k_cache, const float *v_cache, const int32_t *bt,
                        const int32_t *sl, float *out, int n, int g, int H, int Hkv, int D, int block_size,
                        float scale) {
    switch (D) { /* constant trip counts: a query vector's accumulator stays in registers */
    case 64: pf_tile(q, k_cache, v_cache, bt, sl, out, n, g, H, Hkv, 8, block_size, scale); break;
    case 128: pf_tile(q, k_cache, v_cache, bt, sl, out, n, g, H, Hkv, 16, block_size, scale); break;
    default: pf_tile(q, k_cache, v_cache, bt, sl, out, n, g, H, Hkv, D / 8, block_size, scale);
    }
}

/* ---- over the team: tiles found from the per-query tables, one chunk per (tile, KV head) ---- */

typedef struct {
    int32_t r0, n, g; /* rows r0..r0+n-1, KV head g; n == 1: one_task over all heads */
} pf_item;

static __thread pf_item *pf_items;
static __thread int64_t pf_cap;

typedef struct {
    attn_ctx a;
    const pf_item *items;
} pf_ctx;

static void pf_chunk(const void *vctx, int64_t c) {
    const pf_ctx *p = (const pf_ctx *)vctx;
    const attn_ctx *a = &p->a;
    const pf_item it = p->items[c];
    if (it.n == 1) {
        attn_chunk(a, it.r0);
        return;
    }
    const int64_t rs = (int64_t)a->H * a->D;
    pf_tile_any(a->q + it.r0 * rs, a->k_cache, a->v_cache, a->block_tables + (int64_t)(it.r0 + it.n - 1) * a->max_blocks,
                a->seq_lens + it.r0, a->out + it.r0 * rs, it.n, it.g, a->H, a->Hkv, a->D, a->block_size, a->scale);
}

/* rlserve_team_paged_decode_f32's arguments, checks and return codes (paged_decode.c's rows:
 * one per query token), computed by query tiles (this file's header). */
int rlserve_team_paged_prefill_f32(const float *q, const float *k_cache, const float *v_cache,
                                   const int32_t *block_tables, const int32_t *seq_lens, float *out, int B, int H,
                                   int Hkv, int D, int block_size, int max_blocks, float scale, int team) {
    const int rc = attn_check(seq_lens, B, H, Hkv, D, block_size, max_blocks);
    if (rc) return rc;
    const int G = H / Hkv;
    const int rows = G > PF_QV ? 1 : (PF_QV / G < PF_ROWS ? PF_QV / G : PF_ROWS);
    if (pf_cap < (int64_t)B * Hkv) {
        free(pf_items);
        pf_items = (pf_item *)malloc(sizeof(pf_item) * B * Hkv);
        if (!pf_items) {
            pf_cap = 0;
            return 3;
        }
        pf_cap = (int64_t)B * Hkv;
    }
    /* tiles from the last row back (the longest contexts claimed first): rows each one context
       token longer than the row before, whose tables start with the blocks the tile's last row reads */
    int64_t ni = 0;
    for (int r1 = B; r1 > 0;) {
        const int nb = (seq_lens[r1 - 1] + block_size - 1) / block_size;
        const int32_t *bl = block_tables + (int64_t)(r1 - 1) * max_blocks;
        int r0 = r1 - 1;
        while (r0 > 0 && r1 - r0 < rows && seq_lens[r0] == seq_lens[r0 - 1] + 1 &&
               !memcmp(block_tables + (int64_t)(r0 - 1) * max_blocks, bl, sizeof(int32_t) * nb))
            r0--;
        if (r1 - r0 == 1)
            pf_items[ni++] = (pf_item){r0, 1, 0};
        else
            for (int g = 0; g < Hkv; g++) pf_items[ni++] = (pf_item){r0, r1 - r0, g};
        r1 = r0;
    }
    pf_ctx p = {{q, k_cache, v_cache, block_tables, seq_lens, out, H, Hkv, D, block_size, max_blocks, scale},
                pf_items};
    team_run(pf_chunk, &p, ni, team);
    return 0;
}
