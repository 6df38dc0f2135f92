# The C API of the O_DIRECT batch reader/writer (pyx/odirect.h), callable without the GIL.
# A Cython module that cimports this must link the g53odirect static library.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "odirect.h" nogil:
    enum:
        G53_OD_DEFAULT_PIECE_BYTES
        G53_OD_MIN_ALIGNMENT
        G53_OD_MAX_THREADS
        G53_OD_MAX_PIECE_BYTES

    enum:
        G53_OD_READ
        G53_OD_WRITE

    enum:
        G53_OD_DEMAND
        G53_OD_PREFETCH

    enum:
        G53_OD_PENDING
        G53_OD_OK
        G53_OD_FAILED

    enum:
        G53_OD_NO_COMPLETION

    ctypedef struct g53_od:
        pass

    ctypedef struct g53_od_config:
        int mode
        int num_threads
        uint64_t piece_bytes
        int truncate

    ctypedef struct g53_od_request:
        uint64_t offset
        uint64_t length
        void *addr
        uint64_t tag
        uint32_t *done_word
        int32_t priority
        uint32_t options

    ctypedef struct g53_od_completion:
        uint64_t tag
        int32_t status
        uint32_t reserved
        uint64_t error_offset

    int g53_od_open(const char *path, const g53_od_config *config, g53_od **out)
    int g53_od_submit(g53_od *od, const g53_od_request *requests, int num_requests)
    int g53_od_wait(g53_od *od, int min_count, int64_t timeout_ns, g53_od_completion *out,
                    int max_out)
    int g53_od_poll(g53_od *od, g53_od_completion *out, int max_out)
    void g53_od_shutdown(g53_od *od, int cancel)
    void g53_od_free(g53_od *od)
    uint64_t g53_od_alignment(const g53_od *od)
    uint64_t g53_od_piece_bytes(const g53_od *od)
    int g53_od_num_threads(const g53_od *od)
    int g53_od_num_in_flight(g53_od *od)
    int g53_od_preallocate(g53_od *od, uint64_t offset, uint64_t length)
    int g53_od_sync(g53_od *od)
    int g53_od_probe_file(const char *path)
    int g53_od_probe_dir(const char *probe_path)
