/* lane.h: the CPU lane's side of the fast-mode hand-off (the mailboxes of lane_mailbox.h).
 *
 * One poller thread watches every mailbox of a model (one per MoE layer-slot). For a new seq it
 * runs the published picks as one MoE job on the lane's pinned pool (gemv_pool_submit: the very
 * job CpuLane.run submits, so the partial is the same bits), from the rows in the mailbox and
 * the layer's expert table (the pinned home), then writes the partial and done (see the
 * protocol in lane_mailbox.h). No Python, no GIL.
 *
 * Waiting: after its last job the poller spins (pause) for spin_ns, then sleeps, doubling the
 * sleep from 10 us up to max_sleep_ns. Spinning holds one core at 100 % while a decode step's
 * layers come back to back (they do every few hundred us); the sleeps cost at most max_sleep_ns
 * (plus the timer's slack, ~50 us) of extra latency on the first layer after an idle gap, which
 * the device's bounded wait must cover or that layer falls back to the GPU (counted).
 *
 * Threads: create, set_slot and start from one thread; then the poller owns every slot.
 * stats/stall/release may be called from any thread. destroy stops and joins the poller, also
 * while it waits or is held by a stall.
 */
#ifndef GLM53_LANE_H
#define GLM53_LANE_H

#include <stddef.h>
#include <stdint.h>

#include "gemv.h"
#include "lane_mailbox.h"

typedef struct g53_lane g53_lane;

typedef struct {
    uint64_t jobs;        /* seqs whose partial was published */
    uint64_t empty;       /* seqs with no picks (done written at once) */
    uint64_t discarded;   /* results dropped: the device had moved on to a later seq */
    uint64_t failed;      /* seqs whose payload or job failed its checks (no done written) */
    uint64_t busy_ns;     /* time from seeing a seq to publishing its done, summed over jobs */
    uint64_t last_job_ns; /* that time for the last published job */
    int32_t last_slot;    /* slot of the last published job */
    int32_t last_picks;   /* its picks */
} g53_lane_stats;

/* Per slot (one MoE layer): what the router reads as the lane's time for that layer. */
typedef struct {
    uint64_t jobs;        /* seqs of this slot whose partial was published */
    uint64_t busy_ns;     /* summed time from seeing a seq to publishing its done */
    uint64_t last_job_ns; /* that time for the slot's last published job */
    int32_t last_picks;   /* and its picks */
} g53_lane_slot_stats;

/* A poller over num_slots mailboxes, running jobs on `pool` (which must outlive it). */
g53_lane *g53_lane_create(gemv_pool *pool, int num_slots, long spin_ns, long max_sleep_ns,
                          char *msg, size_t msg_len);
/* Bind slot i (before start) to a mailbox of G53_MBOX_BYTES(hidden) bytes (64-byte aligned) and
 * to the layer's experts: gemv_expert[num_experts] at `experts` (an ExpertTable's handle). */
int g53_lane_set_slot(g53_lane *lane, int slot, uint8_t *mbox, const gemv_expert *experts,
                      int num_experts, int hidden, int inter, int k2, float act_limit,
                      int variant, int precision, char *msg, size_t msg_len);
int g53_lane_start(g53_lane *lane, char *msg, size_t msg_len);
/* The running poller's kernel thread id (for sched_setaffinity: glm53.tiers.thread_pins keeps it
 * off the lane's cores), known when g53_lane_start returns; 0 before start. */
long g53_lane_native_id(g53_lane *lane);
/* The poller's spin after its last job, changed while it runs (GEMV_EINVAL when negative). */
int g53_lane_set_spin(g53_lane *lane, long spin_ns);
long g53_lane_spin(g53_lane *lane);
void g53_lane_destroy(g53_lane *lane);
void g53_lane_get_stats(g53_lane *lane, g53_lane_stats *out);
int g53_lane_get_slot_stats(g53_lane *lane, int slot, g53_lane_slot_stats *out);

/* Test hook, as a slow or descheduled lane: the poller holds a computed result of (slot, seq)
 * before publishing it until g53_lane_release (or destroy). One stall at a time. */
void g53_lane_stall(g53_lane *lane, int slot, uint32_t seq);
void g53_lane_release(g53_lane *lane);
/* Whether the poller is holding a stalled result now. */
int g53_lane_held(g53_lane *lane);

/* Acquire load / release store of a mailbox word, for host code that plays the device's role. */
uint32_t g53_lane_load_acquire(const uint32_t *word);
void g53_lane_store_release(uint32_t *word, uint32_t value);

#endif
