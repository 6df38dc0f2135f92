/* gemv_scalar.c: the portable tile kernel. One weight at a time, straight from the definition in
 * gemv_kern.h; slow (the variant says so in its name), the twin the SIMD kernels are tested
 * against, and the lane on CPUs without AVX2. */
#include <string.h>

#include "gemv_kern.h"

/* The mul1 weight of a 16-bit state, as fp32 holding an fp16 value. */
static float mul1_weight(uint32_t state)
{
    uint32_t x = state * GEMV_MUL1_MULT;
    int byte_sum = (int)((x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24));
    float v = (float)byte_sum * GEMV_MUL1_KINV + GEMV_MUL1_C0; /* exact in fp32 */
    float c = v * GEMV_SPLIT_FP16;
    float d = c - v;
    return c - d; /* rounded to fp16's precision (see gemv_kern.h) */
}

static void decode_tile(const uint8_t *tile, int k2, float w[16][16])
{
    int num_words = 4 * k2;
    uint32_t words[64];
    memcpy(words, tile, (size_t)num_words * 4); /* little-endian hosts only (x86-64) */
    for (int t = 0; t < 256; t++) {
        int end = gemv_state_end(k2, t) + 128 * k2; /* biased by one ring so the start is >= 0 */
        int first = ((end - 16) / 32) % num_words;
        int last = ((end - 1) / 32) % num_words;
        int shift = ((end - 1) / 32 + 1) * 32 - end;
        uint64_t pair = ((uint64_t)words[first] << 32) | words[last];
        uint32_t state = (uint32_t)(pair >> shift) & 0xFFFF;
        w[gemv_tc_row(t)][gemv_tc_col(t)] = mul1_weight(state);
    }
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
