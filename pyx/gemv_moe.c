/* gemv_moe.c: variant dispatch, job checks, and the MoE job's plan and phases (see gemv_exec.h).
 * Plain C with no SIMD flags: the heavy part is the tile kernel of the chosen variant; the
 * Hadamards and the activation here touch a few thousand values per expert. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemv_exec.h"

#define HAD 128
#define HAD_SCALE 0.08838834764831845f /* 1 / sqrt(128) */
#define MIN_CHUNK_ROWS 8               /* tile rows per unit: keeps partial sums small next to the trellis */
#define UNITS_PER_THREAD 8             /* enough units that the last round is short */

/* ---- variants --------------------------------------------------------------------------- */

const char *gemv_variant_name(int variant)
{
    switch (variant) {
    case GEMV_SCALAR: return "scalar (slow)";
    case GEMV_AVX2: return "avx2";
    case GEMV_AVX512: return "avx512";
    case GEMV_AVX512_FP16: return "avx512-fp16";
    default: return "unknown";
    }
}

const char *gemv_precision_name(int precision)
{
    switch (precision) {
    case GEMV_EXACT: return "exact";
    case GEMV_FAST: return "fast";
    default: return "unknown";
    }
}

int gemv_variant_supported(int variant)
{
    __builtin_cpu_init();
    switch (variant) {
    case GEMV_SCALAR: return 1;
    case GEMV_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case GEMV_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("avx512vnni");
    case GEMV_AVX512_FP16:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512fp16");
    default: return 0;
    }
}

int gemv_kernel_supported(int variant, int precision)
{
    if (!gemv_variant_supported(variant))
        return 0;
    if (precision == GEMV_FAST && variant == GEMV_AVX512_FP16) /* it runs the avx512 fast kernel */
        return gemv_variant_supported(GEMV_AVX512);
    return precision == GEMV_EXACT || precision == GEMV_FAST;
}

int gemv_best_variant(void)
{
    for (int v = GEMV_NUM_VARIANTS - 1; v > GEMV_SCALAR; v--)
        if (gemv_variant_supported(v))
            return v;
    return GEMV_SCALAR;
}

gemv_tiles_fn gemv_kernel(int variant, int precision)
{
    if (precision == GEMV_FAST)
        switch (variant) {
        case GEMV_AVX2: return gemv_tiles_avx2_fast;
        case GEMV_AVX512:
        case GEMV_AVX512_FP16: return gemv_tiles_avx512_fast;
        default: return gemv_tiles_scalar_fast;
        }
    switch (variant) {
    case GEMV_AVX2: return gemv_tiles_avx2;
    case GEMV_AVX512: return gemv_tiles_avx512;
    case GEMV_AVX512_FP16: return gemv_tiles_avx512fp16;
    default: return gemv_tiles_scalar;
    }
}

gemv_tiles_fn gemv_kernel_previous(int variant, int precision)
{
    if (precision == GEMV_FAST && (variant == GEMV_AVX512 || variant == GEMV_AVX512_FP16))
        return gemv_tiles_avx512_fast_v1;
    return NULL;
}

/* ---- checks ----------------------------------------------------------------------------- */

static int fail(char *msg, size_t len, int code, const char *fmt, ...)
{
    if (msg && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, len, fmt, ap);
        va_end(ap);
    }
    return code;
}

static int check_matrix(const gemv_matrix *mat, int e, const char *name, char *msg, size_t len)
{
    if (!mat->trellis || !mat->suh || !mat->svh)
        return fail(msg, len, GEMV_EINVAL, "expert %d: %s trellis, suh and svh must all be set", e,
                    name);
    return GEMV_OK;
}

