/* A CPU "team" for one engine: the calling thread plus persistent worker threads that share
 * one operation's independent chunks (output-column panels of a linear, sequences of a decode
 * attention) through an atomic ticket, with no barrier that waits for a thread that has not
 * started.
 *
 * Why not OpenMP threads: every OpenMP parallel region ends at a barrier that waits for every
 * team thread, so on a 2-core machine where anything else wants a core, a preempted thread
 * stalls the whole step (rlserve/engine/cpu/cpu_threads.py: 2 threads up to 6x slower under
 * load). Here a chunk is claimed by whichever thread gets to it first: a worker that was
 * preempted before claiming anything costs nothing (the caller runs every chunk itself, at
 * one-thread speed), and the caller waits only for chunks a worker has already started.
 * A decode step on 2 cores then reads half of the weights on each core (a micro-batch of
 * rows reads all of them on each core: rlserve/engine/cpu/cpu_microbatch.py).
 *
 * Entry points (ctypes, rlserve/layers/cpu_gemm.py):
 *   rlserve_team_start(workers, spin_us)   start `workers` worker threads (idempotent)
 *   rlserve_team_size()                    1 + running workers
 *   rlserve_team_pin_workers(cpus, n)      pin worker i to CPU cpus[i] (RLSERVE_CPU_TEAM_BIND=1)
 *   rlserve_team_avoid_cpu(cpu)            keep the workers off one CPU (RLSERVE_CPU_TEAM_BIND=avoid)
 *   rlserve_gemm_f32(...)                  out[M, N] = x[M, K] @ w[N, K]^T (+ bias), w packed
 *   rlserve_team_paged_decode_f32(...)     paged_decode.c's kernel, sequences over the team
 *   rlserve_team_paged_prefill_f32(...)    paged_prefill.c's causal query tiles over the team
 * The worker threads are the process's; each call says how many threads of the team it may
 * use (`team`: the caller + team - 1 workers; 1 runs every chunk on the calling thread), so
 * that engines in one process keep team sizes (and contention guards) of their own.
 *
 * Packed weight layout: panels of 32 output columns, wp[p][k][j] = w[32 p + j][k] (float32,
 * N padded with zero rows to a multiple of 32): a panel is one contiguous K x 128-byte stream.
 * Each output element is one sequential sum over k of fused multiply-adds (acc = fma(x, w,
 * acc), k = 0..K-1, bias added last): its bits do not depend on M, on which rows share a call,
 * on the chunking or on the thread that computed it (batch-invariant by construction).
 *
 * Workers spin for `spin_us` microseconds after their last chunk (the next operation of a
 * step follows within tens of microseconds), then sleep on a futex until the next one.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sys/syscall.h>

#include "paged_decode.c"

#define MAX_WORKERS 63

typedef void (*chunk_fn)(const void *ctx, int64_t chunk);

static struct {
    _Atomic uint64_t ticket;  /* generation << 32 | next chunk to claim */
    _Atomic int64_t done;     /* chunks finished in the current generation */
    _Atomic uint32_t gen;     /* futex word: bumped for every job */
    _Atomic int sleepers;
    _Atomic int busy;         /* one job at a time; a second caller runs its chunks alone */
    /* the current job, published by team_run: fn, ctx, job_workers first (relaxed), then
       nchunks (release); a worker reads nchunks first (acquire), then the others */
    _Atomic(chunk_fn) fn;
    _Atomic(const void *) ctx;
    _Atomic int64_t nchunks;
    int workers;
    _Atomic int job_workers;  /* workers with index < job_workers take part in the current job */
    int64_t test_pause_ns[2]; /* tests only (rlserve_team_test_pause_us): team_run sleeps [0] between
                                 publishing a job and opening its ticket, a worker [1] between seeing
                                 a new generation and reading the job */
    pthread_t threads[MAX_WORKERS];
    int64_t spin_ns;
    /* counters (rlserve_team_stats): team jobs run, the callers' ns waiting at a job's end for
       chunks a worker still ran, the workers' ns spinning for the next job, their futex sleeps */
    _Atomic int64_t st_jobs, st_wait_ns, st_spin_ns, st_sleeps;
    pthread_mutex_t start_lock;
} T = {.start_lock = PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    struct timespec ts = {ns / 1000000000, ns % 1000000000};
    nanosleep(&ts, NULL);
}

