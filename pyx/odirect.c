// O_DIRECT batch reader/writer: a pthread pool over two FIFO queues. See odirect.h.
#define _GNU_SOURCE
#include "odirect.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define WORKER_STACK_BYTES (256u << 10)
#define PROBE_BYTES 4096u

// One submitted request. Only the head of a queue can be partly handed out, because workers
// always take the next piece of the head.
typedef struct job {
    struct job *next;
    uint64_t offset;
    uint64_t length;
    uint64_t claimed_bytes;  // bytes already handed to workers
    char *addr;
    uint64_t tag;
    uint32_t *done_word;
    uint32_t options;
    uint32_t pieces_left;  // pieces not yet finished or dropped
    int32_t status;
    uint64_t error_offset;
} job;

typedef struct job_queue {
    job *head;
    job *tail;
} job_queue;

enum join_state { RUNNING = 0, JOINING = 1, JOINED = 2 };

struct g53_od {
    int fd;
    int mode;
    uint64_t alignment;
    uint64_t piece_bytes;
    int num_threads;
    pthread_t *threads;

    pthread_mutex_t lock;
    pthread_cond_t work_cv;  // workers: a piece is queued, or stop
    pthread_cond_t done_cv;  // waiters: a request completed, or the pool was joined
    job_queue queues[2];     // indexed by g53_od_priority
    int num_in_flight;       // requests submitted and not completed
    int num_posting;         // of those, the ones that will post a completion record
    int stopping;
    int join_state;

    // Completion records, a ring. Capacity is reserved at submit, so posting never allocates.
    g53_od_completion *ring;
    uint32_t ring_capacity;
    uint32_t ring_head;
    uint32_t ring_count;
};

// ---- queue and completion bookkeeping (called with od->lock held) ----------------------------

static void queue_push(job_queue *q, job *j) {
    j->next = NULL;
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
}

static void queue_pop(job_queue *q) {
    q->head = q->head->next;
    if (!q->head) q->tail = NULL;
}

static uint32_t pieces_in(const g53_od *od, uint64_t bytes) {
    return (uint32_t)((bytes + od->piece_bytes - 1) / od->piece_bytes);
}

static int reserve_ring(g53_od *od, uint64_t needed) {
    if (needed <= od->ring_capacity) return 0;
    if (needed > UINT32_MAX / 2) return -ENOMEM;
    uint32_t capacity = od->ring_capacity ? od->ring_capacity : 64;
    while (capacity < needed) capacity *= 2;
    g53_od_completion *ring = malloc((size_t)capacity * sizeof *ring);
    if (!ring) return -ENOMEM;
    for (uint32_t i = 0; i < od->ring_count; i++)
        ring[i] = od->ring[(od->ring_head + i) % od->ring_capacity];
    free(od->ring);
    od->ring = ring;
    od->ring_capacity = capacity;
    od->ring_head = 0;
    return 0;
}

static void complete(g53_od *od, job *j) {
    if (j->done_word)
        __atomic_store_n(j->done_word, j->status ? G53_OD_FAILED : G53_OD_OK, __ATOMIC_RELEASE);
    if (!(j->options & G53_OD_NO_COMPLETION)) {
        g53_od_completion *c = &od->ring[(od->ring_head + od->ring_count) % od->ring_capacity];
        c->tag = j->tag;
        c->status = j->status;
        c->reserved = 0;
        c->error_offset = j->status ? j->error_offset : 0;
        od->ring_count++;
        od->num_posting--;
    }
    od->num_in_flight--;
    free(j);
    pthread_cond_broadcast(&od->done_cv);
}

// Drops the pieces of j that no worker has started; j must be the head of q if any remain.
static void drop_unclaimed(g53_od *od, job_queue *q, job *j, int32_t status) {
    if (j->status == 0) {
        j->status = status;
        j->error_offset = j->offset + j->claimed_bytes;
    }
    if (j->claimed_bytes < j->length) {
        j->pieces_left -= pieces_in(od, j->length - j->claimed_bytes);
        j->claimed_bytes = j->length;
        queue_pop(q);
    }
    if (j->pieces_left == 0) complete(od, j);
}

// ---- workers ----------------------------------------------------------------------------------

