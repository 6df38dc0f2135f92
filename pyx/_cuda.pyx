# Thin launchers over the glm53 CUDA library: raw device addresses and streams in,
# a RuntimeError naming the operation out.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t

from cuda cimport (
    G53_EC_MAX_PICKS, g53_copy_jobs, g53_cuda_strerror, g53_ec, g53_ec_check_homes, g53_ec_copy,
    g53_ec_layout, g53_ec_point_picks, g53_ec_reset_tables, g53_ec_route, g53_ec_stage,
    g53_ec_stage_layer, g53_ec_unstage,
    g53_host_device_pointer, g53_host_register, g53_host_unregister, g53_memcpy_async,
    g53_stream_sync,
)
# the fast-mode hand-off (cuda/lane_cuda.h)
from cuda cimport (
    g53_lane_dev, g53_lane_dev_layout, g53_lane_mbox_layout, g53_lane_publish, g53_lane_select,
    g53_lane_wait,
)
from libc.stdint cimport uint16_t, uint32_t

MAX_PICKS = G53_EC_MAX_PICKS


cdef inline void _check(int rc, str op) except *:
    if rc != 0:
        raise RuntimeError(f"{op} failed: {g53_cuda_strerror(rc).decode()} (code {rc})")


def ec_route(uintptr_t ec, uintptr_t sel, int n_sel, int layer, bint admit, uintptr_t stream):
    """Route one MoE layer's picks through the device expert cache."""
    cdef int rc
    with nogil:
        rc = g53_ec_route(<g53_ec *> ec, <const int64_t *> sel, n_sel, layer, admit, stream)
    _check(rc, f"expert cache route (layer {layer}, {n_sel} picks)")


def ec_copy(uintptr_t ec, int n_blocks, uintptr_t stream):
    cdef int rc
    with nogil:
        rc = g53_ec_copy(<g53_ec *> ec, n_blocks, stream)
    _check(rc, "expert cache slot copy")


def ec_reset_tables(uintptr_t ec, uintptr_t stream):
    cdef int rc
    with nogil:
        rc = g53_ec_reset_tables(<g53_ec *> ec, stream)
    _check(rc, "expert cache table reset")


def ec_stage(uintptr_t ec, int layer, uintptr_t buf, int buf_slots, uintptr_t job_src,
             uintptr_t job_dst, uintptr_t n_jobs, uintptr_t stream):
    """Queue copies of a layer's uncached experts into a staging buffer; point tables there."""
    cdef int rc
    with nogil:
        rc = g53_ec_stage(<g53_ec *> ec, layer, <uint8_t *> buf, buf_slots, <int64_t *> job_src,
                          <int64_t *> job_dst, <int32_t *> n_jobs, stream)
    _check(rc, f"prefill staging of MoE layer {layer}")


def ec_stage_layer(uintptr_t ec, int layer, uintptr_t buf, int count, uintptr_t stream):
    """Point a layer's uncached experts e < count at a copy of the first `count` records of its
    home arena in buf."""
    cdef int rc
    with nogil:
        rc = g53_ec_stage_layer(<g53_ec *> ec, layer, <uint8_t *> buf, count, stream)
    _check(rc, f"staging the first {count} experts of MoE layer {layer}")


def memcpy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
    """cudaMemcpyAsync(cudaMemcpyDefault) on a stream: a copy engine moves the bytes."""
    cdef int rc
    with nogil:
        rc = g53_memcpy_async(<void *> dst, <const void *> src, nbytes, stream)
    _check(rc, f"async copy of {nbytes} bytes")


def ec_unstage(uintptr_t ec, int layer, uintptr_t stream):
    cdef int rc
    with nogil:
        rc = g53_ec_unstage(<g53_ec *> ec, layer, stream)
    _check(rc, f"unstaging MoE layer {layer}")


def copy_jobs(uintptr_t job_src, uintptr_t job_dst, uintptr_t n_jobs, int64_t nbytes,
              int n_blocks, uintptr_t stream):
    cdef int rc
    with nogil:
        rc = g53_copy_jobs(<const int64_t *> job_src, <const int64_t *> job_dst,
                           <const int32_t *> n_jobs, nbytes, n_blocks, stream)
    _check(rc, "staging copy")


def ec_check_homes(uintptr_t ec, uintptr_t sel, int n_sel, int layer, int64_t absent,
                   uintptr_t bad, uintptr_t stream):
    """nvme-exact, before route: count picks in no VRAM slot whose home is absent into *bad."""
    cdef int rc
    with nogil:
        rc = g53_ec_check_homes(<g53_ec *> ec, <const int64_t *> sel, n_sel, layer, absent,
                                <uint64_t *> bad, stream)
    _check(rc, f"home check of MoE layer {layer} ({n_sel} picks)")