int gemv_job_check(const gemv_job *job, char *msg, size_t len)
{
    if (!job)
        return fail(msg, len, GEMV_EINVAL, "job is NULL");
    if (job->hidden <= 0 || job->hidden % HAD || job->inter <= 0 || job->inter % HAD)
        return fail(msg, len, GEMV_EINVAL,
                    "hidden %d and inter %d must be positive multiples of 128", job->hidden,
                    job->inter);
    int k2 = job->k2;
    if (k2 < 2 || k2 > 16 || (k2 % 2 == 1 && k2 > 7))
        return fail(msg, len, GEMV_EINVAL,
                    "k2 %d (bits per weight x 2) must be 2..16 (K = 1..8) or 3, 5, 7 (K = 1.5, 2.5, 3.5)",
                    k2);
    if (!(job->act_limit >= 0.0f) || isinf(job->act_limit))
        return fail(msg, len, GEMV_EINVAL, "act_limit %g must be finite and >= 0 (0 = no clamp)",
                    (double)job->act_limit);
    int v = job->variant == GEMV_BEST ? gemv_best_variant() : job->variant;
    if (v < 0 || v >= GEMV_NUM_VARIANTS)
        return fail(msg, len, GEMV_EINVAL, "variant %d is not one of 0..%d or -1 (best)",
                    job->variant, GEMV_NUM_VARIANTS - 1);
    if (job->precision < 0 || job->precision >= GEMV_NUM_PRECISIONS)
        return fail(msg, len, GEMV_EINVAL, "precision %d is not 0 (exact) or 1 (fast)",
                    job->precision);
    if (!gemv_variant_supported(v))
        return fail(msg, len, GEMV_ENOSYS, "this CPU cannot run the %s variant; use %s",
                    gemv_variant_name(v), gemv_variant_name(gemv_best_variant()));
    if (!gemv_kernel_supported(v, job->precision))
        return fail(msg, len, GEMV_ENOSYS, "this CPU cannot run the %s %s kernel; use %s",
                    gemv_variant_name(v), gemv_precision_name(job->precision),
                    gemv_variant_name(GEMV_AVX2));
    if (job->num_rows < 1 || job->num_rows > GEMV_MAX_ROWS)
        return fail(msg, len, GEMV_EINVAL, "num_rows %d must be 1..%d", job->num_rows,
                    GEMV_MAX_ROWS);
    if (job->num_picks < 0 || job->num_picks > GEMV_MAX_PICKS)
        return fail(msg, len, GEMV_EINVAL, "num_picks %d must be 0..%d", job->num_picks,
                    GEMV_MAX_PICKS);
    if (!job->x || !job->out || (job->num_picks && !job->picks))
        return fail(msg, len, GEMV_EINVAL, "x, out and picks must be set");
    if (job->num_experts < 0 || (job->num_experts && !job->experts))
        return fail(msg, len, GEMV_EINVAL, "experts must be set when num_experts %d > 0",
                    job->num_experts);
    for (int p = 0; p < job->num_picks; p++) {
        const gemv_pick *pk = &job->picks[p];
        if (pk->row < 0 || pk->row >= job->num_rows)
            return fail(msg, len, GEMV_EINVAL, "pick %d: row %d is outside 0..%d", p, pk->row,
                        job->num_rows - 1);
        if (pk->expert < 0 || pk->expert >= job->num_experts)
            return fail(msg, len, GEMV_EINVAL, "pick %d: expert %d is outside 0..%d", p,
                        pk->expert, job->num_experts - 1);
        if (!isfinite(pk->weight))
            return fail(msg, len, GEMV_EINVAL, "pick %d: weight %g is not finite", p,
                        (double)pk->weight);
        const gemv_expert *ex = &job->experts[pk->expert];
        int rc;
        if ((rc = check_matrix(&ex->gate, pk->expert, "gate", msg, len)) ||
            (rc = check_matrix(&ex->up, pk->expert, "up", msg, len)) ||
            (rc = check_matrix(&ex->down, pk->expert, "down", msg, len)))
            return rc;
    }
    return GEMV_OK;
}

/* ---- plan ------------------------------------------------------------------------------- */

static int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Split `rows` tile rows into about `want` parts of at least MIN_CHUNK_ROWS rows. */
static void split_rows(int rows, int want, int *chunk, int *parts)
{
    int max_parts = rows / MIN_CHUNK_ROWS > 0 ? rows / MIN_CHUNK_ROWS : 1;
    int p = clamp_int(want, 1, max_parts);
    *chunk = (rows + p - 1) / p;
    *parts = (rows + *chunk - 1) / *chunk;
}

