/* A decode step's whole decoder-layer stack in one call on the CPU team (included by
 * cpu_team.c; entry point rlserve_team_decode_stack_f32, called by rlserve/models/llama_cpu.py).
 *
 * rlserve/models/llama_cpu.py's layer_forward calls, per layer, nine C kernels from Python:
 * (residual add +) RMSNorm, the qkv linear, q/k-norm + rotary + KV write, paged decode
 * attention, the o linear, RMSNorm, the gate/up linear, SiLU-and-mul and the down linear, each
 * through ctypes with its tensors allocated by torch. Here the same kernels run in the same
 * order with the same arguments for every layer of the step, from C: the results are the same
 * bits, without ~270 Python -> C calls and their torch allocations per step. The norm, SiLU
 * and rotary kernels are cpu_fused.c's (a library of its own, built with -ffp-contract=off for
 * its bit-equality with PyTorch), passed in as function pointers.
 *
 * Layouts: x, hidden_out, res_out [T, hidden] float32 contiguous; pos, slots [T] int64;
 * block_tables [T, max_blocks] int32; seq_lens [T] int32. Per layer l, ptrs[l * STACK_PTRS + i]:
 * see the enum; ints[l * STACK_INTS + i] and flts[l * STACK_FLTS + i] likewise. Packed weights
 * as rlserve_gemm_f32's; caches as paged_decode.c's; cos/sin caches [max_pos, rot].
 * On return hidden_out holds the last layer's MLP output and res_out its residual (the model's
 * final norm takes both). `prefill` nonzero: the attention of rows that continue a prompt runs
 * paged_prefill.c's query tiles (rlserve_team_paged_prefill_f32) instead of one decode query per
 * row. Returns 0; 1 (nothing computed) for shapes the attention kernel does
 * not take or a context length outside the block table (the caller runs the layers one by one,
 * whose attention falls back); 2 when a work buffer cannot be allocated.
 */

enum { SP_IN_NORM, SP_POST_NORM, SP_Q_NORM, SP_K_NORM, SP_QKV, SP_QKV_B, SP_O, SP_O_B, SP_GU, SP_GU_B, SP_DOWN,
       SP_DOWN_B, SP_KC, SP_VC, SP_COS, SP_SIN, STACK_PTRS };
enum { SI_QKV_N, SI_GU_N, SI_H, SI_HKV, SI_D, SI_ROT, STACK_INTS };
enum { SF_IN_EPS, SF_POST_EPS, SF_QK_EPS, SF_SCALE, STACK_FLTS };

typedef int (*norm_fn)(const float *, const float *, const float *, float *, float *, int64_t, int64_t, int64_t,
                       int64_t, float, int);
typedef int (*silu_fn)(const float *, float *, int64_t, int64_t, int64_t, int);
typedef int (*rope_fn)(const float *, const int64_t *, const float *, const float *, const float *, const float *,
                       float *, float *, float *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float, int);

/* The per-row kernels (RMSNorm, q/k-norm + rotary + KV write, SiLU-and-mul) of a step of at
   least ROWS_ON_TEAM rows run on the team by blocks of ROWS_PER_CHUNK rows: each row's result
   is the same whichever call computes it (the kernels work row by row), so the same bits. Before,
   the calling thread ran them alone while the workers spun: 2.8% of a 128-token prefill's CPU
   (perf, AMD EPYC Zen 3, SCHED_FIFO, 2026-12-07 s18) and the workers' 3.2% of spinning. */
#define ROWS_ON_TEAM 32
#define ROWS_PER_CHUNK 8

typedef struct {
    int kind; /* 0 norm, 1 rope, 2 silu */
    void *fn;
    const float *x, *res, *w, *cs, *sn, *qw, *kw;
    float *out, *res_out, *kc, *vc;
    const int64_t *pos, *slots;
    int64_t T, N, sx, sr, H, Hkv, D, rot;
    float eps;
} rows_job;