/* Claim and run chunks of generation `g` until none is left (or a newer job started). */
static void run_chunks(uint32_t g, chunk_fn fn, const void *ctx, int64_t n) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&T.ticket, memory_order_acquire);
        for (;;) {
            if ((uint32_t)(t >> 32) != g || (int64_t)(t & 0xffffffffu) >= n) return;
            if (atomic_compare_exchange_weak_explicit(&T.ticket, &t, t + 1, memory_order_acq_rel,
                                                      memory_order_acquire))
                break;
        }
        fn(ctx, (int64_t)(t & 0xffffffffu));
        atomic_fetch_add_explicit(&T.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&T.gen);
    for (;;) {
        int64_t t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&T.gen, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 64 == 0 && now_ns() - t0 > T.spin_ns) {
                atomic_fetch_add_explicit(&T.st_spin_ns, now_ns() - t0, memory_order_relaxed);
                atomic_fetch_add_explicit(&T.st_sleeps, 1, memory_order_relaxed);
                atomic_fetch_add(&T.sleepers, 1);
                if (atomic_load(&T.gen) == seen)
                    syscall(SYS_futex, (uint32_t *)&T.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&T.sleepers, 1);
                t0 = now_ns();
            }
        }
        atomic_fetch_add_explicit(&T.st_spin_ns, now_ns() - t0, memory_order_relaxed);
        seen = atomic_load_explicit(&T.gen, memory_order_acquire);
        if (T.test_pause_ns[1] > 0) sleep_ns(T.test_pause_ns[1]);
        /* The job's fields may already be the NEXT job's (this worker woke late: the caller ran
           every chunk of `seen` itself, returned, and is publishing another job, whose ticket is
           not open yet). That is harmless because the caller closed `seen`'s ticket at its end
           (low half all ones, before it released `busy`) and publishes nchunks with release
           after that: a worker that reads the new nchunks also sees the closed ticket, so
           run_chunks(seen, ...) claims nothing. Before this, a late worker read the next job's
           nchunks against the old, open-ended ticket (old job, next chunk = its count) and ran
           that job's chunks while its caller was still between publishing and opening it,
           counting them in `done`: the caller then returned while a worker still wrote its
           output (found in review; tests/test_cpu_gemm.py::test_a_late_worker_runs_no_chunk_of_the_next_job). */
        int64_t n = atomic_load_explicit(&T.nchunks, memory_order_acquire);
        chunk_fn fn = atomic_load_explicit(&T.fn, memory_order_relaxed);
        const void *ctx = atomic_load_explicit(&T.ctx, memory_order_relaxed);
        if (index < atomic_load_explicit(&T.job_workers, memory_order_relaxed)) run_chunks(seen, fn, ctx, n);
    }
    return NULL;
}

static void after_fork_child(void) {
    T.workers = 0;  /* the child has no worker threads: it starts its own when asked */
    atomic_store(&T.busy, 0);
    atomic_store(&T.sleepers, 0);
}

int rlserve_team_start(int workers, int spin_us) {
    if (workers < 0) workers = 0;
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    pthread_mutex_lock(&T.start_lock);
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork = 1;
    }
    T.spin_ns = (int64_t)(spin_us < 0 ? 0 : spin_us) * 1000;
    while (T.workers < workers) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)T.workers);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        T.threads[T.workers++] = th;
    }
    int n = T.workers;
    pthread_mutex_unlock(&T.start_lock);
    return 1 + n;
}

int rlserve_team_size(void) { return 1 + T.workers; }

/* Pin worker i (i < n, i < the running workers) to CPU cpus[i]; cpus[i] < 0 leaves worker i free
   (the calling thread's CPU mask). Returns how many workers were pinned or freed (a
   failing pthread_setaffinity_np, e.g. a CPU outside the cgroup, is skipped). */
int rlserve_team_pin_workers(const int *cpus, int n) {
    int done = 0;
    cpu_set_t all;
    if (sched_getaffinity(0, sizeof all, &all) != 0) CPU_ZERO(&all);
    for (int i = 0; i < n && i < T.workers; i++) {
        cpu_set_t set;
        if (cpus[i] >= 0) {
            CPU_ZERO(&set);
            CPU_SET(cpus[i], &set);
        } else {
            set = all;
        }
        if (pthread_setaffinity_np(T.threads[i], sizeof set, &set) == 0) done++;
    }
    return done;
}

/* Keep every worker off CPU `cpu` (its mask: the calling thread's minus `cpu`; cpu < 0: the calling
   thread's whole mask), a syscall per worker only when `cpu` changed since the last call
   (RLSERVE_CPU_TEAM_BIND=avoid). Returns 0, or 1 where the mask would be empty (nothing changed). */
int rlserve_team_avoid_cpu(int cpu) {
    static int last = -2;
    if (cpu == last) return 0;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    if (cpu >= 0) {
        CPU_CLR(cpu, &set);
        if (CPU_COUNT(&set) == 0) return 1;
    }
    for (int i = 0; i < T.workers; i++) pthread_setaffinity_np(T.threads[i], sizeof set, &set);
    last = cpu;
    return 0;
}

