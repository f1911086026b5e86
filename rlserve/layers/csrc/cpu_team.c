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

/* ---- linear on packed panels: cpu_team_gemm.c ------------------------------------------- */

#include "cpu_team_gemm.c"

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