// Moves len bytes between addr and the file at off. A short transfer continues where it stopped
// unless it ended off the alignment grid (O_DIRECT then cannot go on): that, or no progress at
// all, is the end of the file for a read and -EIO for a write.
static int transfer(const g53_od *od, char *addr, uint64_t len, uint64_t off,
                    uint64_t *error_offset) {
    while (len > 0) {
        ssize_t n = od->mode == G53_OD_WRITE ? pwrite(od->fd, addr, len, (off_t)off)
                                             : pread(od->fd, addr, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR) continue;
            *error_offset = off;
            return -errno;
        }
        addr += n;
        off += (uint64_t)n;
        len -= (uint64_t)n;
        if (len > 0 && (n == 0 || off % od->alignment != 0)) {
            *error_offset = off;
            return od->mode == G53_OD_WRITE ? -EIO : -ENODATA;
        }
    }
    return 0;
}

static void *worker_main(void *arg) {
    g53_od *od = arg;
    pthread_mutex_lock(&od->lock);
    for (;;) {
        job_queue *q = od->queues[G53_OD_DEMAND].head    ? &od->queues[G53_OD_DEMAND]
                       : od->queues[G53_OD_PREFETCH].head ? &od->queues[G53_OD_PREFETCH]
                                                          : NULL;
        if (!q) {
            if (od->stopping) break;
            pthread_cond_wait(&od->work_cv, &od->lock);
            continue;
        }
        job *j = q->head;
        uint64_t start = j->claimed_bytes;
        uint64_t len = j->length - start < od->piece_bytes ? j->length - start : od->piece_bytes;
        j->claimed_bytes += len;
        if (j->claimed_bytes == j->length) queue_pop(q);
        pthread_mutex_unlock(&od->lock);

        uint64_t error_offset = 0;
        int status = transfer(od, j->addr + start, len, j->offset + start, &error_offset);

        pthread_mutex_lock(&od->lock);
        // Pieces finish in any order: the failure reported is the one nearest the job's start.
        if (status != 0 && (j->status == 0 || error_offset < j->error_offset)) {
            j->status = status;
            j->error_offset = error_offset;
        }
        j->pieces_left--;
        if (status != 0)
            drop_unclaimed(od, q, j, status);  // completes j when nothing else is in flight
        else if (j->pieces_left == 0)
            complete(od, j);
    }
    pthread_mutex_unlock(&od->lock);
    return NULL;
}

// ---- open / close -----------------------------------------------------------------------------

static uint64_t query_alignment(int fd) {
    uint64_t alignment = G53_OD_MIN_ALIGNMENT;
#ifdef STATX_DIOALIGN
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
        if (sx.stx_dio_offset_align > alignment) alignment = sx.stx_dio_offset_align;
        if (sx.stx_dio_mem_align > alignment) alignment = sx.stx_dio_mem_align;
    }
#endif
    return alignment;
}

static int start_threads(g53_od *od) {
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc) return -rc;
    pthread_attr_setstacksize(&attr, WORKER_STACK_BYTES);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  // workers inherit a fully blocked mask
    int started = 0;
    for (; started < od->num_threads; started++) {
        rc = pthread_create(&od->threads[started], &attr, worker_main, od);
        if (rc) break;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    if (started == od->num_threads) return 0;

    pthread_mutex_lock(&od->lock);
    od->stopping = 1;
    pthread_cond_broadcast(&od->work_cv);
    pthread_mutex_unlock(&od->lock);
    for (int i = 0; i < started; i++) pthread_join(od->threads[i], NULL);
    return -rc;
}

static void destroy(g53_od *od) {
    pthread_cond_destroy(&od->done_cv);
    pthread_cond_destroy(&od->work_cv);
    pthread_mutex_destroy(&od->lock);
    if (od->fd >= 0) close(od->fd);
    free(od->ring);
    free(od->threads);
    free(od);
}

int g53_od_open(const char *path, const g53_od_config *config, g53_od **out) {
    *out = NULL;
    if (config->mode != G53_OD_READ && config->mode != G53_OD_WRITE) return -EINVAL;
    if (config->num_threads < 1 || config->num_threads > G53_OD_MAX_THREADS) return -EINVAL;
    uint64_t piece_bytes = config->piece_bytes ? config->piece_bytes : G53_OD_DEFAULT_PIECE_BYTES;
    if (piece_bytes > G53_OD_MAX_PIECE_BYTES) return -EINVAL;

    int flags = O_DIRECT | O_CLOEXEC;
    if (config->mode == G53_OD_READ)
        flags |= O_RDONLY;
    else
        flags |= O_WRONLY | O_CREAT | (config->truncate ? O_TRUNC : 0);
    int fd = open(path, flags, 0644);
    if (fd < 0) return -errno;
    uint64_t alignment = query_alignment(fd);
    if (piece_bytes % alignment != 0) {
        close(fd);
        return -EDOM;
    }

    g53_od *od = calloc(1, sizeof *od);
    pthread_t *threads = calloc((size_t)config->num_threads, sizeof *threads);
    if (!od || !threads) {
        free(od);
        free(threads);
        close(fd);
        return -ENOMEM;
    }
    od->fd = fd;
    od->mode = config->mode;
    od->alignment = alignment;
    od->piece_bytes = piece_bytes;
    od->num_threads = config->num_threads;
    od->threads = threads;
    pthread_condattr_t cattr;
    pthread_condattr_init(&cattr);
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
    pthread_mutex_init(&od->lock, NULL);
    pthread_cond_init(&od->work_cv, NULL);
    pthread_cond_init(&od->done_cv, &cattr);
    pthread_condattr_destroy(&cattr);

    int rc = start_threads(od);
    if (rc) {
        destroy(od);
        return rc;
    }
    *out = od;
    return 0;
}

