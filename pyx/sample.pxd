# The C API of token sampling (pyx/sample.h), callable without the GIL.
# A Cython module that cimports this must link the g53sample static library.
from libc.stdint cimport int64_t


cdef extern from "sample.h" nogil:
    enum:
        G53_SAMPLE_OK
        G53_SAMPLE_E_ARG

    int g53_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride,
                        const double *temperature, const double *min_p, const double *u,
                        int64_t *out)

    int g53_penalize_row(float *row, int64_t vocab, const int64_t *ids, const int64_t *counts,
                         int64_t n, double presence, double frequency, double repetition)