static void rows_chunk(const void *vctx, int64_t c) {
    const rows_job *j = (const rows_job *)vctx;
    const int64_t r0 = c * ROWS_PER_CHUNK, n = j->T - r0 < ROWS_PER_CHUNK ? j->T - r0 : ROWS_PER_CHUNK;
    if (j->kind == 0)
        ((norm_fn)j->fn)(j->x + r0 * j->sx, j->res ? j->res + r0 * j->sr : NULL, j->w, j->out + r0 * j->N,
                         j->res_out ? j->res_out + r0 * j->N : NULL, n, j->N, j->sx, j->sr, j->eps, 1);
    else if (j->kind == 1)
        ((rope_fn)j->fn)(j->x + r0 * j->sx, j->pos + r0, j->cs, j->sn, j->qw, j->kw, j->out + r0 * j->H * j->D, j->kc,
                         j->vc, j->slots + r0, n, j->H, j->Hkv, j->D, j->rot, j->sx, j->eps, 1);
    else
        ((silu_fn)j->fn)(j->x + r0 * j->sx, j->out + r0 * j->N, n, j->N, j->sx, 1);
}

/* j's rows on the team (ROWS_ON_TEAM rows or more), else in one call on this thread */
static void rows_run(const rows_job *j, int nthreads, int team) {
    if (j->T < ROWS_ON_TEAM || team <= 1) {
        const int64_t T = j->T;
        if (j->kind == 0)
            ((norm_fn)j->fn)(j->x, j->res, j->w, j->out, j->res_out, T, j->N, j->sx, j->sr, j->eps, nthreads);
        else if (j->kind == 1)
            ((rope_fn)j->fn)(j->x, j->pos, j->cs, j->sn, j->qw, j->kw, j->out, j->kc, j->vc, j->slots, T, j->H, j->Hkv,
                             j->D, j->rot, j->sx, j->eps, nthreads);
        else
            ((silu_fn)j->fn)(j->x, j->out, T, j->N, j->sx, nthreads);
        return;
    }
    team_run(rows_chunk, j, (j->T + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK, team);
}

static __thread float *stack_buf; /* per calling thread: the step's intermediate rows */
static __thread int64_t stack_cap;

int rlserve_team_decode_stack_f32(void *const *fns, void *const *ptrs, const int64_t *ints, const float *flts,
                                  int L, const float *x, float *hidden_out, float *res_out, int64_t T,
                                  int64_t hidden, const int64_t *pos, const int64_t *slots,
                                  const int32_t *block_tables, const int32_t *seq_lens, int block_size,
                                  int max_blocks, int nthreads, int team, int prefill) {
    const norm_fn norm = (norm_fn)fns[0];
    const silu_fn silu = (silu_fn)fns[1];
    const rope_fn rope = (rope_fn)fns[2];
    if (T <= 0 || L <= 0) return T == 0 ? 0 : 1;
    int64_t need = 0;
    for (int l = 0; l < L; l++) { /* the attention kernel's checks, before anything is written */
        const int64_t *in = ints + (int64_t)l * STACK_INTS;
        const int64_t H = in[SI_H], Hkv = in[SI_HKV], D = in[SI_D];
        if (Hkv <= 0 || H % Hkv || H > MAX_H || H * D > MAX_HD || D % 8 || D > MAX_D || D > 1024 ||
            block_size > MAX_BS || block_size < 1)
            return 1;
        /* hn, qkv, q, o, gu, s */
        const int64_t rows = hidden + in[SI_QKV_N] + 2 * H * D + in[SI_GU_N] + in[SI_GU_N] / 2;
        if (rows > need) need = rows;
    }
    for (int64_t b = 0; b < T; b++)
        if (seq_lens[b] < 1 || seq_lens[b] > (int64_t)max_blocks * block_size) return 1;
    need *= T;
    if (stack_cap < need) {
        free(stack_buf);
        stack_buf = (float *)malloc(sizeof(float) * need);
        if (!stack_buf) {
            stack_cap = 0;
            return 2;
        }
        stack_cap = need;
    }
    memcpy(res_out, x, sizeof(float) * T * hidden); /* layer 0's residual is its input */
    for (int l = 0; l < L; l++) {
        void *const *p = ptrs + (int64_t)l * STACK_PTRS;
        const int64_t *in = ints + (int64_t)l * STACK_INTS;
        const float *fl = flts + (int64_t)l * STACK_FLTS;
        const int64_t qkv_n = in[SI_QKV_N], gu_n = in[SI_GU_N], H = in[SI_H], Hkv = in[SI_HKV], D = in[SI_D];
        float *hn = stack_buf, *qkv = hn + T * hidden, *q = qkv + T * qkv_n, *o = q + T * H * D,
              *gu = o + T * H * D, *s = gu + T * gu_n;
        /* layer 0: hn = norm(x); later: res_out = hidden_out + res_out (elementwise, in place), hn = norm(res_out) */
        rows_job nj = {.kind = 0, .fn = (void *)norm, .x = l == 0 ? x : hidden_out, .res = l == 0 ? NULL : res_out,
                       .w = p[SP_IN_NORM], .out = hn, .res_out = l == 0 ? NULL : res_out, .T = T, .N = hidden,
                       .sx = hidden, .sr = l == 0 ? 0 : hidden, .eps = fl[SF_IN_EPS]};
        rows_run(&nj, nthreads, team);
        int rc = rlserve_gemm_f32(hn, p[SP_QKV], p[SP_QKV_B], qkv, T, qkv_n, hidden, hidden, qkv_n, 0, team);
        if (rc) return rc;
        rows_job rj = {.kind = 1, .fn = (void *)rope, .x = qkv, .pos = pos, .cs = p[SP_COS], .sn = p[SP_SIN],
                       .qw = p[SP_Q_NORM], .kw = p[SP_K_NORM], .out = q, .kc = p[SP_KC], .vc = p[SP_VC],
                       .slots = slots, .T = T, .H = H, .Hkv = Hkv, .D = D, .rot = in[SI_ROT], .sx = qkv_n,
                       .eps = fl[SF_QK_EPS]};
        rows_run(&rj, nthreads, team);
        rc = (prefill ? rlserve_team_paged_prefill_f32 : rlserve_team_paged_decode_f32)(
            q, p[SP_KC], p[SP_VC], block_tables, seq_lens, o, (int)T, (int)H, (int)Hkv, (int)D, block_size, max_blocks,
            fl[SF_SCALE], team);
        if (rc == 3) return 2;
        if (rc) return 1;
        rc = rlserve_gemm_f32(o, p[SP_O], p[SP_O_B], hidden_out, T, hidden, H * D, H * D, hidden, 0, team);
        if (rc) return rc;
        rows_job pj = {.kind = 0, .fn = (void *)norm, .x = hidden_out, .res = res_out, .w = p[SP_POST_NORM], .out = hn,
                       .res_out = res_out, .T = T, .N = hidden, .sx = hidden, .sr = hidden, .eps = fl[SF_POST_EPS]};
        rows_run(&pj, nthreads, team);
        rc = rlserve_gemm_f32(hn, p[SP_GU], p[SP_GU_B], gu, T, gu_n, hidden, hidden, gu_n, 0, team);
        if (rc) return rc;
        rows_job sj = {.kind = 2, .fn = (void *)silu, .x = gu, .out = s, .T = T, .N = gu_n / 2, .sx = gu_n};
        rows_run(&sj, nthreads, team);
        rc = rlserve_gemm_f32(s, p[SP_DOWN], p[SP_DOWN_B], hidden_out, T, hidden, gu_n / 2, gu_n / 2, hidden, 0,
                              team);
        if (rc) return rc;
    }
    return 0;
}