void g53_od_shutdown(g53_od *od, int cancel) {
    pthread_mutex_lock(&od->lock);
    if (cancel) {
        for (int p = 0; p < 2; p++)
            while (od->queues[p].head) drop_unclaimed(od, &od->queues[p], od->queues[p].head,
                                                      -ECANCELED);
    }
    if (od->join_state != RUNNING) {
        while (od->join_state != JOINED) pthread_cond_wait(&od->done_cv, &od->lock);
        pthread_mutex_unlock(&od->lock);
        return;
    }
    od->join_state = JOINING;
    od->stopping = 1;
    pthread_cond_broadcast(&od->work_cv);
    pthread_mutex_unlock(&od->lock);

    for (int i = 0; i < od->num_threads; i++) pthread_join(od->threads[i], NULL);

    pthread_mutex_lock(&od->lock);
    od->join_state = JOINED;
    pthread_cond_broadcast(&od->done_cv);
    pthread_mutex_unlock(&od->lock);
}

void g53_od_free(g53_od *od) {
    if (!od) return;
    g53_od_shutdown(od, 1);
    destroy(od);
}

// ---- submit / wait ----------------------------------------------------------------------------

static int valid_request(const g53_od *od, const g53_od_request *r) {
    uint64_t a = od->alignment;
    return r->length > 0 && r->offset % a == 0 && r->length % a == 0 &&
           (uintptr_t)r->addr % a == 0 && r->offset + r->length > r->offset &&
           (r->priority == G53_OD_DEMAND || r->priority == G53_OD_PREFETCH) &&
           (r->options & ~(uint32_t)G53_OD_NO_COMPLETION) == 0 &&
           pieces_in(od, r->length) < UINT32_MAX / 2;
}

int g53_od_submit(g53_od *od, const g53_od_request *requests, int num_requests) {
    if (num_requests < 0) return -EINVAL;
    int num_posting = 0;
    for (int i = 0; i < num_requests; i++) {
        if (!valid_request(od, &requests[i])) return -EINVAL;
        num_posting += !(requests[i].options & G53_OD_NO_COMPLETION);
    }
    if (num_requests == 0) return 0;

    job **jobs = malloc((size_t)num_requests * sizeof *jobs);
    if (!jobs) return -ENOMEM;
    int num_made = 0;
    for (; num_made < num_requests; num_made++) {
        const g53_od_request *r = &requests[num_made];
        job *j = malloc(sizeof *j);
        if (!j) break;
        *j = (job){.offset = r->offset,
                   .length = r->length,
                   .addr = r->addr,
                   .tag = r->tag,
                   .done_word = r->done_word,
                   .options = r->options,
                   .pieces_left = pieces_in(od, r->length)};
        jobs[num_made] = j;
    }

    int rc = num_made < num_requests ? -ENOMEM : 0;
    pthread_mutex_lock(&od->lock);
    if (rc == 0 && od->stopping) rc = -ESHUTDOWN;
    if (rc == 0)
        rc = reserve_ring(od, (uint64_t)od->ring_count + (uint64_t)od->num_posting +
                                  (uint64_t)num_posting);
    if (rc == 0) {
        for (int i = 0; i < num_requests; i++) {
            if (jobs[i]->done_word)
                __atomic_store_n(jobs[i]->done_word, G53_OD_PENDING, __ATOMIC_RELAXED);
            queue_push(&od->queues[requests[i].priority], jobs[i]);
        }
        od->num_in_flight += num_requests;
        od->num_posting += num_posting;
        pthread_cond_broadcast(&od->work_cv);
    }
    pthread_mutex_unlock(&od->lock);
    if (rc != 0)
        for (int i = 0; i < num_made; i++) free(jobs[i]);
    free(jobs);
    return rc;
}

