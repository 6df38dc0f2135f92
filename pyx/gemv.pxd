# The C API of the CPU expert lane (pyx/gemv.h), for Cython modules that drive it without the GIL
# (the host controller). Link the g53gemv static libraries. A pool made by glm53._gemv.Pool is
# reachable as <gemv_pool *><uintptr_t>pool.handle while the Pool object is alive.
from libc.stddef cimport size_t
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t


cdef extern from "gemv.h" nogil:
    enum:
        GEMV_MAX_ROWS
        GEMV_MAX_PICKS
        GEMV_MSG_BYTES

    enum:
        GEMV_SCALAR
        GEMV_AVX2
        GEMV_AVX512
        GEMV_AVX512_FP16
        GEMV_NUM_VARIANTS
        GEMV_BEST

    enum:
        GEMV_EXACT
        GEMV_FAST
        GEMV_NUM_PRECISIONS

    enum:
        GEMV_OK
        GEMV_EINVAL
        GEMV_ENOSYS
        GEMV_ENOMEM
        GEMV_EBUSY
        GEMV_EPENDING

    ctypedef struct gemv_matrix:
        const uint8_t *trellis
        const uint16_t *suh
        const uint16_t *svh

    ctypedef struct gemv_expert:
        gemv_matrix gate
        gemv_matrix up
        gemv_matrix down

    ctypedef struct gemv_pick:
        int32_t row
        int32_t expert
        float weight

    ctypedef struct gemv_job:
        int32_t hidden
        int32_t inter
        int32_t k2
        float act_limit
        int32_t variant
        int32_t precision
        const gemv_expert *experts
        int32_t num_experts
        const float *x
        int32_t num_rows
        const gemv_pick *picks
        int32_t num_picks
        float *out
        volatile uint32_t *done
        uint32_t seq
        int32_t status

    ctypedef struct gemv_pool:
        pass

    const char *gemv_variant_name(int variant)
    const char *gemv_precision_name(int precision)
    int gemv_variant_supported(int variant)
    int gemv_kernel_supported(int variant, int precision)
    int gemv_best_variant()
    int gemv_job_check(const gemv_job *job, char *msg, size_t msg_len)

    gemv_pool *gemv_pool_create(const int *cpus, int num_threads, char *msg, size_t msg_len)
    void gemv_pool_destroy(gemv_pool *pool)
    int gemv_pool_threads(const gemv_pool *pool)
    int gemv_pool_set_idle_spin(gemv_pool *pool, long ns)
    long gemv_pool_idle_spin(gemv_pool *pool)
    int gemv_pool_submit(gemv_pool *pool, gemv_job *job, char *msg, size_t msg_len)
    int gemv_pool_wait(gemv_pool *pool, gemv_job *job)

    enum:
        GEMV_CALLER_WAITS
        GEMV_CALLER_HELPS
        GEMV_CALLER_RUNS_ALL

    int gemv_pool_run_batch(gemv_pool *pool, gemv_job *jobs, int num_jobs, int caller, char *msg,
                            size_t msg_len)


cdef extern from "gemv_kern.h" nogil:
    ctypedef void (*gemv_tiles_fn)(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                                   const float *xh, int x_stride, int m, float *acc)
    gemv_tiles_fn gemv_kernel(int variant, int precision)
    gemv_tiles_fn gemv_kernel_previous(int variant, int precision)
    void gemv_tiles_scalar(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                           const float *xh, int x_stride, int m, float *acc)
    void gemv_tiles_avx2(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                         const float *xh, int x_stride, int m, float *acc)
    void gemv_tiles_avx512(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                           const float *xh, int x_stride, int m, float *acc)
    void gemv_tiles_avx512fp16(const uint8_t *trellis, int n_tiles, int k2, int kt0, int kt1,
                               const float *xh, int x_stride, int m, float *acc)
