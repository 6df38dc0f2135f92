# Token sampling: the Python door to pyx/sample.c (the semantics are in pyx/sample.h).
#
# It runs on the engine thread between two steps, with caches cold after the wait for the step,
# so the per-row loop is compiled here rather than run as Python, the array is read through one
# buffer request rather than a typed memoryview (a memoryview object and format parsing), and a
# step of up to 64 rows keeps its parameters on the stack.
from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from sample cimport *

import numpy as np

# How sample_rows treats a row, by its sampler's `mode`.
cdef enum:
    _GREEDY = 0  # the argmax
    _PLAIN = 1  # a draw with temperature and min_p, in C
    _FILTERED = 2  # the sampler's own draw_filtered(row) (top_k / top_p need a sort)
GREEDY, PLAIN, FILTERED = _GREEDY, _PLAIN, _FILTERED

# Rows x vocab from which the GIL is released during the call (a millisecond or more of passes,
# time the event loop can use). Below it the GIL is kept: the event loop is often busy with the
# last step's tokens then, and taking the GIL back from it can cost this thread a switch interval.
cdef int64_t _NOGIL_ELEMENTS = 1 << 20
cdef enum:
    _STACK_ROWS = 64


def sample_rows(logits, samplers):
    """One token id per row of `logits` [rows, vocab] (float32; anything else is converted),
    row r drawn by samplers[r], which has `mode` (GREEDY, PLAIN or FILTERED) and, as its mode
    needs, `temperature`, `min_p` and `uniform()` (PLAIN: the token at uniform() in [0, 1) of the
    inverse CDF of softmax(row / temperature) without the tokens below min_p times the top one's
    probability) or `draw_filtered(row)` (FILTERED: returns the token id)."""
    cdef Py_buffer view
    if not _float32_rows(logits, &view):
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        if not _float32_rows(logits, &view):
            raise ValueError(f"logits must be 2-D [rows, vocab], got shape {np.shape(logits)}")
    try:
        return _sample(logits, &view, samplers)
    finally:
        PyBuffer_Release(&view)


cdef bint _float32_rows(obj, Py_buffer *view) except -1:
    """Fills `view` (release it) if obj exports C-contiguous 2-D native float32, else False."""
    try:
        PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
    except (TypeError, ValueError, BufferError):
        return False
    cdef const char *fmt = view.format
    if fmt[0] == c'@' or fmt[0] == c'=':
        fmt += 1
    if view.ndim == 2 and view.itemsize == 4 and fmt[0] == c'f' and fmt[1] == 0:
        return True
    PyBuffer_Release(view)
    return False


cdef list _sample(array, Py_buffer *view, samplers):
    cdef int64_t rows = view.shape[0], vocab = view.shape[1], r
    if len(samplers) != rows:
        raise ValueError(f"logits has {rows} rows for {len(samplers)} streams")
    if rows == 0:
        return []
    if vocab < 1:
        raise ValueError("logits has no columns")
    cdef double stack_params[3 * _STACK_ROWS]
    cdef int64_t stack_out[_STACK_ROWS]
    cdef double *params = stack_params
    cdef int64_t *out = stack_out
    cdef const float *data = <const float *>view.buf
    cdef int rc
    cdef long mode
    cdef bint any_filtered = False
    if rows > _STACK_ROWS:
        params = <double *>malloc(<size_t>rows * 3 * sizeof(double))
        out = <int64_t *>malloc(<size_t>rows * sizeof(int64_t))
    try:
        if params == NULL or out == NULL:
            raise MemoryError()
        for r in range(rows):
            sampler = samplers[r]
            mode = sampler.mode
            if mode == _PLAIN:
                params[r] = sampler.temperature
                params[rows + r] = sampler.min_p
                params[2 * rows + r] = sampler.uniform()
            else:  # greedy; a FILTERED row's argmax is replaced below
                params[r] = 0.0
                params[rows + r] = 0.0
                params[2 * rows + r] = 0.0
                any_filtered = any_filtered or mode == _FILTERED
        if rows * vocab >= _NOGIL_ELEMENTS:
            with nogil:
                rc = g53_sample_rows(data, rows, vocab, vocab, params, params + rows,
                                     params + 2 * rows, out)
        else:
            rc = g53_sample_rows(data, rows, vocab, vocab, params, params + rows,
                                 params + 2 * rows, out)
        if rc != G53_SAMPLE_OK:
            raise ValueError(f"g53_sample_rows failed ({rc}) for {rows} x {vocab} logits")
        tokens = [out[r] for r in range(rows)]
    finally:
        if rows > _STACK_ROWS:
            free(params)
            free(out)
    if any_filtered:
        for r in range(rows):
            sampler = samplers[r]
            if sampler.mode == _FILTERED:
                tokens[r] = sampler.draw_filtered(array[r])
    return tokens


def penalize_row(float[::1] row, const int64_t[::1] ids, const int64_t[::1] counts, int64_t n,
                 double presence, double frequency, double repetition):
    """Apply repetition, frequency and presence penalties to `row` (float32 [vocab], in place)
    for the first n of `ids` (int64, distinct token ids the stream has seen) with `counts`
    (int64, occurrences in its output; 0 = prompt only). Semantics in pyx/sample.h."""
    if n < 0 or n > ids.shape[0] or n > counts.shape[0]:
        raise ValueError(f"n ({n}) must be in 0..{min(ids.shape[0], counts.shape[0])}")
    if n == 0:
        return
    cdef int rc = g53_penalize_row(&row[0], row.shape[0], &ids[0], &counts[0], n, presence,
                                   frequency, repetition)
    if rc != G53_SAMPLE_OK:
        raise ValueError(f"a token id among the first {n} is outside [0, {row.shape[0]})")
