// Token sampling from a step's logits, one row per stream: argmax or a draw from the softmax.
//
// The scheduler samples every stream between two engine steps, on the engine thread, so this
// is on every token's critical path, and it runs with caches cold after the wait for the step:
// there numpy's dozen calls per row cost 50-250 us a token on a busy 2-core host (see
// glm53/engine/sampling.py).
//
// Semantics of one row r (the Python door is pyx/_sample.pyx; tests/test_scheduler_sampling.py
// checks the draw against the same arithmetic step by step in Python):
// - temperature[r] <= 0: greedy, the index of the first maximum; a NaN counts as the maximum,
//   as with numpy's argmax.
// - otherwise: x_i = logit_i * (1 / temperature[r]), e_i = exp(x_i - max_j x_j) (so the top token
//   has e = 1), e_i = 0 where e_i < min_p[r] (min_p drops tokens below that share of the top one),
//   and the token is the first i whose running sum of e exceeds u[r] * sum(e), u[r] in [0, 1):
//   the inverse CDF of softmax(x), the same draw as numpy's cumsum + searchsorted(side="right").
//   A row with a NaN or a +inf logit, or with every logit -inf, falls back to greedy.
// The draw reads the row three times (maximum, total, then the running sum up to the target)
// and allocates nothing. Threading: none inside, no GIL needed.
#ifndef G53_SAMPLE_H
#define G53_SAMPLE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    G53_SAMPLE_OK = 0,
    G53_SAMPLE_E_ARG = -2,  // NULL pointer, rows < 0, vocab < 1 or row_stride < vocab
};

// logits: rows x vocab float32, row r at logits + r * row_stride. temperature, min_p, u: one
// per row. out: one token id per row. Returns G53_SAMPLE_OK or a negative G53_SAMPLE_E_* code.
int g53_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                    const double *temperature, const double *min_p, const double *u,
                    int64_t *out);

// Penalties on one row of logits, in place, for the n distinct tokens ids[k] the stream has
// seen: counts[k] is how often ids[k] occurs in its output, 0 for a token only in its prompt.
// In order, as vLLM applies them: repetition (HF/vLLM: a logit > 0 is divided by `repetition`,
// any other multiplied by it; prompt and output tokens; 1 = off), then frequency and presence
// (OpenAI: logit -= counts[k] * frequency + presence, output tokens only; 0 = off).
// Returns G53_SAMPLE_OK, or G53_SAMPLE_E_ARG for a NULL pointer, n < 0 or an id outside
// [0, vocab) (the row is then left as far as it got).
int g53_penalize_row(float *row, int64_t vocab, const int64_t *ids, const int64_t *counts,
                     int64_t n, double presence, double frequency, double repetition);

#ifdef __cplusplus
}
#endif

#endif
