# C API of the glm53 CUDA library (cuda/glm53_cuda.h), callable without the GIL.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

cdef extern from "glm53_cuda.h" nogil:
    int G53_EC_MAX_PICKS
    ctypedef struct g53_ec:
        pass
    int g53_ec_route(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int admit,
                     uintptr_t stream)
    int g53_ec_copy(g53_ec *ec, int n_blocks, uintptr_t stream)
    int g53_ec_reset_tables(g53_ec *ec, uintptr_t stream)
    int g53_ec_stage(g53_ec *ec, int layer, uint8_t *buf, int buf_slots, int64_t *job_src,
                     int64_t *job_dst, int32_t *n_jobs, uintptr_t stream)
    int g53_ec_unstage(g53_ec *ec, int layer, uintptr_t stream)
    int g53_ec_stage_layer(g53_ec *ec, int layer, uint8_t *buf, int count, uintptr_t stream)
    int g53_memcpy_async(void *dst, const void *src, size_t nbytes, uintptr_t stream)
    int g53_copy_jobs(const int64_t *job_src, const int64_t *job_dst, const int32_t *n_jobs,
                      int64_t nbytes, int n_blocks, uintptr_t stream)
    int g53_ec_check_homes(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int64_t absent,
                           uint64_t *bad, uintptr_t stream)
    int g53_ec_point_picks(g53_ec *ec, const int64_t *sel, int n_sel, int layer, int64_t absent,
                           uintptr_t stream)
    int g53_host_register(void *ptr, size_t nbytes)
    int g53_host_unregister(void *ptr)
    int g53_host_device_pointer(void *ptr, uintptr_t *dev_ptr)
    int g53_stream_sync(uintptr_t stream)
    const char *g53_cuda_strerror(int code)
    int g53_ec_layout(int64_t *offsets, int cap)


# The fast-mode hand-off's device side (cuda/lane_cuda.h; not yet run on a GPU).
cdef extern from "lane_cuda.h" nogil:
    ctypedef struct g53_lane_dev:
        pass
    int g53_lane_publish(g53_lane_dev *dev, int64_t *sel, uint16_t *rw, const uint16_t *x,
                         int n_rows, int top_k, int hidden, int64_t x_stride,
                         const int32_t *key_slot, uint32_t *key_score,
                         const int32_t *key_lane, int key_base, int n_experts,
                         int64_t *orig_sel, uint16_t *orig_w, int layer, uintptr_t stream)
    int g53_lane_wait(g53_lane_dev *dev, const float *out, int n_rows, int hidden,
                      int64_t out_stride, float *acc, int64_t *fb_sel, uint16_t *fb_w,
                      const int64_t *orig_sel, const uint16_t *orig_w, int64_t budget_ns,
                      uintptr_t stream)
    int g53_lane_select(g53_lane_dev *dev, float *out, const float *acc, int n_rows, int hidden,
                        int64_t out_stride, uintptr_t stream)
    int g53_lane_dev_layout(int64_t *offsets, int cap)
    int g53_lane_mbox_layout(int hidden, int64_t *offsets, int cap)
