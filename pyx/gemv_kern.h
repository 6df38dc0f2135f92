/* gemv_kern.h: what the tile kernels share (internal to the CPU lane; see gemv.h).
 *
 * A tile kernel computes, for one EXL3 matrix (n = 16 n_tiles outputs) and the tile rows
 * kt0 <= kt < kt1, the partial product of m <= 8 rotated input rows:
 *     acc[i][c] = sum_kt sum_r xh[i][16 kt + r] * Wq[16 kt + r][c]        (acc overwritten)
 * with Wq the fp16 mul1 weights of the tiles. xh rows are x_stride floats apart, acc rows n.
 * Each variant lives in its own C file compiled with its own SIMD flags.
 *
 * Trellis geometry (exllamav3 exl3_dq.cuh): a tile is a ring of 128 k2 bits, read as 32-bit
 * little-endian words, most significant bit first. State t (0..255) is the 16-bit window that
 * ends at ring bit ((t + 1) k2) >> 1, and it sits at tile row/col gemv_tc_row/col(t).
 */
#ifndef GLM53_GEMV_KERN_H
#define GLM53_GEMV_KERN_H

#include <stdint.h>

#include "gemv.h"

typedef void (*gemv_tiles_fn)(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                              const float *xh, int x_stride, int m, float *acc);

void gemv_tiles_scalar(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                       const float *xh, int x_stride, int m, float *acc);
void gemv_tiles_avx2(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                     const float *xh, int x_stride, int m, float *acc);
void gemv_tiles_avx512(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                       const float *xh, int x_stride, int m, float *acc);
void gemv_tiles_avx512fp16(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                           const float *xh, int x_stride, int m, float *acc);
/* The tile kernel of a variant at a precision (gemv.h); the caller checks support. */
gemv_tiles_fn gemv_kernel(int variant, int precision);
/* The fast (inexact) kernels: unrounded codebook, int16 inputs (gemv_fast.h). */
void gemv_tiles_scalar_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                            const float *xh, int x_stride, int m, float *acc);
void gemv_tiles_avx2_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                          const float *xh, int x_stride, int m, float *acc);
void gemv_tiles_avx512_fast(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                            const float *xh, int x_stride, int m, float *acc);
/* The previous kernel of a variant at a precision, kept for same-process A/B benchmarks (never
 * dispatched to by a job); NULL where there is none. Today: the avx512 fast kernel of 2026-12-04. */
gemv_tiles_fn gemv_kernel_previous(int variant, int precision);
void gemv_tiles_avx512_fast_v1(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                               const float *xh, int x_stride, int m, float *acc);

#define GEMV_MUL1_MULT 0x83DCD12Du
/* mul1 weight = fp16(KINV * byte_sum + C0): the fp32 product and sum are exact (every term is a
 * multiple of 2^-18 below 16), and one rounding to fp16 reproduces the GPU's hfma bit for bit. */
#define GEMV_MUL1_KINV (1774.0f / 262144.0f) /* fp16 0x1eee */
#define GEMV_MUL1_C0 (-3.453125f)    /* 1024 * KINV + fp16 0xc931 */
/* Veltkamp split with 2^13 + 1 rounds an fp32 to fp16's 11 significant bits; for the 1021 mul1
 * values it equals round-to-nearest-even (checked exhaustively by the tests), and the values that
 * fall into fp16's subnormal range are multiples of 2^-18, which it leaves untouched. */
#define GEMV_SPLIT_FP16 8193.0f

static inline int gemv_tile_bytes(int k2) { return 16 * k2; }
static inline int gemv_state_end(int k2, int t) { return ((t + 1) * k2) >> 1; }
static inline int gemv_tc_row(int t)
{
    static const int rows[4] = {0, 1, 8, 9};
    return ((t >> 3) & 3) * 2 + rows[t & 3];
}
static inline int gemv_tc_col(int t) { return (t >> 5) + ((t & 4) ? 8 : 0); }

/* Stream byte q (bits 8q..8q+7, most significant first) lives at memory byte q ^ 3. */
static inline int gemv_stream_byte(int q) { return q ^ 3; }

#endif