int gemv_exec_plan(gemv_exec *ex, const gemv_job *job, int num_threads)
{
    int variant = job->variant == GEMV_BEST ? gemv_best_variant() : job->variant;
    ex->job = job;
    ex->tiles = gemv_kernel(variant, job->precision);
    ex->num_experts = 0;
    for (int p = 0; p < job->num_picks; p++) {
        const gemv_pick *pk = &job->picks[p];
        gemv_exec_expert *ue = NULL;
        for (int u = 0; u < ex->num_experts; u++)
            if (ex->experts[u].expert == pk->expert)
                ue = &ex->experts[u];
        if (!ue) {
            ue = &ex->experts[ex->num_experts++];
            ue->expert = pk->expert;
            ue->m = 0;
        }
        int i = 0;
        while (i < ue->m && ue->rows[i] != pk->row)
            i++;
        if (i == ue->m) { /* a row that picks an expert twice gets the weights summed */
            ue->rows[ue->m] = pk->row;
            ue->weights[ue->m++] = 0.0f;
        }
        ue->weights[i] += pk->weight;
    }
    int num = ex->num_experts > 0 ? ex->num_experts : 1;
    ex->rows_gu = job->hidden / 16;
    ex->rows_d = job->inter / 16;
    split_rows(ex->rows_gu, UNITS_PER_THREAD * num_threads / (2 * num), &ex->chunk_gu,
               &ex->parts_gu);
    split_rows(ex->rows_d, UNITS_PER_THREAD * num_threads / num, &ex->chunk_d, &ex->parts_d);

    size_t off = 0, hid = (size_t)job->hidden, inter = (size_t)job->inter;
    for (int u = 0; u < ex->num_experts; u++) {
        gemv_exec_expert *ue = &ex->experts[u];
        size_t m = (size_t)ue->m;
        ue->xg = off, off += m * hid;
        ue->xu = off, off += m * hid;
        ue->ad = off, off += m * inter;
        ue->part_gu = off, off += 2 * (size_t)ex->parts_gu * m * inter;
        ue->part_d = off, off += (size_t)ex->parts_d * m * hid;
        off = (off + 15) & ~(size_t)15; /* 64-byte aligned for the kernels */
    }
    if (off > ex->scratch_floats) {
        free(ex->scratch);
        ex->scratch = aligned_alloc(64, off * sizeof(float));
        ex->scratch_floats = ex->scratch ? off : 0;
        if (!ex->scratch)
            return GEMV_ENOMEM;
    }
    int ue_count = ex->num_experts;
    ex->units[0] = 2 * ue_count;
    ex->units[1] = 2 * ue_count * ex->parts_gu;
    ex->units[2] = ue_count * (job->inter / HAD);
    ex->units[3] = ue_count * ex->parts_d;
    ex->units[4] = job->hidden / HAD;
    for (int p = 0; p < GEMV_NUM_PHASES; p++)
        atomic_store_explicit(&ex->next_unit[p], 0, memory_order_relaxed);
    return GEMV_OK;
}

void gemv_exec_free(gemv_exec *ex)
{
    free(ex->scratch);
    ex->scratch = NULL;
    ex->scratch_floats = 0;
}

/* ---- phases ----------------------------------------------------------------------------- */

