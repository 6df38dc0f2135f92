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
