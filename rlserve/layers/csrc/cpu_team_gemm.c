/* The CPU team's linear, out[M, N] = x[M, K] @ w[N, K]^T (+ bias), on packed weight panels
 * (rlserve_gemm_f32): the register tiles, the k-pieces, the row blocks and their dispatch.
 * Included by cpu_team.c where this section stood (it uses the team's chunk_fn and team_run, defined
 * there before the include); not built on its own. cpu_team.c's header gives the packed layout and
 * the bits contract (one sequential FMA chain over k per output element, bias last).
 */

/* ---- linear on packed panels -------------------------------------------------------- */

/* One vector register of float32 lanes (VL of them) and a * w + acc with one rounding per lane
   (the build keeps contraction off elsewhere). A 32-column panel row is NVP = 32 / VL vectors:
   2 with AVX-512, 4 with AVX2 + FMA, 8 in the portable fallback. */
#if defined(__AVX512F__)
#define VL 16
typedef float vreg __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) vreg vfma(float a, vreg w, vreg acc) {
    return (vreg)_mm512_fmadd_ps(_mm512_set1_ps(a), (__m512)w, (__m512)acc);
}
#elif defined(__FMA__) && defined(__AVX__)
#define VL 8
typedef float vreg __attribute__((vector_size(32)));
static inline __attribute__((always_inline)) vreg vfma(float a, vreg w, vreg acc) {
    return (vreg)_mm256_fmadd_ps(_mm256_set1_ps(a), (__m256)w, (__m256)acc);
}
#else
#define VL 4
typedef float vreg __attribute__((vector_size(16)));
static inline __attribute__((always_inline)) vreg vfma(float a, vreg w, vreg acc) {
    for (int j = 0; j < VL; j++) acc[j] = fmaf(a, w[j], acc[j]);
    return acc;
}
#endif
typedef float vregu __attribute__((vector_size(VL * 4), aligned(4)));
#define PW 32 /* panel width: output columns per packed panel */
#define NVP (PW / VL)

/* Register tile: MB rows (up to MAX_MB) x NV vectors of columns, at most ACC_REGS accumulators:
   AVX-512 24 of its 32 registers (12 rows x the whole panel); AVX2 12 of its 16 (the other 3:
   2 weight vectors and the row's broadcast), so 1-3 rows x the whole panel (4 vectors) or 4-6
   rows x half of it (2 vectors), the half-panel tile run twice per panel. Before s18 the AVX2
   build ran the AVX-512 tile's 16-lane vectors through 8-lane halves rebuilt element by element
   and at most 2 rows: 4-6 GFLOP/s of one core (AMD EPYC Zen 3, 2026-12-06 s18) where torch.mm got
   13-73. NV_FOR(MB): the tile's vectors per row. */
#if defined(__AVX512F__)
#define MAX_MB 12
#define ACC_REGS 24
#elif VL == 8
#define MAX_MB 6
#define ACC_REGS 12
#else
#define MAX_MB 2
#define ACC_REGS 16
#endif
#define NV_FOR(MB) ((MB) * NVP <= ACC_REGS ? NVP : (MB) * (NVP / 2) <= ACC_REGS ? NVP / 2 : 1)
/* X_DIRECT: tiles read their rows' inputs in place (x[m][k], row stride ldx) instead of from a
   copy transposed by row block (xt[k][m]) that the calling thread writes before every call,
   alone, while the workers wait: 4.4% of a 128-token prefill's CPU on the AVX2 machine (perf,
   2026-12-07 s18), and the broadcast loads cost the same from either layout. The AVX-512 build
   keeps the copy (measured there; its 12-row tiles read 12 rows' streams in place). */
#define X_DIRECT (VL == 8)
#define PF_DIST 16
#define PF_LOC 3
/* Tiles of 2 or more rows also prefetch PF_L2 panel rows ahead into L2: their loop takes
   longer per panel row than one row's, and PF_DIST rows ahead into L1 alone came too late to
   hide the memory latency. SmolLM2-135M's 30 layers' linears + LM head, one thread, CPU ms
   (2026-12-06, Xeon, load 9-10; with KC's pieces below): 4 / 8 / 16 rows 48-53 / 53-56 /
   64-67 -> 43-48 / 48-49 / 57-58 (PF_L2 48: 48-52 / 50 / 57-58; 64 or 96 no better). One
   row: no gain (38 -> 40 ms with it), so not there. */