static void had128(float *v)
{
    for (int h = 1; h < HAD; h *= 2)
        for (int i = 0; i < HAD; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        int e = -1;
        do {
            mant <<= 1;
            e++;
        } while (!(mant & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* dst[0..128) = had(src * scale_in) * HAD_SCALE (* scale_out), scales fp16 or absent. */
static void rotate_block(float *dst, const float *src, const uint16_t *scale_in,
                         const uint16_t *scale_out)
{
    for (int j = 0; j < HAD; j++)
        dst[j] = scale_in ? src[j] * half_to_float(scale_in[j]) : src[j];
    had128(dst);
    for (int j = 0; j < HAD; j++)
        dst[j] *= scale_out ? HAD_SCALE * half_to_float(scale_out[j]) : HAD_SCALE;
}

static float swiglu(float g, float u, float limit)
{
    if (limit > 0.0f) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : u > limit ? limit : u;
    }
    return g / (1.0f + expf(-g)) * u;
}

static void phase_prep(gemv_exec *ex, int unit)
{
    const gemv_job *job = ex->job;
    gemv_exec_expert *ue = &ex->experts[unit / 2];
    const gemv_expert *e = &job->experts[ue->expert];
    const uint16_t *suh = unit % 2 ? e->up.suh : e->gate.suh;
    float *dst = ex->scratch + (unit % 2 ? ue->xu : ue->xg);
    for (int i = 0; i < ue->m; i++) {
        const float *x = job->x + (size_t)ue->rows[i] * (size_t)job->hidden;
        for (int b = 0; b < job->hidden; b += HAD)
            rotate_block(dst + (size_t)i * (size_t)job->hidden + b, x + b, suh + b, NULL);
    }
}

static void phase_gate_up(gemv_exec *ex, int unit)
{
    const gemv_job *job = ex->job;
    int part = unit % ex->parts_gu, which = (unit / ex->parts_gu) % 2;
    gemv_exec_expert *ue = &ex->experts[unit / ex->parts_gu / 2];
    const gemv_expert *e = &job->experts[ue->expert];
    int kt0 = part * ex->chunk_gu;
    int kt1 = kt0 + ex->chunk_gu < ex->rows_gu ? kt0 + ex->chunk_gu : ex->rows_gu;
    size_t m_inter = (size_t)ue->m * (size_t)job->inter;
    float *acc = ex->scratch + ue->part_gu + ((size_t)which * ex->parts_gu + part) * m_inter;
    ex->tiles(which ? e->up.trellis : e->gate.trellis, job->inter / 16, job->k2, kt0, kt1,
              ex->scratch + (which ? ue->xu : ue->xg), job->hidden, ue->m, acc);
}

static void phase_act(gemv_exec *ex, int unit)
{
    const gemv_job *job = ex->job;
    int blocks = job->inter / HAD, b = (unit % blocks) * HAD;
    gemv_exec_expert *ue = &ex->experts[unit / blocks];
    const gemv_expert *e = &job->experts[ue->expert];
    size_t inter = (size_t)job->inter, m_inter = (size_t)ue->m * inter;
    const float *part_g = ex->scratch + ue->part_gu;
    const float *part_u = part_g + (size_t)ex->parts_gu * m_inter;
    float g[HAD], u[HAD], sum_g[HAD], sum_u[HAD], a[HAD];
    for (int i = 0; i < ue->m; i++) {
        for (int j = 0; j < HAD; j++)
            sum_g[j] = sum_u[j] = 0.0f;
        for (int p = 0; p < ex->parts_gu; p++) {
            const float *pg = part_g + p * m_inter + i * inter + b;
            const float *pu = part_u + p * m_inter + i * inter + b;
            for (int j = 0; j < HAD; j++) {
                sum_g[j] += pg[j];
                sum_u[j] += pu[j];
            }
        }
        rotate_block(g, sum_g, NULL, e->gate.svh + b);
        rotate_block(u, sum_u, NULL, e->up.svh + b);
        for (int j = 0; j < HAD; j++)
            a[j] = swiglu(g[j], u[j], job->act_limit);
        rotate_block(ex->scratch + ue->ad + i * inter + b, a, e->down.suh + b, NULL);
    }
}

static void phase_down(gemv_exec *ex, int unit)
{
    const gemv_job *job = ex->job;
    int part = unit % ex->parts_d;
    gemv_exec_expert *ue = &ex->experts[unit / ex->parts_d];
    const gemv_expert *e = &job->experts[ue->expert];
    int kt0 = part * ex->chunk_d;
    int kt1 = kt0 + ex->chunk_d < ex->rows_d ? kt0 + ex->chunk_d : ex->rows_d;
    float *acc = ex->scratch + ue->part_d + (size_t)part * ue->m * (size_t)job->hidden;
    ex->tiles(e->down.trellis, job->hidden / 16, job->k2, kt0, kt1, ex->scratch + ue->ad,
              job->inter, ue->m, acc);
}

static void phase_combine(gemv_exec *ex, int unit)
{
    const gemv_job *job = ex->job;
    size_t hid = (size_t)job->hidden;
    int b = unit * HAD;
    for (int r = 0; r < job->num_rows; r++)
        memset(job->out + r * hid + b, 0, HAD * sizeof(float));
    float sum[HAD], y[HAD];
    for (int u = 0; u < ex->num_experts; u++) {
        gemv_exec_expert *ue = &ex->experts[u];
        const gemv_expert *e = &job->experts[ue->expert];
        size_t m_hid = (size_t)ue->m * hid;
        for (int i = 0; i < ue->m; i++) {
            for (int j = 0; j < HAD; j++)
                sum[j] = 0.0f;
            for (int p = 0; p < ex->parts_d; p++) {
                const float *pd = ex->scratch + ue->part_d + p * m_hid + i * hid + b;
                for (int j = 0; j < HAD; j++)
                    sum[j] += pd[j];
            }
            rotate_block(y, sum, NULL, e->down.svh + b);
            float *out = job->out + (size_t)ue->rows[i] * hid + b;
            for (int j = 0; j < HAD; j++)
                out[j] += ue->weights[i] * y[j];
        }
    }
}

void gemv_exec_phase(gemv_exec *ex, int phase)
{
    static void (*const run[GEMV_NUM_PHASES])(gemv_exec *, int) = {
        phase_prep, phase_gate_up, phase_act, phase_down, phase_combine};
    for (;;) {
        int unit = atomic_fetch_add_explicit(&ex->next_unit[phase], 1, memory_order_relaxed);
        if (unit >= ex->units[phase])
            return;
        run[phase](ex, unit);
    }
}