int g53_od_wait(g53_od *od, int min_count, int64_t timeout_ns, g53_od_completion *out,
                int max_out) {
    if (max_out <= 0) return 0;
    if (min_count > max_out) min_count = max_out;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    if (timeout_ns >= 0) {
        int64_t ns = deadline.tv_nsec + timeout_ns % 1000000000;
        deadline.tv_sec += timeout_ns / 1000000000 + ns / 1000000000;
        deadline.tv_nsec = ns % 1000000000;
    }

    pthread_mutex_lock(&od->lock);
    while ((int64_t)od->ring_count < min_count && od->num_posting > 0) {
        if (timeout_ns < 0)
            pthread_cond_wait(&od->done_cv, &od->lock);
        else if (pthread_cond_timedwait(&od->done_cv, &od->lock, &deadline) == ETIMEDOUT)
            break;
    }
    int n = od->ring_count < (uint32_t)max_out ? (int)od->ring_count : max_out;
    for (int i = 0; i < n; i++) out[i] = od->ring[(od->ring_head + i) % od->ring_capacity];
    if (n) {
        od->ring_head = (od->ring_head + (uint32_t)n) % od->ring_capacity;
        od->ring_count -= (uint32_t)n;
    }
    pthread_mutex_unlock(&od->lock);
    return n;
}

int g53_od_poll(g53_od *od, g53_od_completion *out, int max_out) {
    return g53_od_wait(od, 0, 0, out, max_out);
}

// ---- accessors and write-mode helpers ----------------------------------------------------------

uint64_t g53_od_alignment(const g53_od *od) { return od->alignment; }

uint64_t g53_od_piece_bytes(const g53_od *od) { return od->piece_bytes; }

int g53_od_num_threads(const g53_od *od) { return od->num_threads; }

int g53_od_num_in_flight(g53_od *od) {
    pthread_mutex_lock(&od->lock);
    int n = od->num_in_flight;
    pthread_mutex_unlock(&od->lock);
    return n;
}

int g53_od_preallocate(g53_od *od, uint64_t offset, uint64_t length) {
    if (od->mode != G53_OD_WRITE) return -EBADF;
    return fallocate(od->fd, 0, (off_t)offset, (off_t)length) == 0 ? 0 : -errno;
}

int g53_od_sync(g53_od *od) { return fdatasync(od->fd) == 0 ? 0 : -errno; }

// ---- probes -----------------------------------------------------------------------------------

int g53_od_probe_file(const char *path) {
    void *buf = NULL;
    if (posix_memalign(&buf, PROBE_BYTES, PROBE_BYTES)) return -ENOMEM;
    int rc = 0;
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
    } else {
        ssize_t n;
        do n = pread(fd, buf, PROBE_BYTES, 0);
        while (n < 0 && errno == EINTR);
        rc = n < 0 ? -errno : n == 0 ? -ENODATA : 0;
        close(fd);
    }
    free(buf);
    return rc;
}

int g53_od_probe_dir(const char *probe_path) {
    unsigned char *out = NULL, *back = NULL;
    if (posix_memalign((void **)&out, PROBE_BYTES, PROBE_BYTES)) return -ENOMEM;
    if (posix_memalign((void **)&back, PROBE_BYTES, PROBE_BYTES)) {
        free(out);
        return -ENOMEM;
    }
    for (unsigned i = 0; i < PROBE_BYTES; i++) out[i] = (unsigned char)(i * 131u + 7u);
    memset(back, 0, PROBE_BYTES);

    int rc = 0;
    int fd = open(probe_path, O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
        rc = -errno;
        // Some filesystems create the file and only then refuse O_DIRECT.
        if (rc != -EEXIST) unlink(probe_path);
    } else {
        ssize_t n;
        do n = pwrite(fd, out, PROBE_BYTES, 0);
        while (n < 0 && errno == EINTR);
        if (n != (ssize_t)PROBE_BYTES) rc = n < 0 ? -errno : -EIO;
        if (rc == 0) {
            do n = pread(fd, back, PROBE_BYTES, 0);
            while (n < 0 && errno == EINTR);
            if (n != (ssize_t)PROBE_BYTES) rc = n < 0 ? -errno : -EIO;
        }
        if (rc == 0 && memcmp(out, back, PROBE_BYTES) != 0) rc = -EIO;
        close(fd);
        if (unlink(probe_path) != 0 && rc == 0) rc = -errno;
    }
    free(out);
    free(back);
    return rc;
}