#define PF_L2 32

/* MB rows x NV vectors of one panel's columns from column h on, over k in [0, kn): xt holds the
   rows' inputs transposed (xt[k][m]) from the first k of the piece on (X_DIRECT: xt[m][k], row
   stride ldx, from the first k of the piece on), wp the panel's rows from
   there ([kn][32]). The accumulators start at zero (acc_in NULL) or at acc_in's [MB][32] values
   (the piece before: a longer sum cut in k-pieces, the same fused multiply-adds in the same
   order, so the same bits); they end in acc_out ([MB][32]) or, when acc_out is NULL (the last
   piece), + bias in the panel's stored columns among them (ncols <= 32 stored in all; out: the
   first row's panel column 0, row stride ldo). pf, pf2: prefetch distances in panel rows into
   L1 and L2 (0: none), of the cache lines this tile reads. NV > NVP (pair tiles, h 0): vectors
   NVP.. are the next panel's, whose rows start pb floats after wp's (wp + pb: its [kn][32]), its
   columns the 32 after wp's (out, bias, ncols <= 64), acc_in / acc_out rows [MB][64]. */
/* The tile as a template of its register arrays' sizes (ROWS x VECS accumulators): `tile` for one panel
   (MAX_MB x NVP), `tile_pair` for two (PAIR_MB x 2 NVP; below). One function with arrays of the larger
   size for both gave the 1-row tile other code, 0.91x in L2 (2026-12-07 s24). */
#define TILE_FN(NAME, ROWS, VECS)                                                                                    \
static inline __attribute__((always_inline)) void NAME(const float *xt, const float *wp, int64_t kn,                \
                                                       const float *acc_in, float *acc_out, float *out,             \
                                                       int64_t ldo, int ncols, const float *bias, const int64_t pf, \
                                                       const int64_t pf2, const int MB, const int NV, const int h,  \
                                                       const int64_t ldx, const int64_t pb) {                       \
    const int aw = NV > NVP ? 2 * PW : PW; /* acc_in / acc_out row width */                                         \
    vreg acc[ROWS][VECS];                                                                                           \
    if (acc_in)                                                                                                     \
        for (int m = 0; m < MB; m++)                                                                                \
            for (int j = 0; j < NV; j++) acc[m][j] = *(const vregu *)(acc_in + aw * m + h + VL * j);                \
    else                                                                                                            \
        for (int m = 0; m < MB; m++)                                                                                \
            for (int j = 0; j < NV; j++) acc[m][j] = (vreg){0};                                                     \
    for (int64_t k = 0; k < kn; k++) {                                                                              \
        /* the panel's stream, pf (pf2) rows of 128 bytes ahead (past its end: harmless) */                         \
        for (int l = 0; l < (NV * VL * 4 + 63) / 64; l++) {                                                         \
            const float *pl = wp + (l >= PW / 16 ? pb - PW : 0) + h + 16 * l; /* a line of panel a or b */          \
            if (pf > 0) __builtin_prefetch(pl + PW * (k + pf), 0, PF_LOC);                                          \
            if (pf2 > 0) __builtin_prefetch(pl + PW * (k + pf2), 0, 2);                                             \
        }                                                                                                           \
        vreg w[VECS];                                                                                               \
        for (int j = 0; j < NV; j++) w[j] = *(const vregu *)(wp + (j >= NVP ? pb - PW : 0) + PW * k + h + VL * j);  \
        for (int m = 0; m < MB; m++) {                                                                              \
            const float a = X_DIRECT ? xt[m * ldx + k] : xt[k * MB + m];                                            \
            for (int j = 0; j < NV; j++) acc[m][j] = vfma(a, w[j], acc[m][j]);                                      \
        }                                                                                                           \
    }                                                                                                               \
    if (acc_out) {                                                                                                  \
        for (int m = 0; m < MB; m++)                                                                                \
            for (int j = 0; j < NV; j++) *(vregu *)(acc_out + aw * m + h + VL * j) = acc[m][j];                     \
        return;                                                                                                     \
    }                                                                                                               \
    for (int m = 0; m < MB; m++)                                                                                    \
        for (int j = 0; j < NV; j++) {                                                                              \
            vreg v = acc[m][j];                                                                                     \
            const int c0 = h + VL * j, n = ncols - c0;                                                              \
            float *o = out + m * ldo + c0;                                                                          \
            if (n >= VL) {                                                                                          \
                if (bias) v += *(const vregu *)(bias + c0);                                                         \
                *(vregu *)o = v;                                                                                    \
            } else {                                                                                                \
                for (int c = 0; c < n; c++) o[c] = bias ? v[c] + bias[c0 + c] : v[c];                               \
            }                                                                                                       \
        }                                                                                                           \
}
TILE_FN(tile, MAX_MB, NVP)

