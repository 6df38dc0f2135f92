#!/bin/sh
# Check the fast AVX-512 tile kernels (pyx/gemv_avx512_fast.c, and the previous one kept for A/B,
# gemv_avx512_fast_v1.c) on a CPU without AVX-512: compile each against SIMDe's portable AVX-512
# (apt install libsimde-dev) and compare it bit for bit with the scalar fast kernel, the twin it
# must equal, over every rate, 1..8 rows and partial tile-row ranges. tests/test_gemv_fast.py runs the real instructions where the CPU has them; this is for
# editing the kernel on a machine that has not. Three intrinsics SIMDe 0.7 lacks are written out
# below, and its fused multiply-add is replaced by fmaf (SIMDe rounds a*b+c twice).
#   sh tools/check_gemv_avx512_emulated.sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -f /usr/include/simde/x86/avx512.h ] || { echo "needs SIMDe: apt install libsimde-dev" >&2; exit 2; }
cat > "$work/prelude.h" <<'C'
#include <math.h>
#include <string.h>
#include <simde/x86/avx512.h>
static inline simde__m512i simde_mm512_maskz_loadu_epi8(simde__mmask64 k, const void *p)
{
    uint8_t b[64] = {0};
    for (int i = 0; i < 64; i++)
        if ((k >> i) & 1)
            b[i] = ((const uint8_t *)p)[i];
    simde__m512i r;
    memcpy(&r, b, 64);
    return r;
}
static inline simde__m512i simde_mm512_mulhi_epu16(simde__m512i a, simde__m512i b)
{
    uint16_t x[32], y[32];
    memcpy(x, &a, 64), memcpy(y, &b, 64);
    for (int i = 0; i < 32; i++)
        x[i] = (uint16_t)(((uint32_t)x[i] * y[i]) >> 16);
    memcpy(&a, x, 64);
    return a;
}
static inline simde__m512 simde_mm512_cvtepi32_ps(simde__m512i a)
{
    int32_t x[16];
    float y[16];
    memcpy(x, &a, 64);
    for (int i = 0; i < 16; i++)
        y[i] = (float)x[i];
    simde__m512 r;
    memcpy(&r, y, 64);
    return r;
}
static inline simde__m512 fused_fmadd(simde__m512 a, simde__m512 b, simde__m512 c)
{
    float x[16], y[16], z[16];
    memcpy(x, &a, 64), memcpy(y, &b, 64), memcpy(z, &c, 64);
    for (int i = 0; i < 16; i++)
        z[i] = fmaf(x[i], y[i], z[i]);
    memcpy(&c, z, 64);
    return c;
}
#undef simde_mm512_fmadd_ps
#define simde_mm512_fmadd_ps fused_fmadd
C
for name in avx512_fast avx512_fast_v1; do
    sed -e 's|#include <immintrin.h>|#include "prelude.h"|' -e 's/\b_mm512_/simde_mm512_/g' \
        -e 's/\b__m512i\b/simde__m512i/g' -e 's/\b__m512\b/simde__m512/g' \
        -e 's/\b__mmask64\b/simde__mmask64/g' "$root/pyx/gemv_$name.c" > "$work/$name.c"
done
cat > "$work/main.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gemv_kern.h"
int main(void)
{
    static const int rates[] = {2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16};
    int cases = 0, bad = 0;
    srand(7);
    for (int r = 0; r < 11; r++)
        for (int m = 1; m <= 8; m++, cases++) {
            int k2 = rates[r], kt = 16, nt = 4, kt0 = m % 3, kt1 = 16 - m % 4;
            size_t bytes = (size_t)kt * nt * 16 * k2;
            uint8_t *trellis = malloc(bytes);
            float *x = malloc(sizeof(float) * m * 16 * kt), a[8 * 64], b[8 * 64];
            for (size_t i = 0; i < bytes; i++)
                trellis[i] = (uint8_t)rand();
            for (int i = 0; i < m * 16 * kt; i++)
                x[i] = ((float)rand() / RAND_MAX - 0.5f) * (float)(1 + i % 7);
            gemv_tiles_scalar_fast(trellis, nt, k2, kt0, kt1, x, 16 * kt, m, a);
            KERNEL(trellis, nt, k2, kt0, kt1, x, 16 * kt, m, b);
            if (memcmp(a, b, sizeof(float) * m * 16 * nt)) {
                bad++;
                printf("k2 %d, %d rows: differs from the scalar fast kernel\n", k2, m);
            }
            free(trellis), free(x);
        }
    printf("%s (SIMDe) vs scalar fast: %d of %d cases bit-identical\n", NAME, cases - bad, cases);
    return bad != 0;
}
C
flags="-O2 -ffp-contract=off -fno-strict-aliasing -Wno-psabi -I$root/pyx -I$work"
cc $flags -c "$root/pyx/gemv_scalar.c" -o "$work/scalar.o"
status=0
for name in avx512_fast avx512_fast_v1; do
    cc $flags -c "$work/$name.c" -o "$work/$name.o"
    cc $flags -DKERNEL="gemv_tiles_$name" -DNAME="\"$name\"" "$work/main.c" "$work/scalar.o" \
        "$work/$name.o" -o "$work/check_$name" -lm -lpthread
    "$work/check_$name" || status=1
done
exit $status
