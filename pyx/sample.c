// Token sampling: see sample.h for the semantics.
#include "sample.h"

#include <math.h>

static int64_t argmax_row(const float *row, int64_t vocab) {
    int64_t best = 0;
    float top = row[0];
    if (isnan(top)) return 0;
    for (int64_t i = 1; i < vocab; i++) {
        float v = row[i];
        if (v > top) {
            top = v;
            best = i;
        } else if (isnan(v)) {
            return i;
        }
    }
    return best;
}

static inline double weight(float logit, double inv_t, double top, double min_p) {
    double e = exp((double)logit * inv_t - top);
    return e < min_p ? 0.0 : e;
}

static int64_t draw_row(const float *row, int64_t vocab, double temperature, double min_p,
                        double u) {
    const double inv_t = 1.0 / temperature;
    double top = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) {
        double x = (double)row[i] * inv_t;
        if (x > top) top = x;
    }
    if (!isfinite(top)) return argmax_row(row, vocab);
    // weights relative to the top token's (exp(0) = 1), so min_p is the cut as it is
    double total = 0.0;
    for (int64_t i = 0; i < vocab; i++) total += weight(row[i], inv_t, top, min_p);
    if (!(total > 0.0)) return argmax_row(row, vocab);  // a NaN logit
    const double target = u * total;
    double running = 0.0;
    for (int64_t i = 0; i < vocab; i++) {
        running += weight(row[i], inv_t, top, min_p);
        if (running > target) return i;
    }
    // rounding left the target at the very top: the last token with any weight
    for (int64_t i = vocab - 1; i > 0; i--)
        if (weight(row[i], inv_t, top, min_p) > 0.0) return i;
    return 0;
}

int g53_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                    const double *temperature, const double *min_p, const double *u,
                    int64_t *out) {
    if (rows < 0 || vocab < 1 || row_stride < vocab) return G53_SAMPLE_E_ARG;
    if (rows == 0) return G53_SAMPLE_OK;
    if (!logits || !temperature || !min_p || !u || !out) return G53_SAMPLE_E_ARG;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = logits + r * row_stride;
        out[r] = temperature[r] > 0.0 ? draw_row(row, vocab, temperature[r], min_p[r], u[r])
                                      : argmax_row(row, vocab);
    }
    return G53_SAMPLE_OK;
}

int g53_penalize_row(float *row, int64_t vocab, const int64_t *ids, const int64_t *counts,
                     int64_t n, double presence, double frequency, double repetition) {
    if (n < 0) return G53_SAMPLE_E_ARG;
    if (n == 0) return G53_SAMPLE_OK;
    if (!row || !ids || !counts) return G53_SAMPLE_E_ARG;
    for (int64_t k = 0; k < n; k++) {
        int64_t id = ids[k];
        if (id < 0 || id >= vocab) return G53_SAMPLE_E_ARG;
        double x = row[id];
        if (repetition != 1.0) x = x > 0.0 ? x / repetition : x * repetition;
        if (counts[k] > 0) x -= (double)counts[k] * frequency + presence;
        row[id] = (float)x;
    }
    return G53_SAMPLE_OK;
}
