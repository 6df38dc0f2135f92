/* gemv.h: the CPU expert lane. Routed-expert MoE for EXL3 `mul1` experts, computed straight from
 * the trellis (no dense copy of any weight), in fp32.
 *
 * For picks (row r, expert e, weight w) the job computes, for every row r of x,
 *     out[r] = sum over its picks of  w * down_e( act( gate_e(x[r]), up_e(x[r]) ) )
 *     act(g, u) = silu(min(g, L)) * clamp(u, -L, L)        (GLM's SwiGLU clamp, L = act_limit)
 * where each EXL3 linear is  y = had(had(x * suh) @ Wq) * svh  (had: 128-point Walsh-Hadamard
 * blocks scaled by 1/sqrt(128); Wq: the decoded fp16 tile weights, bit-identical to exllamav3's
 * reconstruct). Everything after the fp16 weights is fp32: inputs, accumulation, outputs.
 * That is the exact precision. The fast precision (gemv_fast.h) skips the codebook's fp16 rounding
 * and multiplies int16-quantised inputs in integers: about 2x the speed, with an error below the
 * GPU kernel's own. An expert picked by several rows is decoded once per job.
 *
 * Layouts (all caller memory, never copied, never written except `out`, `done` and `status`):
 *   trellis   int16 tiles [k/16][n/16][8 * k2], exllamav3's native layout (k2 = 2 K: 6 for 3 bits,
 *             5 for the half rate 2.5); `gemv_matrix.trellis` points at tile [0][0]
 *   suh, svh  fp16 [k] and [n] (raw bits)
 *   x         fp32 [num_rows][hidden];  out  fp32 [num_rows][hidden], overwritten
 * Each expert is three matrices: gate and up (hidden -> inter), down (inter -> hidden), given as
 * separate pointers, so a packed store record and separate arrays work the same way.
 *
 * Threads: a pool of pinned workers runs one job at a time, all workers on it together. Submit
 * and wait never touch Python; everything here is safe to call without the GIL.
 * Current limits: mul1 codebook only, K = 1..8 or 1.5 / 2.5 / 3.5, rows 1..8, picks <= 64,
 * hidden and inter multiples of 128.
 */
#ifndef GLM53_GEMV_H
#define GLM53_GEMV_H

#include <stddef.h>
#include <stdint.h>

#define GEMV_MAX_ROWS 8
#define GEMV_MAX_PICKS 64
#define GEMV_MSG_BYTES 256

enum gemv_variant {
    GEMV_SCALAR = 0, /* portable C, one weight at a time: slow, for checks and old CPUs */
    GEMV_AVX2 = 1,   /* AVX2 + FMA + F16C */
    GEMV_AVX512 = 2, /* AVX-512 F/BW/VL + VBMI + VNNI */
    GEMV_AVX512_FP16 = 3, /* + VBMI2 + FP16: the weights decoded 32 at a time in fp16 */
    GEMV_NUM_VARIANTS = 4,
    GEMV_BEST = -1 /* the fastest variant this CPU runs */
};

enum gemv_precision {
    GEMV_EXACT = 0, /* fp16 weights bit-identical to exllamav3's, fp32 products */
    GEMV_FAST = 1,  /* unrounded codebook, int16 inputs (gemv_fast.h) */
    GEMV_NUM_PRECISIONS = 2,
};

enum gemv_status {
    GEMV_OK = 0,
    GEMV_EINVAL = 1,   /* a bad argument; the message names it */
    GEMV_ENOSYS = 2,   /* the variant needs instructions this CPU lacks */
    GEMV_ENOMEM = 3,   /* scratch memory could not be allocated */
    GEMV_EBUSY = 4,    /* the pool's job queue is full */
    GEMV_EPENDING = 5, /* status of a job that has not finished */
};

typedef struct {
    const uint8_t *trellis;
    const uint16_t *suh;
    const uint16_t *svh;
} gemv_matrix;

