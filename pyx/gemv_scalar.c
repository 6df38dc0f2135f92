/* gemv_scalar.c: the portable tile kernel. One weight at a time, straight from the definition in
 * gemv_kern.h; slow (the variant says so in its name), the twin the SIMD kernels are tested
 * against, and the lane on CPUs without AVX2. */
#include <string.h>

#include "gemv_fast.h"

/* The byte sum (0..1020) of a 16-bit state's mul1 product. */
static int mul1_byte_sum(uint32_t state)
{
    uint32_t x = state * GEMV_MUL1_MULT;
    return (int)((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24));
}

/* The mul1 weight of a 16-bit state, as fp32 holding an fp16 value. */
static float mul1_weight(uint32_t state)
{
    float v = (float)mul1_byte_sum(state) * GEMV_MUL1_KINV + GEMV_MUL1_C0; /* exact in fp32 */
    float c = v * GEMV_SPLIT_FP16;
    float d = c - v;
    return c - d; /* rounded to fp16's precision (see gemv_kern.h) */
}

static uint32_t tile_state(const uint32_t *words, int k2, int t)
{
    int num_words = 4 * k2;
    int end = gemv_state_end(k2, t) + 128 * k2; /* biased by one ring so the start is >= 0 */
    int first = ((end - 16) / 32) % num_words;
    int last = ((end - 1) / 32) % num_words;
    int shift = ((end - 1) / 32 + 1) * 32 - end;
    uint64_t pair = ((uint64_t)words[first] << 32) | words[last];
    return (uint32_t)(pair >> shift) & 0xFFFF;
}

static void decode_tile(const uint8_t *tile, int k2, float w[16][16])
{
    int num_words = 4 * k2;
    uint32_t words[64];
    memcpy(words, tile, (size_t)num_words * 4); /* little-endian hosts only (x86-64) */
    for (int t = 0; t < 256; t++)
        w[gemv_tc_row(t)][gemv_tc_col(t)] = mul1_weight(tile_state(words, k2, t));
}

void gemv_tiles_scalar(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                       const float *xh, int x_stride, int m, float *acc)
{
    int n = 16 * n_tiles;
    size_t tile_bytes = (size_t)gemv_tile_bytes(k2);
    float w[16][16];
    memset(acc, 0, sizeof(float) * (size_t)m * (size_t)n);
    for (int kt = kt0; kt < kt1; kt++) {
        for (int nt = 0; nt < n_tiles; nt++) {
            decode_tile(trellis + ((size_t)kt * (size_t)n_tiles + (size_t)nt) * tile_bytes, k2, w);
            for (int i = 0; i < m; i++) {
                const float *x = xh + (size_t)i * (size_t)x_stride + 16 * kt;
                float *y = acc + (size_t)i * (size_t)n + 16 * nt;
                for (int r = 0; r < 16; r++)
                    for (int c = 0; c < 16; c++)
                        y[c] += x[r] * w[r][c];
            }
        }
    }
}

/* The fast (inexact) kernel, straight from the definition in gemv_fast.h: the twin the SIMD fast
 * kernels must equal bit for bit. */
void gemv_tiles_scalar_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                            const float *xh, int x_stride, int m, float *acc)
{
    int n = 16 * n_tiles;
    size_t tile_bytes = (size_t)gemv_tile_bytes(k2);
    int16_t q[GEMV_MAX_ROWS][128];
    float scale[GEMV_MAX_ROWS], sx[GEMV_MAX_ROWS];
    int qsum[GEMV_MAX_ROWS], s[16][16];
    uint32_t words[64];
    memset(acc, 0, sizeof(float) * (size_t)m * (size_t)n);
    for (int i = 0; i < m; i++)
        sx[i] = scale[i] = 0.0f;
    for (int kt = kt0, block = -1; kt < kt1; kt++) {
        if (kt / 8 != block) {
            block = kt / 8;
            for (int i = 0; i < m; i++)
                scale[i] = gemv_fast_quantise(xh + (size_t)i * (size_t)x_stride + 128 * block, q[i]);
        }
        for (int i = 0; i < m; i++) {
            qsum[i] = 0;
            for (int r = 0; r < 16; r++)
                qsum[i] += q[i][16 * (kt % 8) + r];
            sx[i] = fmaf(scale[i], (float)qsum[i], sx[i]);
        }
        for (int nt = 0; nt < n_tiles; nt++) {
            memcpy(words, trellis + ((size_t)kt * (size_t)n_tiles + (size_t)nt) * tile_bytes,
                   tile_bytes);
            for (int t = 0; t < 256; t++)
                s[gemv_tc_row(t)][gemv_tc_col(t)] = mul1_byte_sum(tile_state(words, k2, t));
            for (int i = 0; i < m; i++) {
                const int16_t *x = q[i] + 16 * (kt % 8);
                float *y = acc + (size_t)i * (size_t)n + 16 * nt;
                for (int c = 0; c < 16; c++) {
                    int32_t sum = 0;
                    for (int r = 0; r < 16; r++)
                        sum += x[r] * s[r][c];
                    y[c] = fmaf(scale[i], (float)(sum - GEMV_FAST_CENTRE * qsum[i]), y[c]);
                }
            }
        }
    }
    for (int i = 0; i < m; i++) {
        float offset = GEMV_FAST_C0P * sx[i];
        for (int c = 0; c < n; c++)
            acc[(size_t)i * (size_t)n + c] = fmaf(GEMV_MUL1_KINV, acc[(size_t)i * (size_t)n + c], offset);
    }
}
