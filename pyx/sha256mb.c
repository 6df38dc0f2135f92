// Multi-buffer SHA-256: run-time dispatch (this file has no SIMD flags). See sha256mb.h.
#include "sha256mb.h"

#include <errno.h>

int g53_sha256_lanes(void) {
    __builtin_cpu_init();
    // libgcc also checks that the OS saves the AVX-512 registers (XCR0)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return G53_SHA256_MAX_LANES;
    return 0;
}

int g53_sha256_many(const uint8_t *const *data, const uint64_t *lengths, int n, uint8_t *digests) {
    if (n < 0) return -EINVAL;
    if (g53_sha256_lanes() == 0) return -ENOTSUP;
    g53_sha256_many_avx512(data, lengths, n, digests);
    return 0;
}