def ec_point_picks(uintptr_t ec, uintptr_t sel, int n_sel, int layer, int64_t absent,
                   uintptr_t stream):
    """nvme-exact, after route and copy: point every pick's entries at its slot or its home."""
    cdef int rc
    with nogil:
        rc = g53_ec_point_picks(<g53_ec *> ec, <const int64_t *> sel, n_sel, layer, absent, stream)
    _check(rc, f"pointing MoE layer {layer}'s picks at their homes")


def host_register(uintptr_t ptr, size_t nbytes):
    cdef int rc
    with nogil:
        rc = g53_host_register(<void *> ptr, nbytes)
    if rc != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed: {g53_cuda_strerror(rc).decode()}. "
            "Pinning needs a high locked-memory limit: run with `ulimit -l unlimited` or set "
            "LimitMEMLOCK=infinity in the systemd unit."
        )


def host_unregister(uintptr_t ptr):
    _check(g53_host_unregister(<void *> ptr), "cudaHostUnregister")


def host_device_pointer(uintptr_t ptr):
    cdef uintptr_t dev = 0
    _check(g53_host_device_pointer(<void *> ptr, &dev), "cudaHostGetDevicePointer")
    return dev


def stream_sync(uintptr_t stream):
    cdef int rc
    with nogil:
        rc = g53_stream_sync(stream)
    _check(rc, "stream synchronize")


def ec_layout():
    """Byte offsets of the g53_ec fields in declaration order, then sizeof(g53_ec)."""
    cdef int64_t offs[64]
    cdef int n = g53_ec_layout(offs, 64)
    _check(0 if n > 0 else n, "g53_ec_layout")
    return [offs[i] for i in range(n)]


# --- fast mode's CPU-lane hand-off (cuda/lane.cu; NOT YET RUN ON A GPU) -----------------------

def lane_publish(uintptr_t dev, uintptr_t sel, uintptr_t rw, uintptr_t x, int n_rows, int top_k,
                 int hidden, int64_t x_stride, uintptr_t key_slot, uintptr_t key_score,
                 uintptr_t key_lane, int key_base, int n_experts, uintptr_t orig_sel,
                 uintptr_t orig_w, int layer, uintptr_t stream):
    """Publish a layer's coldest misses to its mailbox and mask them in the selection (see
    cuda/lane_cuda.h); key_slot / key_score / key_lane 0 for none (key_lane: nvme mode's
    key -> RAM slot, -1 where the RAM tier does not hold the key)."""
    cdef int rc
    with nogil:
        rc = g53_lane_publish(<g53_lane_dev *> dev, <int64_t *> sel, <uint16_t *> rw,
                              <const uint16_t *> x, n_rows, top_k, hidden, x_stride,
                              <const int32_t *> key_slot, <uint32_t *> key_score,
                              <const int32_t *> key_lane, key_base, n_experts,
                              <int64_t *> orig_sel, <uint16_t *> orig_w, layer, stream)
    _check(rc, f"lane publish (layer {layer}, {n_rows} rows x top-{top_k})")


def lane_wait(uintptr_t dev, uintptr_t out, int n_rows, int hidden, int64_t out_stride,
              uintptr_t acc, uintptr_t fb_sel, uintptr_t fb_w, uintptr_t orig_sel,
              uintptr_t orig_w, int64_t budget_ns, uintptr_t stream):
    """Bounded device-side wait for the lane's done; acc = out (+ the partial), fallback
    selection written (see cuda/lane_cuda.h)."""
    cdef int rc
    with nogil:
        rc = g53_lane_wait(<g53_lane_dev *> dev, <const float *> out, n_rows, hidden, out_stride,
                           <float *> acc, <int64_t *> fb_sel, <uint16_t *> fb_w,
                           <const int64_t *> orig_sel, <const uint16_t *> orig_w, budget_ns,
                           stream)
    _check(rc, f"lane wait ({n_rows} rows)")


def lane_select(uintptr_t dev, uintptr_t out, uintptr_t acc, int n_rows, int hidden,
                int64_t out_stride, uintptr_t stream):
    """out = acc unless the last wait timed out."""
    cdef int rc
    with nogil:
        rc = g53_lane_select(<g53_lane_dev *> dev, <float *> out, <const float *> acc, n_rows,
                             hidden, out_stride, stream)
    _check(rc, f"lane select ({n_rows} rows)")


def lane_dev_layout():
    """Byte offsets of the g53_lane_dev fields in declaration order, then sizeof(g53_lane_dev)."""
    cdef int64_t offs[16]
    cdef int n = g53_lane_dev_layout(offs, 16)
    _check(0 if n > 0 else n, "g53_lane_dev_layout")
    return [offs[i] for i in range(n)]


def lane_mbox_layout(int hidden):
    """The mailbox offsets compiled into the CUDA library: seq, done, budget, picks, rows,
    partial, bytes."""
    cdef int64_t offs[16]
    cdef int n = g53_lane_mbox_layout(hidden, offs, 16)
    _check(0 if n > 0 else n, "g53_lane_mbox_layout")
    return [offs[i] for i in range(n)]
