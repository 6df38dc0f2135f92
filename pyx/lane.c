/* lane.c: the fast-mode mailbox poller (see lane.h and the protocol in lane_mailbox.h). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "lane.h"

#define MIN_SLEEP_NS 10000L

typedef struct {
    uint8_t *mbox;
    const gemv_expert *experts;
    int num_experts, hidden, inter, k2, variant, precision;
    float act_limit;
    uint32_t seen;  /* last seq taken */
    float *scratch; /* [G53_MBOX_MAX_ROWS][hidden] */
    g53_lane_slot_stats stats; /* under the lane's stats_lock */
} lane_slot;

struct g53_lane {
    gemv_pool *pool;
    int num_slots;
    lane_slot *slots;
    _Atomic long spin_ns; /* g53_lane_set_spin may change it while the poller runs */
    long max_sleep_ns;
    pthread_t thread;
    _Atomic long tid; /* the poller's kernel thread id, once it runs (for its CPU affinity) */
    int started;
    _Atomic int stop;
    _Atomic int stall_slot; /* -1: none */
    _Atomic uint32_t stall_seq;
    _Atomic int held;
    pthread_mutex_t stats_lock;
    g53_lane_stats stats;
};

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void sleep_ns(long ns)
{
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    nanosleep(&ts, NULL);
}

