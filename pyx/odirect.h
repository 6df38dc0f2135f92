// O_DIRECT batch reader/writer over one file.
//
// A g53_od opens one file with O_DIRECT (read: O_RDONLY; write: O_WRONLY | O_CREAT) and runs a
// pool of pthreads that serve two FIFO queues of requests, demand before prefetch. A request is
// (file offset, length, caller address, tag); it is split into pieces of piece_bytes (default
// 2 MiB) so that one large record is read by several threads at once. The thread that finishes
// the last piece completes the request: it stores the request's done word (release order) and,
// unless G53_OD_NO_COMPLETION is set, appends a (tag, status, error_offset) record that
// g53_od_wait / g53_od_poll hand back.
//
// Alignment: offsets, lengths and addresses must be multiples of g53_od_alignment() (4096, or
// the file's direct-I/O alignment from statx when that is larger). Memory: the caller owns every
// buffer and must keep it alive until its request completes. Status: 0, or -errno with
// error_offset the file offset where the transfer failed: -ENODATA for a read that ran into the
// end of the file (no zero fill), -EIO for a write that made no progress, -ECANCELED for a request
// cancelled by g53_od_shutdown. A failed piece stops the request's remaining unstarted pieces.
//
// Threading: every function but g53_od_free may be called from any thread at any time, without
// the GIL; the object has one mutex. Workers block all signals. g53_od_shutdown joins every
// worker before it returns. Linux only (O_DIRECT, statx, fallocate). Current limits: blocking
// pread/pwrite per thread (no io_uring); at most G53_OD_MAX_THREADS threads; pieces <= 1 GiB.
#ifndef GLM53_ODIRECT_H
#define GLM53_ODIRECT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define G53_OD_DEFAULT_PIECE_BYTES (2u << 20)
#define G53_OD_MIN_ALIGNMENT 4096u
#define G53_OD_MAX_THREADS 256
#define G53_OD_MAX_PIECE_BYTES (1u << 30)

enum g53_od_mode { G53_OD_READ = 0, G53_OD_WRITE = 1 };
enum g53_od_priority { G53_OD_DEMAND = 0, G53_OD_PREFETCH = 1 };

// Values of a request's done word.
enum g53_od_done { G53_OD_PENDING = 0, G53_OD_OK = 1, G53_OD_FAILED = 2 };

// Request options.
enum g53_od_options { G53_OD_NO_COMPLETION = 1u };  // report only through done_word

typedef struct g53_od g53_od;

typedef struct g53_od_config {
    int mode;              // G53_OD_READ or G53_OD_WRITE
    int num_threads;       // 1 .. G53_OD_MAX_THREADS
    uint64_t piece_bytes;  // 0 = default; else a multiple of the alignment, <= 1 GiB
    int truncate;          // write mode only: open with O_TRUNC
} g53_od_config;

typedef struct g53_od_request {
    uint64_t offset;      // file offset, aligned
    uint64_t length;      // bytes, aligned, > 0
    void *addr;           // read: destination, write: source; aligned, caller-owned
    uint64_t tag;         // returned in the completion record
    uint32_t *done_word;  // optional: set PENDING at submit, then OK or FAILED
    int32_t priority;     // G53_OD_DEMAND or G53_OD_PREFETCH
    uint32_t options;     // g53_od_options bits
} g53_od_request;

typedef struct g53_od_completion {
    uint64_t tag;
    int32_t status;         // 0 or -errno
    uint32_t reserved;
    uint64_t error_offset;  // file offset of the failure; 0 when status is 0
} g53_od_completion;

// Opens path and starts the pool. Returns 0 and sets *out, or -errno: -EINVAL for a bad mode,
// thread count or piece size, or from open(2) when the filesystem refuses O_DIRECT; -EDOM when
// piece_bytes is not a multiple of the file's direct-I/O alignment (statx, above 4096).
int g53_od_open(const char *path, const g53_od_config *config, g53_od **out);

// Queues num_requests requests, all or none: -EINVAL if any is misaligned, empty or has a bad
// priority, -ESHUTDOWN after g53_od_shutdown, -ENOMEM. Returns 0 when all were queued.
int g53_od_submit(g53_od *od, const g53_od_request *requests, int num_requests);

// Copies up to max_out completion records into out, oldest first, after waiting until at least
// min_count are available (capped at max_out), no request that posts a record is outstanding,
// or timeout_ns has passed (timeout_ns < 0: no limit). Returns the number copied.
int g53_od_wait(g53_od *od, int min_count, int64_t timeout_ns, g53_od_completion *out,
                int max_out);

// g53_od_wait without waiting.
int g53_od_poll(g53_od *od, g53_od_completion *out, int max_out);

// Stops the pool: finishes queued requests, or with cancel != 0 completes the unstarted ones
// with -ECANCELED; waits for the pieces in flight and joins every thread. Idempotent.
void g53_od_shutdown(g53_od *od, int cancel);

// Shuts down (cancelling) if still running, closes the file and frees the object.
void g53_od_free(g53_od *od);

uint64_t g53_od_alignment(const g53_od *od);
uint64_t g53_od_piece_bytes(const g53_od *od);
int g53_od_num_threads(const g53_od *od);
// Requests submitted and not yet completed.
int g53_od_num_in_flight(g53_od *od);

// Write mode: reserves blocks for [offset, offset + length) with fallocate (the file grows to
// cover it). Returns 0 or -errno (-EOPNOTSUPP where the filesystem cannot preallocate).
int g53_od_preallocate(g53_od *od, uint64_t offset, uint64_t length);
// fdatasync of the requests completed so far. Returns 0 or -errno.
int g53_od_sync(g53_od *od);

// One O_DIRECT read of the first 4 KiB of a file. Returns 0 or -errno (-ENODATA: file shorter
// than 4 KiB).
int g53_od_probe_file(const char *path);
// O_DIRECT write, read back and compare of a 4 KiB file created at probe_path, which is then
// deleted. Returns 0 or -errno (-EIO when the bytes read back differ).
int g53_od_probe_dir(const char *probe_path);

#ifdef __cplusplus
}
#endif

#endif
