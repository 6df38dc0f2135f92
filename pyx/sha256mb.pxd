# The C API of the multi-buffer SHA-256 (pyx/sha256mb.h), callable without the GIL. A Cython
# module that cimports this must link the g53odirect and g53sha256_avx512 static libraries.
from libc.stdint cimport uint8_t, uint64_t


cdef extern from "sha256mb.h" nogil:
    enum:
        G53_SHA256_DIGEST_BYTES
        G53_SHA256_MAX_LANES

    int g53_sha256_lanes()
    int g53_sha256_many(const uint8_t *const *data, const uint64_t *lengths, int n,
                        uint8_t *digests)