/* CPU time the workers used so far, nanoseconds (their thread CPU clocks) */
int64_t rlserve_team_worker_cpu_ns(void) {
    int64_t total = 0;
    for (int i = 0; i < T.workers; i++) {
        clockid_t cid;
        struct timespec ts;
        if (pthread_getcpuclockid(T.threads[i], &cid) == 0 && clock_gettime(cid, &ts) == 0)
            total += (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    }
    return total;
}

/* fn(ctx, c) for c in [0, n): on the caller and team - 1 workers when the team is free, else
   (or with team <= 1) all on the calling thread. */
static void team_run(chunk_fn fn, const void *ctx, int64_t n, int team) {
    int expect = 0;
    if (n <= 1 || team <= 1 || T.workers == 0 || !atomic_compare_exchange_strong(&T.busy, &expect, 1)) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        return;
    }
    atomic_store_explicit(&T.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&T.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&T.job_workers, team - 1, memory_order_relaxed);
    atomic_store_explicit(&T.nchunks, n, memory_order_release);
    atomic_store_explicit(&T.done, 0, memory_order_relaxed);
    if (T.test_pause_ns[0] > 0) sleep_ns(T.test_pause_ns[0]);
    uint32_t g = atomic_load(&T.gen) + 1;
    atomic_store_explicit(&T.ticket, (uint64_t)g << 32, memory_order_release);
    atomic_store(&T.gen, g); /* seq_cst: ordered before the sleepers check below */
    if (atomic_load(&T.sleepers) > 0)
        syscall(SYS_futex, (uint32_t *)&T.gen, FUTEX_WAKE_PRIVATE, MAX_WORKERS, NULL, NULL, 0);
    run_chunks(g, fn, ctx, n);
    /* only chunks a worker already claimed are left: wait for them */
    int64_t spins = 0;
    if (atomic_load_explicit(&T.done, memory_order_acquire) < n) {
        const int64_t w0 = now_ns();
        while (atomic_load_explicit(&T.done, memory_order_acquire) < n) {
            cpu_relax();
            if (++spins > 2000) sched_yield(); /* the worker may share this core: let it finish */
        }
        atomic_fetch_add_explicit(&T.st_wait_ns, now_ns() - w0, memory_order_relaxed);
    }
    atomic_fetch_add_explicit(&T.st_jobs, 1, memory_order_relaxed);
    /* close the ticket (no chunk of generation g can be claimed whatever count a late worker
       read; see worker_main) before the next job may be published */
    atomic_store_explicit(&T.ticket, ((uint64_t)g << 32) | 0xffffffffu, memory_order_relaxed);
    atomic_store_explicit(&T.busy, 0, memory_order_release);
}

/* out[0..3] = the counters so far: team jobs, ns callers waited at a job's end for a worker's
   chunks, ns workers spun for the next job, workers' futex sleeps (benchmarks/cpu_team_spin.py) */
void rlserve_team_stats(int64_t *out) {
    out[0] = atomic_load(&T.st_jobs);
    out[1] = atomic_load(&T.st_wait_ns);
    out[2] = atomic_load(&T.st_spin_ns);
    out[3] = atomic_load(&T.st_sleeps);
}

/* Tests only: team_run sleeps `caller_us` microseconds between publishing a job and opening its
   ticket (a caller preempted there), a worker `worker_us` between seeing a new job and reading it
   (a worker preempted there), 0 for none; and the finished-chunk count of the last job. */
void rlserve_team_test_pause_us(int caller_us, int worker_us) {
    T.test_pause_ns[0] = (int64_t)(caller_us < 0 ? 0 : caller_us) * 1000;
    T.test_pause_ns[1] = (int64_t)(worker_us < 0 ? 0 : worker_us) * 1000;
}
int64_t rlserve_team_test_done(void) { return atomic_load(&T.done); }

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

/* ---- paged decode attention over the team -------------------------------------------- */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *seq_lens;
    float *out;
    int H, Hkv, D, block_size, max_blocks;
    float scale;
} attn_ctx;

static void attn_chunk(const void *vctx, int64_t b) {
    const attn_ctx *a = (const attn_ctx *)vctx;
#if defined(__AVX512F__)
    if (a->D % 16 == 0) {
        one_task16(a->q, a->k_cache, a->v_cache, a->block_tables, a->seq_lens, a->out, (int)b, a->H, a->Hkv, a->D,
                   a->block_size, a->max_blocks, a->scale);
        return;
    }
#endif
    one_task(a->q, a->k_cache, a->v_cache, a->block_tables, a->seq_lens, a->out, (int)b, a->H, a->Hkv, a->D,
             a->block_size, a->max_blocks, a->scale);
}

/* rlserve_paged_decode_f32's arguments and checks (paged_decode.c), one sequence per chunk on
 * `team` threads (as rlserve_gemm_f32's) instead of OpenMP threads. */
int rlserve_team_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                                  const int32_t *block_tables, const int32_t *seq_lens, float *out, int B, int H,
                                  int Hkv, int D, int block_size, int max_blocks, float scale, int team) {
    const int rc = attn_check(seq_lens, B, H, Hkv, D, block_size, max_blocks);
    if (rc) return rc;
    attn_ctx a = {q, k_cache, v_cache, block_tables, seq_lens, out, H, Hkv, D, block_size, max_blocks, scale};
    team_run(attn_chunk, &a, B, team);
    return 0;
}

#include "paged_prefill.c"

/* ---- a decode step's decoder layers in one call --------------------------------------- */

#include "cpu_stack.c"