static __thread float *xt_buf;  /* per calling thread: the inputs, transposed by row block */
static __thread int64_t xt_cap;

typedef struct {
    const float *xt, *wp, *bias;  /* xt: row block r (rows m0..m0+mb) at xt + m0 * K, as [K][mb];
                                     X_DIRECT: x itself, row m at xt + m * ldx */
    float *out;
    int64_t M, N, K, ldo, panels, panels_per_chunk, mb, ldx;
} gemm_ctx;

/* an MB-row block over the whole panel: PW / (NV_FOR(MB) * VL) tiles side by side */
#define T1(n, PF, PF2)                                                                                           \
    case n:                                                                                                      \
        for (int h = 0; h < PW; h += NV_FOR(n) * VL)                                                             \
            tile(xt, wp, kn, ai, ao, om, c->ldo, ncols, b, PF, n == 1 ? 0 : PF2, n, NV_FOR(n), h, c->ldx, 0); \
        break;
#define TILES(PF, PF2) switch (mb) { T1(1, PF, PF2) T1(2, PF, PF2) TILES_MORE(PF, PF2) }
/* Pair tiles (AVX-512, PAIR_MIN_ROWS..PAIR_MAX_ROWS rows): blocks of up to PAIR_MB rows over two
   neighbouring panels at once, 6 rows x 4 vectors = 24 accumulators (+ 4 weight vectors, 1 broadcast:
   29 of 32 registers), in place of 8-row blocks over one panel (16 rows: 6 + 6 + 4 instead of 8 + 8).
   Per k a pair tile issues 24 FMAs for 4 weight loads and 6 broadcasts (the 8-row tile: 16 for 2 and
   8): one tile loop, uninterrupted, in L1 / L2, 66-67 / 64-70 FMA flops per TSC cycle against the 8-row
   tile's 57-58 / 53-56 (the FMA peak: 64-70; embedded-broadcast FMAs, {1to16}, one load each: 28-39). Same sums in
   the same order (the same bits). Measured: BENCHMARKS.md, issue 37 (s24) TILE. Up to 12 rows one
   block of up to 12 x 32 stays (pairs were slower in L2 at 10 and 12 rows); from 19 rows, 4 or more
   blocks run one pass each (no k-pieces), not measured with pairs from memory. */
#define T2(n, PF, PF2)                                                                                           \
    case n:                                                                                                      \
        tile_pair(xt, wp, kn, ai, ao, om, c->ldo, ncols, b, PF, PF2, n, 2 * NVP, 0, c->ldx, K * PW);             \
        break;
#if defined(__AVX512F__)
#define PAIR_MB 6
TILE_FN(tile_pair, PAIR_MB, 2 * NVP)
#define PAIR_MIN_ROWS 13
#define PAIR_MAX_ROWS 18
#define TILES2(PF, PF2) switch (mb) { T2(1, PF, PF2) T2(2, PF, PF2) T2(3, PF, PF2) T2(4, PF, PF2) T2(5, PF, PF2) T2(6, PF, PF2) }
#else
#define PAIR_MB MAX_MB
#define PAIR_MIN_ROWS 1 /* no pair tiles: never taken */
#define PAIR_MAX_ROWS 0
#define TILES2(PF, PF2) TILES(PF, PF2)
#endif
#define TILES_NP(PF, PF2) if (np == 2) { TILES2(PF, PF2) } else { TILES(PF, PF2) }
#if MAX_MB == 12
#define TILES_MORE(PF, PF2) T1(3, PF, PF2) T1(4, PF, PF2) T1(5, PF, PF2) T1(6, PF, PF2) T1(7, PF, PF2) \
    T1(8, PF, PF2) T1(9, PF, PF2) T1(10, PF, PF2) T1(11, PF, PF2) T1(12, PF, PF2)