uint32_t g53_lane_load_acquire(const uint32_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

void g53_lane_store_release(uint32_t *word, uint32_t value)
{
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

static uint32_t *word_at(uint8_t *mbox, size_t off) { return (uint32_t *)(mbox + off); }

g53_lane *g53_lane_create(gemv_pool *pool, int num_slots, long spin_ns, long max_sleep_ns,
                          char *msg, size_t msg_len)
{
    if (!pool || num_slots < 1 || spin_ns < 0 || max_sleep_ns < MIN_SLEEP_NS) {
        snprintf(msg, msg_len,
                 "a lane needs a pool, num_slots >= 1 (got %d), spin_ns >= 0 (got %ld) and "
                 "max_sleep_ns >= %ld (got %ld)",
                 num_slots, spin_ns, MIN_SLEEP_NS, max_sleep_ns);
        return NULL;
    }
    g53_lane *lane = calloc(1, sizeof *lane);
    lane_slot *slots = calloc((size_t)num_slots, sizeof *slots);
    if (!lane || !slots) {
        free(lane);
        free(slots);
        snprintf(msg, msg_len, "out of memory for a lane of %d slots", num_slots);
        return NULL;
    }
    lane->pool = pool;
    lane->num_slots = num_slots;
    lane->slots = slots;
    atomic_init(&lane->spin_ns, spin_ns);
    lane->max_sleep_ns = max_sleep_ns;
    atomic_store(&lane->stall_slot, -1);
    lane->stats.last_slot = -1;
    pthread_mutex_init(&lane->stats_lock, NULL);
    return lane;
}

int g53_lane_set_slot(g53_lane *lane, int slot, uint8_t *mbox, const gemv_expert *experts,
                      int num_experts, int hidden, int inter, int k2, float act_limit,
                      int variant, int precision, char *msg, size_t msg_len)
{
    if (lane->started) {
        snprintf(msg, msg_len, "slots are bound before the lane starts");
        return GEMV_EINVAL;
    }
    if (slot < 0 || slot >= lane->num_slots) {
        snprintf(msg, msg_len, "slot %d is outside 0..%d", slot, lane->num_slots - 1);
        return GEMV_EINVAL;
    }
    if (!mbox || ((uintptr_t)mbox & 63)) {
        snprintf(msg, msg_len, "slot %d: the mailbox must be set and 64-byte aligned", slot);
        return GEMV_EINVAL;
    }
    /* A job with one pick checks everything but the picks the device will send. */
    gemv_pick pick = {0, 0, 0.0f};
    float probe_x = 0.0f;
    gemv_job job = {.hidden = hidden, .inter = inter, .k2 = k2, .act_limit = act_limit,
                    .variant = variant, .precision = precision, .experts = experts,
                    .num_experts = num_experts, .x = &probe_x, .num_rows = 1, .picks = &pick,
                    .num_picks = num_experts > 0 ? 1 : 0, .out = &probe_x};
    char inner[GEMV_MSG_BYTES];
    int rc = gemv_job_check(&job, inner, sizeof inner);
    if (rc) {
        snprintf(msg, msg_len, "slot %d: %s", slot, inner);
        return rc;
    }
    lane_slot *s = &lane->slots[slot];
    free(s->scratch);
    s->scratch = aligned_alloc(64, (size_t)G53_MBOX_MAX_ROWS * (size_t)hidden * sizeof(float));
    if (!s->scratch) {
        snprintf(msg, msg_len, "slot %d: out of memory for its scratch", slot);
        return GEMV_ENOMEM;
    }
    s->mbox = mbox;
    s->experts = experts;
    s->num_experts = num_experts;
    s->hidden = hidden;
    s->inter = inter;
    s->k2 = k2;
    s->act_limit = act_limit;
    s->variant = variant;
    s->precision = precision;
    /* Whatever the device published before the lane started is not a job for it. */
    s->seen = g53_lane_load_acquire(word_at(mbox, G53_MBOX_SEQ));
    return GEMV_OK;
}

static void count(g53_lane *lane, uint64_t *field)
{
    pthread_mutex_lock(&lane->stats_lock);
    (*field)++;
    pthread_mutex_unlock(&lane->stats_lock);
}

/* Held while a stall on (slot, seq) is set and the lane runs. */
static void maybe_stall(g53_lane *lane, int slot, uint32_t seq)
{
    if (atomic_load_explicit(&lane->stall_slot, memory_order_acquire) != slot ||
        atomic_load_explicit(&lane->stall_seq, memory_order_acquire) != seq)
        return;
    atomic_store(&lane->held, 1);
    while (atomic_load_explicit(&lane->stall_slot, memory_order_acquire) == slot &&
           !atomic_load_explicit(&lane->stop, memory_order_acquire))
        sleep_ns(MIN_SLEEP_NS);
    atomic_store(&lane->held, 0);
}

/* Run one published seq of slot i. */
static void take(g53_lane *lane, int i, uint32_t seq, long seen_ns)
{
    lane_slot *s = &lane->slots[i];
    uint8_t *mb = s->mbox;
    int32_t n_picks = *(volatile int32_t *)(mb + G53_MBOX_N_PICKS);
    int32_t n_rows = *(volatile int32_t *)(mb + G53_MBOX_N_ROWS);
    if (n_picks == 0) { /* nothing for the lane: done at once, the device adds no partial */
        g53_lane_store_release(word_at(mb, G53_MBOX_DONE), seq);
        count(lane, &lane->stats.empty);
        return;
    }
    gemv_pick picks[G53_MBOX_MAX_PICKS];
    if (n_picks < 0 || n_picks > G53_MBOX_MAX_PICKS || n_rows < 1 || n_rows > G53_MBOX_MAX_ROWS) {
        *(volatile int32_t *)(mb + G53_MBOX_STATUS) = GEMV_EINVAL;
        count(lane, &lane->stats.failed);
        return;
    }
    memcpy(picks, mb + G53_MBOX_PICKS, (size_t)n_picks * sizeof(gemv_pick));
    gemv_job job = {.hidden = s->hidden, .inter = s->inter, .k2 = s->k2,
                    .act_limit = s->act_limit, .variant = s->variant,
                    .precision = s->precision, .experts = s->experts,
                    .num_experts = s->num_experts, .x = (const float *)(mb + G53_MBOX_ROWS),
                    .num_rows = n_rows, .picks = picks, .num_picks = n_picks,
                    .out = s->scratch};
    char msg[GEMV_MSG_BYTES];
    int rc = gemv_pool_submit(lane->pool, &job, msg, sizeof msg); /* checks every pick */
    if (rc == GEMV_OK)
        rc = gemv_pool_wait(lane->pool, &job);
    if (rc != GEMV_OK) {
        *(volatile int32_t *)(mb + G53_MBOX_STATUS) = rc;
        count(lane, &lane->stats.failed);
        return;
    }
    maybe_stall(lane, i, seq);
    if (g53_lane_load_acquire(word_at(mb, G53_MBOX_SEQ)) != seq) {
        count(lane, &lane->stats.discarded); /* the device gave up on seq and moved on */
        return;
    }
    memcpy(mb + G53_MBOX_PARTIAL(s->hidden), s->scratch,
           (size_t)n_rows * (size_t)s->hidden * sizeof(float));
    g53_lane_store_release(word_at(mb, G53_MBOX_DONE), seq);
    uint64_t took = (uint64_t)(now_ns() - seen_ns);
    pthread_mutex_lock(&lane->stats_lock);
    lane->stats.jobs++;
    lane->stats.busy_ns += took;
    lane->stats.last_job_ns = took;
    lane->stats.last_slot = i;
    lane->stats.last_picks = n_picks;
    s->stats.jobs++;
    s->stats.busy_ns += took;
    s->stats.last_job_ns = took;
    s->stats.last_picks = n_picks;
    pthread_mutex_unlock(&lane->stats_lock);
}

static void *poller_main(void *arg)
{
    g53_lane *lane = arg;
    atomic_store_explicit(&lane->tid, (long)syscall(SYS_gettid), memory_order_release);
    long idle_since = now_ns(), sleep = MIN_SLEEP_NS;
    while (!atomic_load_explicit(&lane->stop, memory_order_acquire)) {
        int worked = 0;
        for (int i = 0; i < lane->num_slots; i++) {
            lane_slot *s = &lane->slots[i];
            uint32_t seq = g53_lane_load_acquire(word_at(s->mbox, G53_MBOX_SEQ));
            if (seq == s->seen)
                continue;
            s->seen = seq;
            take(lane, i, seq, now_ns());
            worked = 1;
        }
        if (worked) {
            idle_since = now_ns();
            sleep = MIN_SLEEP_NS;
        } else if (now_ns() - idle_since <
                   atomic_load_explicit(&lane->spin_ns, memory_order_relaxed)) {
            cpu_relax();
        } else {
            sleep_ns(sleep);
            sleep = sleep * 2 < lane->max_sleep_ns ? sleep * 2 : lane->max_sleep_ns;
        }
    }
    return NULL;
}

int g53_lane_set_spin(g53_lane *lane, long spin_ns)
{
    if (spin_ns < 0)
        return GEMV_EINVAL;
    atomic_store_explicit(&lane->spin_ns, spin_ns, memory_order_relaxed);
    return GEMV_OK;
}

long g53_lane_spin(g53_lane *lane)
{
    return atomic_load_explicit(&lane->spin_ns, memory_order_relaxed);
}

int g53_lane_start(g53_lane *lane, char *msg, size_t msg_len)
{
    if (lane->started) {
        snprintf(msg, msg_len, "the lane is already running");
        return GEMV_EINVAL;
    }
    for (int i = 0; i < lane->num_slots; i++)
        if (!lane->slots[i].mbox) {
            snprintf(msg, msg_len, "slot %d has no mailbox; bind every slot first", i);
            return GEMV_EINVAL;
        }
    int rc = pthread_create(&lane->thread, NULL, poller_main, lane);
    if (rc) {
        snprintf(msg, msg_len, "cannot start the lane's poller thread (%s)", strerror(rc));
        return GEMV_ENOMEM;
    }
    lane->started = 1;
    /* the thread id is known once the poller runs: wait for it (its first statement) */
    for (long waited = 0; !atomic_load_explicit(&lane->tid, memory_order_acquire) &&
                          waited < 2000000000L;
         waited += MIN_SLEEP_NS)
        sleep_ns(MIN_SLEEP_NS);
    return GEMV_OK;
}

long g53_lane_native_id(g53_lane *lane)
{
    return atomic_load_explicit(&lane->tid, memory_order_acquire);
}

void g53_lane_destroy(g53_lane *lane)
{
    if (!lane)
        return;
    atomic_store_explicit(&lane->stop, 1, memory_order_release);
    if (lane->started)
        pthread_join(lane->thread, NULL);
    for (int i = 0; i < lane->num_slots; i++)
        free(lane->slots[i].scratch);
    pthread_mutex_destroy(&lane->stats_lock);
    free(lane->slots);
    free(lane);
}

void g53_lane_get_stats(g53_lane *lane, g53_lane_stats *out)
{
    pthread_mutex_lock(&lane->stats_lock);
    *out = lane->stats;
    pthread_mutex_unlock(&lane->stats_lock);
}

int g53_lane_get_slot_stats(g53_lane *lane, int slot, g53_lane_slot_stats *out)
{
    if (slot < 0 || slot >= lane->num_slots)
        return GEMV_EINVAL;
    pthread_mutex_lock(&lane->stats_lock);
    *out = lane->slots[slot].stats;
    pthread_mutex_unlock(&lane->stats_lock);
    return GEMV_OK;
}

void g53_lane_stall(g53_lane *lane, int slot, uint32_t seq)
{
    atomic_store_explicit(&lane->stall_seq, seq, memory_order_release);
    atomic_store_explicit(&lane->stall_slot, slot, memory_order_release);
}

void g53_lane_release(g53_lane *lane) { atomic_store_explicit(&lane->stall_slot, -1, memory_order_release); }

int g53_lane_held(g53_lane *lane) { return atomic_load(&lane->held); }
