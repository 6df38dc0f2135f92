/* gemv_exec.h: how the pool runs one MoE job (internal to the CPU lane; see gemv.h).
 *
 * Worker 0 plans the job (distinct experts, their rows, work units, scratch), then every worker
 * runs the phases in order, claiming units from one atomic counter per phase, with a barrier
 * between phases:
 *   1 prep     (expert, gate|up): xh = had(x * suh) for the expert's rows
 *   2 gate/up  (expert, gate|up, tile-row chunk): partial GEMV straight from the trellis
 *   3 act      (expert, 128 inter columns): sum partials, had * svh, SwiGLU, then had(a * suh_down)
 *   4 down     (expert, tile-row chunk): partial GEMV
 *   5 combine  (128 hidden columns): out = sum over picks of weight * had(sum of partials) * svh
 * Each output element is written by exactly one unit, and every sum runs in a fixed order, so a
 * job's result does not depend on which thread ran what. (The chunk size follows the thread count,
 * so pools of different sizes may differ in the last bits.)
 */
#ifndef GLM53_GEMV_EXEC_H
#define GLM53_GEMV_EXEC_H

#include <stdatomic.h>
#include <stddef.h>

#include "gemv_kern.h"

#define GEMV_NUM_PHASES 5

typedef struct {
    int32_t expert;             /* index into job->experts */
    int32_t m;                  /* rows that picked it */
    int32_t rows[GEMV_MAX_ROWS]; /* those rows, in order of first pick */
    float weights[GEMV_MAX_ROWS];
    size_t xg, xu, ad;          /* scratch offsets (floats): rotated inputs of gate, up, down */
    size_t part_gu, part_d;     /* scratch offsets of the partial sums */
} gemv_exec_expert;

typedef struct {
    const gemv_job *job;
    gemv_tiles_fn tiles;
    int num_experts;
    gemv_exec_expert experts[GEMV_MAX_PICKS];
    int rows_gu, rows_d;     /* tile rows of a gate/up matrix and of a down matrix */
    int chunk_gu, chunk_d;   /* tile rows per work unit */
    int parts_gu, parts_d;   /* work units (partials) per matrix */
    int units[GEMV_NUM_PHASES];
    float *scratch;
    size_t scratch_floats;
    _Atomic int next_unit[GEMV_NUM_PHASES];
} gemv_exec;

/* Plan `job` for `num_threads` workers (worker 0 only). Grows ex->scratch as needed. */
int gemv_exec_plan(gemv_exec *ex, const gemv_job *job, int num_threads);
/* Run units of `phase` (0-based) until none are left; every worker calls it. */
void gemv_exec_phase(gemv_exec *ex, int phase);
void gemv_exec_free(gemv_exec *ex);

#endif