#elif MAX_MB == 6
#define TILES_MORE(PF, PF2) T1(3, PF, PF2) T1(4, PF, PF2) T1(5, PF, PF2) T1(6, PF, PF2)
#else
#define TILES_MORE(PF, PF2)
#endif

/* Rows of a call in 2..KCHUNK_MAX_BLOCKS blocks share each panel k-piece by k-piece: every
   block runs its sums over the piece's KC panel rows (4 KiB, in L1) before the next piece,
   so the panel streams from memory once per call, not once per block, and the second block
   prefetches the next piece while it computes. The accumulators wait in a buffer between
   pieces: the same fused multiply-adds in the same order as one pass (the same bits).
   SmolLM2-135M's 30 layers' linears + LM head, one thread, CPU time (2026-12-06, Xeon, load
   8-14): 16 rows 64-69 -> 58-64 ms, 32 rows 84-88 -> 76-80 ms; with 128-row pieces or without
   the second block's prefetch no faster than one pass per block. Compute-bound calls (many
   blocks) keep one pass per block: pieces measured ~10% slower at 128 rows. */
#define KC 32
#define KCHUNK_MAX_BLOCKS 3

/* chunk `chunk` of c's panels; pairs: a constant, two instances (gemm_chunk without pair tiles, as
   before them; gemm_chunk_pairs with them, rlserve_gemm_f32 picks) */
static inline __attribute__((always_inline)) void gemm_panels(const gemm_ctx *c, int64_t chunk, const int pairs) {
    const int64_t p0 = chunk * c->panels_per_chunk;
    int64_t p1 = p0 + c->panels_per_chunk;
    if (p1 > c->panels) p1 = c->panels;
    const int64_t K = c->K;
    const int64_t nblocks = (c->M + c->mb - 1) / c->mb;
    const int pieces = nblocks > 1 && nblocks <= KCHUNK_MAX_BLOCKS && K > KC;
    float accbuf[KCHUNK_MAX_BLOCKS * MAX_MB * 2 * PW] __attribute__((aligned(64)));
    for (int64_t p = p0, np; p < p1; p += np) { /* a panel is read from memory once, then from L1/L2 */
        np = pairs && p + 1 < p1 ? 2 : 1;   /* panels p .. p + np - 1 */
        const int ncols = (int)(c->N - PW * p < np * PW ? c->N - PW * p : np * PW);
        const float *b = c->bias ? c->bias + PW * p : NULL;
        if (!pieces) {
            const float *wp = c->wp + p * K * PW, *ai = NULL;
            float *ao = NULL;
            const int64_t kn = K;
            for (int64_t m0 = 0; m0 < c->M; m0 += c->mb) {
                const int mb = (int)(c->M - m0 < c->mb ? c->M - m0 : c->mb);
                const float *xt = X_DIRECT ? c->xt + m0 * c->ldx : c->xt + m0 * K;
                float *om = c->out + m0 * c->ldo + PW * p;
                TILES_NP(PF_DIST, PF_L2)
            }
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kn = K - k0 < KC ? K - k0 : KC;
            const float *wp = c->wp + p * K * PW + k0 * PW;
            for (int64_t m0 = 0, bi = 0; m0 < c->M; m0 += c->mb, bi++) {
                const int mb = (int)(c->M - m0 < c->mb ? c->M - m0 : c->mb);
                const float *xt = X_DIRECT ? c->xt + m0 * c->ldx + k0 : c->xt + m0 * K + k0 * mb;
                float *om = c->out + m0 * c->ldo + PW * p;
                float *acc = accbuf + bi * MAX_MB * 2 * PW;
                const float *ai = k0 > 0 ? acc : NULL;
                float *ao = k0 + kn < K ? acc : NULL;
                if (bi == 0) { /* streams the piece from memory */
                    TILES_NP(PF_DIST, PF_L2)
                } else if (bi == 1) { /* fetches the next piece (past the panel: the next panel's start) */
                    TILES_NP(KC, 0)
                } else {
                    TILES_NP(0, 0)
                }
            }
        }
    }
}

