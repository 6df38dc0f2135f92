/* gemv_fast.h: the fast (inexact) tile kernels' arithmetic, shared by every variant (internal to
 * the CPU lane; see gemv.h and gemv_kern.h).
 *
 * The exact kernels decode each weight to its fp16 value and multiply in fp32. The fast ones keep
 * everything up to the product in integers:
 *   - the codebook is not rounded: w = KINV * s + C0 = KINV * (s - 510) + C0P, with s the byte sum
 *     of the mul1 product (0..1020), so no weight is ever converted to a float;
 *   - each 128-row block of a rotated input row is quantised to int16, q = rint(x * 16383 / amax),
 *     dequantised with scale = amax / 16383;
 *   - per tile row (16 inputs) and column, the int32 sum of q * s (exact: |sum| < 2^28) is centred
 *     by 510 * sum(q), converted once, and added with the block scale:
 *         acc[c] = fma(scale, float(sum q s - 510 sum q), acc[c]),   sx = fma(scale, float(sum q), sx)
 *     and at the end  out[c] = fma(KINV, acc[c], C0P * sx).
 * Every variant performs these float operations in this order, so the fast kernels agree with the
 * scalar one bit for bit (tests/test_gemv.py). Against the fp16-weight result the error is that of
 * the codebook's rounding (about 3e-4 of a linear's output, relative) plus the int16 step (about
 * 5e-5); tests/gpu/test_gemv_fast_gpu.py checks that a whole expert stays within exllamav3's GPU
 * kernel's own error against the same fp64 reference.
 */
#ifndef GLM53_GEMV_FAST_H
#define GLM53_GEMV_FAST_H

#include <math.h>
#include <stdint.h>

#include "gemv_kern.h"

#define GEMV_FAST_QMAX 16383.0f                /* int16 range used: 128 rows * 16383 * 1020 < 2^31 */
#define GEMV_FAST_CENTRE 510                   /* s - 510 keeps the float sums free of cancellation */
#define GEMV_FAST_C0P (-476.0f / 262144.0f)    /* C0 + 510 * KINV, exact */

/* Quantise the 128 inputs of one block: q[0..128), returns the scale (0 for an all-zero block). */
static inline float gemv_fast_quantise(const float *x, int16_t *q)
{
    float amax = 0.0f;
    for (int j = 0; j < 128; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    if (!(amax > 0.0f)) {
        for (int j = 0; j < 128; j++)
            q[j] = 0;
        return 0.0f;
    }
    float inv = GEMV_FAST_QMAX / amax;
    for (int j = 0; j < 128; j++)
        q[j] = (int16_t)lrintf(x[j] * inv);
    return amax / GEMV_FAST_QMAX;
}

#endif