typedef struct {
    gemv_matrix gate, up, down;
} gemv_expert;

typedef struct {
    int32_t row;
    int32_t expert;
    float weight;
} gemv_pick;

typedef struct gemv_job {
    /* shape */
    int32_t hidden; /* k of gate/up, n of down */
    int32_t inter;  /* n of gate/up, k of down */
    int32_t k2;     /* bits per weight in half bits */
    float act_limit; /* SwiGLU clamp; 0 = none */
    int32_t variant; /* enum gemv_variant */
    int32_t precision; /* enum gemv_precision; 0 (exact) in a zeroed job */
    /* inputs */
    const gemv_expert *experts;
    int32_t num_experts; /* picks index 0..num_experts-1 */
    const float *x;
    int32_t num_rows;
    const gemv_pick *picks;
    int32_t num_picks;
    /* outputs */
    float *out;
    volatile uint32_t *done; /* optional: receives `seq` (release) once out and status are final */
    uint32_t seq;
    int32_t status; /* GEMV_EPENDING until done */
    /* owned by the pool while the job is queued or running */
    uint32_t finished;
    struct gemv_job *next;
} gemv_job;

const char *gemv_variant_name(int variant);
const char *gemv_precision_name(int precision);
int gemv_variant_supported(int variant);
/* Whether this CPU runs `variant` at `precision` (the fast avx512-fp16 kernel is the avx512 one). */
int gemv_kernel_supported(int variant, int precision);
int gemv_best_variant(void);
/* Checks shapes, pointers, ids and the variant. Returns GEMV_OK, or an error code with a sentence
 * naming the bad field in msg. */
int gemv_job_check(const gemv_job *job, char *msg, size_t msg_len);

typedef struct gemv_pool gemv_pool;
/* num_threads workers; worker i is pinned to cpus[i] when cpus is not NULL. Returns NULL with a
 * sentence in msg when a thread cannot be started or pinned. */
gemv_pool *gemv_pool_create(const int *cpus, int num_threads, char *msg, size_t msg_len);
void gemv_pool_destroy(gemv_pool *pool); /* finishes queued jobs first */
int gemv_pool_threads(const gemv_pool *pool);
/* How long an idle worker spins before it sleeps on a futex (default 200 us; the workers read it
 * each time they go idle). GEMV_EINVAL for a negative value. */
int gemv_pool_set_idle_spin(gemv_pool *pool, long ns);
long gemv_pool_idle_spin(gemv_pool *pool);
/* Queue a checked job; returns at once. The job and everything it points at must stay valid
 * until it is done. Returns GEMV_OK, GEMV_EBUSY, or the gemv_job_check code. */
int gemv_pool_submit(gemv_pool *pool, gemv_job *job, char *msg, size_t msg_len);
/* Wait (spin, then sleep) until a submitted job is done; returns its status. */
int gemv_pool_wait(gemv_pool *pool, gemv_job *job);

/* Who runs the jobs of a batch. */
enum gemv_caller {
    GEMV_CALLER_WAITS = 0,    /* the pool's workers run every job; the caller waits */
    GEMV_CALLER_HELPS = 1,    /* the caller also takes the batch's jobs off the queue and runs them */
    GEMV_CALLER_RUNS_ALL = 2, /* the caller runs every job; no worker is woken */
};
/* Run `num_jobs` independent jobs and return when all are done. Every job is checked first (none
 * runs when one is bad; msg names the job and the field). A job the caller runs is planned for the
 * pool's thread count, like one a worker runs, so its output is the same bits whoever ran it. The
 * batch's jobs need not be zeroed beyond gemv_job's inputs and outputs (`done` may be NULL).
 * Returns GEMV_OK or the first failing job's status. */
int gemv_pool_run_batch(gemv_pool *pool, gemv_job *jobs, int num_jobs, int caller, char *msg,
                        size_t msg_len);

#endif