static void gemm_chunk(const void *vctx, int64_t chunk) { gemm_panels((const gemm_ctx *)vctx, chunk, 0); }
static void gemm_chunk_pairs(const void *vctx, int64_t chunk) { gemm_panels((const gemm_ctx *)vctx, chunk, 1); }

/* From this many rows on a linear's chunks are single panels: 16 chunks of 2 teams' threads cut
   the 18 panels of SmolLM2's o and down projections (30 of qkv) into 9 chunks of 2 (15), so one
   thread ran 5 of the 9 while the other waited: ~11% of those linears' wall time at 128 rows,
   where a panel is 2.4-6.3 MFLOP (30-80 us of a core). */
#define ONE_PANEL_ROWS 32

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) @ w^T (+ bias[N]), w packed as above
 * (ceil(N / 32) panels). `chunks`: how many pieces the panels are cut into for the team
 * (<= 0: about 8 per team thread); `team`: threads to use (the caller + team - 1 workers; 1:
 * the calling thread alone). Returns 0, 1 for sizes it does not take, 2 when the M x K
 * transpose buffer cannot be allocated. */
int rlserve_gemm_f32(const float *x, const float *wp, const float *bias, float *out, int64_t M, int64_t N,
                     int64_t K, int64_t ldx, int64_t ldo, int64_t chunks, int team) {
    if (M < 0 || N <= 0 || K <= 0 || ldx < K || ldo < N) return 1;
    if (M == 0) return 0;
    if (team > 1 + T.workers) team = 1 + T.workers;
    const int64_t panels = (N + PW - 1) / PW;
    if (chunks <= 0 && M >= ONE_PANEL_ROWS) { /* a panel's rows are a chunk's worth of work */
        chunks = panels;
    } else if (chunks <= 0) { /* about 8 per team thread, and few enough panels per chunk to stay in L2 */
        chunks = 8 * (int64_t)(team > 1 ? team : 1);
        const int64_t l2_panels = (512 * 1024) / (K * 4 * PW) > 0 ? (512 * 1024) / (K * 4 * PW) : 1;
        if ((panels + l2_panels - 1) / l2_panels > chunks) chunks = (panels + l2_panels - 1) / l2_panels;
    }
    if (chunks > panels) chunks = panels;
    /* rows in balanced blocks of at most MAX_MB (AVX-512, 16 rows: 8 + 8), each transposed once
       (X_DIRECT: read in place); pair tiles: of at most PAIR_MB (16 rows: 6 + 6 + 4), and an even
       number of panels per chunk */
    const int pairs = M >= PAIR_MIN_ROWS && M <= PAIR_MAX_ROWS && panels > 1;
    const int64_t bmax = pairs ? PAIR_MB : MAX_MB;
    const int64_t nblocks = (M + bmax - 1) / bmax, mb = (M + nblocks - 1) / nblocks;
    int64_t ppc = (panels + chunks - 1) / chunks;
    if (pairs && ppc % 2) ppc++;
    if (X_DIRECT) {
        gemm_ctx c = {x, wp, bias, out, M, N, K, ldo, panels, ppc, mb, ldx};
        team_run(pairs ? gemm_chunk_pairs : gemm_chunk, &c, (panels + c.panels_per_chunk - 1) / c.panels_per_chunk, team);
        return 0;
    }
    if (xt_cap < M * K) {
        free(xt_buf);
        xt_buf = (float *)malloc(sizeof(float) * M * K);
        if (!xt_buf) {
            xt_cap = 0;
            return 2;
        }
        xt_cap = M * K;
    }
    for (int64_t m0 = 0; m0 < M; m0 += mb) {
        const int64_t n = M - m0 < mb ? M - m0 : mb;
        float *xt = xt_buf + m0 * K;
        for (int64_t m = 0; m < n; m++) {
            const float *xr = x + (m0 + m) * ldx;
            for (int64_t k = 0; k < K; k++) xt[k * n + m] = xr[k];
        }
    }
    gemm_ctx c = {xt_buf, wp, bias, out, M, N, K, ldo, panels, ppc, mb, K};
    team_run(pairs ? gemm_chunk_pairs : gemm_chunk, &c, (panels + c.panels_per_chunk - 1) / c.panels_per_chunk, team);
    return 0;
}
