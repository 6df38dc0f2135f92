// Multi-buffer SHA-256 (FIPS 180-4): independent messages hashed side by side, one per 32-bit
// lane of an AVX-512 register, 16 at a time. The digests are ordinary SHA-256 digests, equal to
// OpenSSL's or hashlib's for the same bytes; only the speed differs. One SHA-256 is a serial chain
// of rounds, so a single message cannot use wide vectors; sixteen messages can: on a CPU with
// AVX-512 this hashes about twice the bytes per CPU-second of OpenSSL with the SHA extensions
// (bench/micro_sha256.py measures both). The store hashes whole records, many of the same size,
// so it always has sixteen messages to hand.
//
// Messages may differ in length: shorter ones finish early and their lanes idle (masked) while
// the longer ones go on; fewer than 16 messages leave lanes idle too. Both cost speed, not
// correctness. Threading: no shared state; call from any number of threads at once, without the
// GIL. Requires AVX-512F and AVX-512BW at run time (g53_sha256_lanes says whether they are
// there); callers without them hash with OpenSSL instead.
#ifndef GLM53_SHA256MB_H
#define GLM53_SHA256MB_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define G53_SHA256_DIGEST_BYTES 32
#define G53_SHA256_MAX_LANES 16

// Messages hashed at once on this CPU: 16 with AVX-512F and AVX-512BW, 0 without them.
int g53_sha256_lanes(void);

// digests (n * 32 bytes) receives the SHA-256 of each message data[i][0 .. lengths[i]). Any
// n >= 0; messages are taken 16 at a time in the order given. Returns 0, -EINVAL for n < 0, or
// -ENOTSUP when this CPU cannot run the kernel (g53_sha256_lanes() == 0).
int g53_sha256_many(const uint8_t *const *data, const uint64_t *lengths, int n, uint8_t *digests);

// The AVX-512 implementation behind g53_sha256_many; call only where g53_sha256_lanes() > 0.
void g53_sha256_many_avx512(const uint8_t *const *data, const uint64_t *lengths, int n,
                            uint8_t *digests);

#ifdef __cplusplus
}
#endif

#endif
