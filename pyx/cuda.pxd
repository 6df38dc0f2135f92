# C API of the glm53 CUDA library (cuda/glm53_cuda.h), callable without the GIL.
from libc.stdint cimport int64_t, uintptr_t

cdef extern from "glm53_cuda.h" nogil:
    int G53_EC_MAX_PICKS
    ctypedef struct g53_ec:
        pass
    int g53_ec_route(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int admit,
                     uintptr_t stream)
    int g53_ec_copy(g53_ec *ec, int n_blocks, uintptr_t stream)
    int g53_ec_reset_tables(g53_ec *ec, uintptr_t stream)
    int g53_host_register(void *ptr, size_t nbytes)
    int g53_host_unregister(void *ptr)
    int g53_host_device_pointer(void *ptr, uintptr_t *dev_ptr)
    int g53_stream_sync(uintptr_t stream)
    const char *g53_cuda_strerror(int code)
    int g53_ec_layout(int64_t *offsets, int cap)
