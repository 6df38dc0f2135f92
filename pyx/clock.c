// CLOCK table, plain or with frequency admission; the policies and the contract are in clock.h.
#include "clock.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define G53_CLOCK_MAX_SIZE (1 << 28)

struct g53_clock {
    int32_t n_slots, n_keys, n_active, n_used, n_pinned, hand;
    int32_t *slot_of;      // [n_keys] slot or -1
    int32_t *key_of;       // [n_slots] key or -1
    int32_t *pins;         // [n_slots] pin count
    uint8_t *ref;          // [n_slots] reference bit
    // Free enabled slots as a bitmap; the lowest set bit is taken first. free_hint is a
    // word index at or below the lowest set bit.
    uint64_t *free_bits;
    int32_t n_free, free_hint;
    // Batch scratch: a key or slot is "seen in this batch" when its stamp equals epoch.
    uint32_t epoch;
    uint32_t *key_stamp;   // [n_keys]
    uint32_t *slot_stamp;  // [n_slots]
    int32_t *miss_keys;    // [n_keys]
    g53_clock_counters n;
    // Frequency mode (g53_clock_create_freq); plain CLOCK has freq == NULL and max_count 1.
    uint8_t max_count;     // a hit raises a slot's count up to this; the hand lowers it
    uint32_t *freq;        // [n_keys] accesses per key, halved every freq_window accesses
    int64_t freq_window, freq_events;
    // Probation: slots whose key lost its admission contest, a list oldest -> newest
    // (prob_prev/prob_next, -1 ends; in_prob marks members). prob_cursor is the newest
    // member placed before the current batch: the next probation victim is looked for
    // from there towards the oldest, so a batch never takes back a slot it just filled.
    int32_t *prob_prev, *prob_next;
    uint8_t *in_prob;
    int32_t prob_head, prob_tail, n_prob, prob_cursor;
    g53_clock_freq_counters fn;
};

const char *g53_clock_strerror(int code) {
    switch (code) {
    case G53_CLOCK_OK: return "ok";
    case G53_CLOCK_E_NOMEM: return "out of memory";
    case G53_CLOCK_E_ARG: return "bad argument (NULL pointer, negative count or size out of range)";
    case G53_CLOCK_E_KEY_RANGE: return "key outside [0, n_keys)";
    case G53_CLOCK_E_SLOT_RANGE: return "slot outside [0, n_slots)";
    case G53_CLOCK_E_NOT_PINNED: return "slot is not pinned";
    case G53_CLOCK_E_ALL_PINNED: return "no free slot and every enabled slot is pinned";
    case G53_CLOCK_E_NO_CAPACITY: return "no enabled slot (all shrunk away)";
    case G53_CLOCK_E_PINNED: return "slot is pinned";
    case G53_CLOCK_E_RESIDENT: return "key already has a slot";
    case G53_CLOCK_E_SLOT_EMPTY: return "slot holds no key";
    case G53_CLOCK_E_SLOT_DISABLED: return "slot is disabled (at or past n_active)";
    case G53_CLOCK_E_NOT_EMPTY: return "table holds keys";
    case G53_CLOCK_E_DUPLICATE: return "key listed twice";
    case G53_CLOCK_E_OUT_SMALL: return "output array too short";
    case G53_CLOCK_E_PIN_OVERFLOW: return "pin count overflow";
    case G53_CLOCK_E_NOT_FREQ: return "not a frequency table (made by g53_clock_create)";
    default: return "unknown g53_clock error code";
    }
}

static inline int key_ok(const g53_clock *c, int32_t key) {
    return (uint32_t)key < (uint32_t)c->n_keys;
}

static inline int slot_ok(const g53_clock *c, int32_t slot) {
    return (uint32_t)slot < (uint32_t)c->n_slots;
}

// --- free-slot bitmap -------------------------------------------------------------------

static inline void free_set(g53_clock *c, int32_t s) {
    int32_t w = s >> 6;
    c->free_bits[w] |= UINT64_C(1) << (s & 63);
    c->n_free++;
    if (w < c->free_hint) c->free_hint = w;
}

static inline void free_clear(g53_clock *c, int32_t s) {
    c->free_bits[s >> 6] &= ~(UINT64_C(1) << (s & 63));
    c->n_free--;
}

static inline int free_test(const g53_clock *c, int32_t s) {
    return (int)((c->free_bits[s >> 6] >> (s & 63)) & 1);
}

// Lowest free slot; the caller checks n_free > 0 first.
static inline int32_t free_take(g53_clock *c) {
    int32_t w = c->free_hint;
    while (c->free_bits[w] == 0) w++;
    c->free_hint = w;
    int32_t s = (w << 6) + __builtin_ctzll(c->free_bits[w]);
    free_clear(c, s);
    return s;
}

// --- create / destroy -------------------------------------------------------------------

void g53_clock_destroy(g53_clock *c) {
    if (!c) return;
    free(c->slot_of);
    free(c->key_of);
    free(c->pins);
    free(c->ref);
    free(c->free_bits);
    free(c->key_stamp);
    free(c->slot_stamp);
    free(c->miss_keys);
    free(c->freq);
    free(c->prob_prev);
    free(c->prob_next);
    free(c->in_prob);
    free(c);
}

static void reset_slots(g53_clock *c) {
    int32_t n_words = (c->n_slots + 63) >> 6;
    memset(c->slot_of, 0xff, sizeof(int32_t) * (size_t)c->n_keys);
    memset(c->key_of, 0xff, sizeof(int32_t) * (size_t)c->n_slots);
    memset(c->ref, 0, (size_t)c->n_slots);
    memset(c->free_bits, 0, sizeof(uint64_t) * (size_t)n_words);
    c->n_free = 0;
    c->free_hint = n_words;
    for (int32_t s = c->n_active - 1; s >= 0; s--) free_set(c, s);
    c->n_used = 0;
    c->hand = 0;
    if (c->in_prob) memset(c->in_prob, 0, (size_t)c->n_slots);
    c->prob_head = c->prob_tail = c->prob_cursor = -1;
    c->n_prob = 0;
}

static int create(int32_t n_slots, int32_t n_keys, const g53_clock_freq_config *cfg,
                  g53_clock **out) {
    if (!out) return G53_CLOCK_E_ARG;
    *out = NULL;
    if (n_slots < 1 || n_keys < 1 || n_slots > G53_CLOCK_MAX_SIZE || n_keys > G53_CLOCK_MAX_SIZE)
        return G53_CLOCK_E_ARG;
    if (cfg && (cfg->max_count < 1 || cfg->max_count > G53_CLOCK_MAX_COUNT ||
                cfg->freq_window < 0))
        return G53_CLOCK_E_ARG;
    g53_clock *c = calloc(1, sizeof(*c));
    if (!c) return G53_CLOCK_E_NOMEM;
    size_t ns = (size_t)n_slots, nk = (size_t)n_keys, n_words = (ns + 63) / 64;
    c->n_slots = n_slots;
    c->n_keys = n_keys;
    c->n_active = n_slots;
    c->max_count = 1;
    c->slot_of = malloc(sizeof(int32_t) * nk);
    c->key_of = malloc(sizeof(int32_t) * ns);
    c->pins = calloc(ns, sizeof(int32_t));
    c->ref = malloc(ns);
    c->free_bits = malloc(sizeof(uint64_t) * n_words);
    c->key_stamp = calloc(nk, sizeof(uint32_t));
    c->slot_stamp = calloc(ns, sizeof(uint32_t));
    c->miss_keys = malloc(sizeof(int32_t) * nk);
    int ok = c->slot_of && c->key_of && c->pins && c->ref && c->free_bits && c->key_stamp &&
             c->slot_stamp && c->miss_keys;
    if (ok && cfg) {
        c->max_count = (uint8_t)cfg->max_count;
        c->freq_window = cfg->freq_window;
        c->freq = calloc(nk, sizeof(uint32_t));
        c->prob_prev = malloc(sizeof(int32_t) * ns);
        c->prob_next = malloc(sizeof(int32_t) * ns);
        c->in_prob = calloc(ns, 1);
        ok = c->freq && c->prob_prev && c->prob_next && c->in_prob;
    }
    if (!ok) {
        g53_clock_destroy(c);
        return G53_CLOCK_E_NOMEM;
    }
    reset_slots(c);
    *out = c;
    return G53_CLOCK_OK;
}

int g53_clock_create(int32_t n_slots, int32_t n_keys, g53_clock **out) {
    return create(n_slots, n_keys, NULL, out);
}

int g53_clock_create_freq(int32_t n_slots, int32_t n_keys, const g53_clock_freq_config *cfg,
                          g53_clock **out) {
    if (!cfg) return G53_CLOCK_E_ARG;
    return create(n_slots, n_keys, cfg, out);
}

// --- frequency mode: counts and probation ------------------------------------------------

// One access of key: its count rises (saturating); every freq_window accesses all counts
// halve (aging), so the counts follow a skew that drifts. A no-op on a plain table.
static inline void count_access(g53_clock *c, int32_t key) {
    if (!c->freq) return;
    if (c->freq[key] != UINT32_MAX) c->freq[key]++;
    c->freq_events++;
    if (c->freq_window > 0 && c->freq_events >= c->freq_window) {
        for (int32_t k = 0; k < c->n_keys; k++) c->freq[k] >>= 1;
        c->freq_events >>= 1;
        c->fn.agings++;
    }
}

static inline void prob_unlink(g53_clock *c, int32_t s) {
    if (!c->in_prob || !c->in_prob[s]) return;
    int32_t p = c->prob_prev[s], n = c->prob_next[s];
    if (p >= 0) c->prob_next[p] = n; else c->prob_head = n;
    if (n >= 0) c->prob_prev[n] = p; else c->prob_tail = p;
    if (c->prob_cursor == s) c->prob_cursor = p;
    c->in_prob[s] = 0;
    c->n_prob--;
}

static inline void prob_push(g53_clock *c, int32_t s) {  // as the newest member
    c->prob_prev[s] = c->prob_tail;
    c->prob_next[s] = -1;
    if (c->prob_tail >= 0) c->prob_next[c->prob_tail] = s; else c->prob_head = s;
    c->prob_tail = s;
    c->in_prob[s] = 1;
    c->n_prob++;
}

// The newest probation slot placed before this batch that is not pinned, or -1.
static inline int32_t prob_victim(g53_clock *c) {
    int32_t s = c->prob_cursor;
    while (s >= 0 && c->pins[s] > 0) s = c->prob_prev[s];
    return s;
}

// --- the hand ---------------------------------------------------------------------------

// Runs the hand to a victim. The caller guarantees one exists: n_free == 0 and an enabled
// slot that is neither pinned nor (when protect is set) stamped by the current batch.
static inline int32_t find_victim(g53_clock *c, int protect) {
    int32_t hand = c->hand, n_active = c->n_active;
    uint64_t skips = 0;
    for (;;) {
        int32_t s = hand;
        hand = hand + 1 == n_active ? 0 : hand + 1;
        if (c->pins[s] > 0) {
            skips++;
            continue;
        }
        if (protect && c->slot_stamp[s] == c->epoch) continue;
        if (c->ref[s]) {
            c->ref[s]--;  // plain CLOCK: the bit cleared (second chance)
            continue;
        }
        c->hand = hand;
        c->n.pinned_skips += skips;
        return s;
    }
}

// Puts key into slot s (free or holding a victim); returns the displaced key or -1.
static inline int32_t place(g53_clock *c, int32_t key, int32_t s) {
    int32_t old = c->key_of[s];
    if (old >= 0) {
        c->slot_of[old] = -1;
        c->n.evictions++;
    } else {
        c->n_used++;
    }
    prob_unlink(c, s);
    c->key_of[s] = key;
    c->slot_of[key] = s;
    c->ref[s] = 0;
    c->n.admits++;
    return old;
}

static inline void mark_hit(g53_clock *c, int32_t s) {
    if (c->ref[s] < c->max_count) c->ref[s]++;
    if (c->in_prob && c->in_prob[s]) {  // hit on probation: an ordinary slot from now on
        prob_unlink(c, s);
        c->fn.probation_hits++;
    }
}

// Frequency mode, a miss of key with no free slot and a victim v found by the hand: the key
// takes v's slot if it was accessed more often than v's key; else it goes on probation, in
// the slot of the newest probation member not placed by this batch (v keeps its slot), or in
// v's slot when there is none, and the hand goes back to v. Returns the slot.
static inline int32_t contest(g53_clock *c, int32_t key, int32_t v, int *on_probation) {
    *on_probation = 0;
    if (c->freq[key] > c->freq[c->key_of[v]]) return v;
    c->fn.rejected++;
    *on_probation = 1;
    c->hand = v;  // the hand rests on v: the next miss is weighed against it first
    int32_t p = prob_victim(c);
    return p >= 0 ? p : v;
}

// --- single-key calls -------------------------------------------------------------------

int g53_clock_lookup(g53_clock *c, int32_t key, int32_t *slot) {
    if (!c || !slot) return G53_CLOCK_E_ARG;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    count_access(c, key);
    int32_t s = c->slot_of[key];
    if (s >= 0) {
        mark_hit(c, s);
        c->n.hits++;
    } else {
        c->n.misses++;
    }
    *slot = s;
    return G53_CLOCK_OK;
}

int g53_clock_admit(g53_clock *c, int32_t key, int32_t *slot, int32_t *evicted_key) {
    if (!c || !slot || !evicted_key) return G53_CLOCK_E_ARG;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    if (c->slot_of[key] >= 0) return G53_CLOCK_E_RESIDENT;
    int32_t s;
    int on_probation = 0;
    if (c->n_free > 0) {
        s = free_take(c);
    } else {
        if (c->n_active == 0) return G53_CLOCK_E_NO_CAPACITY;
        if (c->n_pinned == c->n_active) return G53_CLOCK_E_ALL_PINNED;
        s = find_victim(c, 0);
        if (c->freq) {
            c->prob_cursor = c->prob_tail;  // a single admit is a batch of one
            s = contest(c, key, s, &on_probation);
        }
    }
    *evicted_key = place(c, key, s);
    if (on_probation) prob_push(c, s);
    *slot = s;
    return G53_CLOCK_OK;
}

int g53_clock_remove(g53_clock *c, int32_t key, int32_t *slot) {
    if (!c || !slot) return G53_CLOCK_E_ARG;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    int32_t s = c->slot_of[key];
    if (s >= 0) {
        if (c->pins[s] > 0) return G53_CLOCK_E_PINNED;
        prob_unlink(c, s);
        c->slot_of[key] = -1;
        c->key_of[s] = -1;
        c->ref[s] = 0;
        c->n_used--;
        free_set(c, s);
    }
    *slot = s;
    return G53_CLOCK_OK;
}

int g53_clock_pin(g53_clock *c, int32_t slot) {
    if (!c) return G53_CLOCK_E_ARG;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    if (slot >= c->n_active) return G53_CLOCK_E_SLOT_DISABLED;
    if (c->key_of[slot] < 0) return G53_CLOCK_E_SLOT_EMPTY;
    if (c->pins[slot] == INT32_MAX) return G53_CLOCK_E_PIN_OVERFLOW;
    if (c->pins[slot]++ == 0) c->n_pinned++;
    return G53_CLOCK_OK;
}

int g53_clock_unpin(g53_clock *c, int32_t slot) {
    if (!c) return G53_CLOCK_E_ARG;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    if (c->pins[slot] == 0) return G53_CLOCK_E_NOT_PINNED;
    if (--c->pins[slot] == 0) c->n_pinned--;
    return G53_CLOCK_OK;
}

int g53_clock_pin_count(const g53_clock *c, int32_t slot, int32_t *count) {
    if (!c || !count) return G53_CLOCK_E_ARG;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    *count = c->pins[slot];
    return G53_CLOCK_OK;
}

int g53_clock_contains(const g53_clock *c, int32_t key, int32_t *is_resident) {
    if (!c || !is_resident) return G53_CLOCK_E_ARG;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    *is_resident = c->slot_of[key] >= 0;
    return G53_CLOCK_OK;
}

int g53_clock_slot_of(const g53_clock *c, int32_t key, int32_t *slot) {
    if (!c || !slot) return G53_CLOCK_E_ARG;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    *slot = c->slot_of[key];
    return G53_CLOCK_OK;
}

int g53_clock_key_of(const g53_clock *c, int32_t slot, int32_t *key) {
    if (!c || !key) return G53_CLOCK_E_ARG;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    *key = c->key_of[slot];
    return G53_CLOCK_OK;
}

int g53_clock_ref_bit(const g53_clock *c, int32_t slot, int32_t *ref_bit) {
    if (!c || !ref_bit) return G53_CLOCK_E_ARG;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    *ref_bit = c->ref[slot];
    return G53_CLOCK_OK;
}

// --- batch ------------------------------------------------------------------------------

static void next_epoch(g53_clock *c) {
    if (++c->epoch == 0) {  // wrapped: old stamps could match again
        memset(c->key_stamp, 0, sizeof(uint32_t) * (size_t)c->n_keys);
        memset(c->slot_stamp, 0, sizeof(uint32_t) * (size_t)c->n_slots);
        c->epoch = 1;
    }
}

int g53_clock_batch(g53_clock *c, const int32_t *picks, int32_t n_picks, int32_t admit_limit,
                    int32_t *out_keys, int32_t *out_slots, int32_t *out_evicted, int32_t cap,
                    g53_clock_batch_result *result) {
    if (!c || !result || n_picks < 0 || admit_limit < 0 || cap < 0) return G53_CLOCK_E_ARG;
    if (n_picks > 0 && (!picks || !out_keys || !out_slots || !out_evicted))
        return G53_CLOCK_E_ARG;
    next_epoch(c);
    const uint32_t epoch = c->epoch;

    // Pass 1: range check, dedup, split hits (straight to the outputs) from misses. Only
    // scratch stamps change, so an error here leaves the table as it was.
    int32_t n_hits = 0, n_miss = 0;
    for (int32_t i = 0; i < n_picks; i++) {
        int32_t key = picks[i];
        if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
        if (c->key_stamp[key] == epoch) continue;
        c->key_stamp[key] = epoch;
        if (n_hits + n_miss == cap) return G53_CLOCK_E_OUT_SMALL;
        int32_t s = c->slot_of[key];
        if (s >= 0) {
            out_keys[n_hits] = key;
            out_slots[n_hits] = s;
            out_evicted[n_hits] = -1;
            n_hits++;
        } else {
            c->miss_keys[n_miss++] = key;
        }
    }

    // Pass 2: count every distinct pick (frequency mode), mark hits; hits are protected for
    // the rest of this batch.
    if (c->freq) {
        for (int32_t i = 0; i < n_hits; i++) count_access(c, out_keys[i]);
        for (int32_t i = 0; i < n_miss; i++) count_access(c, c->miss_keys[i]);
    }
    int32_t n_protected = 0;  // unpinned enabled slots stamped by this batch
    for (int32_t i = 0; i < n_hits; i++) {
        int32_t s = out_slots[i];
        mark_hit(c, s);
        c->slot_stamp[s] = epoch;
        n_protected += c->pins[s] == 0;
    }
    c->prob_cursor = c->prob_tail;  // probation members placed before this batch

    // Pass 3: admit misses in first-seen order until the limit or the victims run out.
    int32_t n_admitted = 0, want = n_miss < admit_limit ? n_miss : admit_limit;
    while (n_admitted < want) {
        int32_t s;
        if (c->n_free > 0) {
            s = free_take(c);
        } else if (c->n_active - c->n_pinned - n_protected > 0) {
            s = find_victim(c, 1);
        } else {
            c->n.no_victim++;
            break;
        }
        int32_t key = c->miss_keys[n_admitted], o = n_hits + n_admitted;
        int on_probation = 0;
        if (c->freq && c->key_of[s] >= 0) s = contest(c, key, s, &on_probation);
        out_keys[o] = key;
        out_evicted[o] = place(c, key, s);
        if (on_probation) prob_push(c, s);
        out_slots[o] = s;
        c->slot_stamp[s] = epoch;
        n_protected++;
        n_admitted++;
    }
    for (int32_t i = n_admitted; i < n_miss; i++) {
        int32_t o = n_hits + i;
        out_keys[o] = c->miss_keys[i];
        out_slots[o] = -1;
        out_evicted[o] = -1;
    }

    c->n.hits += (uint64_t)n_hits;
    c->n.misses += (uint64_t)n_miss;
    result->n_unique = n_hits + n_miss;
    result->n_hits = n_hits;
    result->n_admitted = n_admitted;
    return G53_CLOCK_OK;
}

// --- elastic capacity, warm start -------------------------------------------------------

int g53_clock_shrink(g53_clock *c, int32_t k, int32_t *evicted_keys, int32_t cap,
                     int32_t *n_evicted) {
    if (!c || !n_evicted || k < 0 || k > c->n_active || cap < 0) return G53_CLOCK_E_ARG;
    int32_t lo = c->n_active - k, held = 0;
    for (int32_t s = lo; s < c->n_active; s++) {
        if (c->pins[s] > 0) return G53_CLOCK_E_PINNED;
        held += c->key_of[s] >= 0;
    }
    if (held > cap) return G53_CLOCK_E_OUT_SMALL;
    if (held > 0 && !evicted_keys) return G53_CLOCK_E_ARG;
    int32_t n = 0;
    for (int32_t s = lo; s < c->n_active; s++) {
        int32_t key = c->key_of[s];
        prob_unlink(c, s);
        if (key >= 0) {
            evicted_keys[n++] = key;
            c->slot_of[key] = -1;
            c->key_of[s] = -1;
            c->n_used--;
        } else if (free_test(c, s)) {
            free_clear(c, s);
        }
        c->ref[s] = 0;
    }
    c->n_active = lo;
    if (c->hand >= lo) c->hand = 0;
    *n_evicted = n;
    return G53_CLOCK_OK;
}

int g53_clock_grow(g53_clock *c, int32_t k) {
    if (!c || k < 0 || k > c->n_slots - c->n_active) return G53_CLOCK_E_ARG;
    for (int32_t s = c->n_active; s < c->n_active + k; s++) free_set(c, s);
    c->n_active += k;
    return G53_CLOCK_OK;
}

int g53_clock_seed(g53_clock *c, const int32_t *keys, int32_t n, int32_t *n_seeded) {
    if (!c || !n_seeded || n < 0 || (n > 0 && !keys)) return G53_CLOCK_E_ARG;
    if (c->n_used > 0) return G53_CLOCK_E_NOT_EMPTY;
    next_epoch(c);
    for (int32_t i = 0; i < n; i++) {
        int32_t key = keys[i];
        if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
        if (c->key_stamp[key] == c->epoch) return G53_CLOCK_E_DUPLICATE;
        c->key_stamp[key] = c->epoch;
    }
    int32_t m = n < c->n_active ? n : c->n_active;
    for (int32_t i = 0; i < m; i++) {
        int32_t s = m - 1 - i;
        free_clear(c, s);
        c->key_of[s] = keys[i];
        c->slot_of[keys[i]] = s;
        c->ref[s] = 0;
        if (c->freq && c->freq[keys[i]] == 0) c->freq[keys[i]] = 1;  // a newcomer must beat it
    }
    c->n_used = m;
    c->hand = 0;
    *n_seeded = m;
    return G53_CLOCK_OK;
}

int g53_clock_clear(g53_clock *c) {
    if (!c) return G53_CLOCK_E_ARG;
    if (c->n_pinned > 0) return G53_CLOCK_E_PINNED;
    reset_slots(c);
    return G53_CLOCK_OK;
}

int g53_clock_info_get(const g53_clock *c, g53_clock_info *out) {
    if (!c || !out) return G53_CLOCK_E_ARG;
    out->n_slots = c->n_slots;
    out->n_keys = c->n_keys;
    out->n_active = c->n_active;
    out->n_used = c->n_used;
    out->n_pinned = c->n_pinned;
    out->hand = c->hand;
    return G53_CLOCK_OK;
}

int g53_clock_counters_get(const g53_clock *c, g53_clock_counters *out) {
    if (!c || !out) return G53_CLOCK_E_ARG;
    *out = c->n;
    return G53_CLOCK_OK;
}

int g53_clock_counters_reset(g53_clock *c) {
    if (!c) return G53_CLOCK_E_ARG;
    memset(&c->n, 0, sizeof(c->n));
    memset(&c->fn, 0, sizeof(c->fn));
    return G53_CLOCK_OK;
}

// --- frequency mode: peeks and counters -------------------------------------------------

int g53_clock_freq_of(const g53_clock *c, int32_t key, uint32_t *count) {
    if (!c || !count) return G53_CLOCK_E_ARG;
    if (!c->freq) return G53_CLOCK_E_NOT_FREQ;
    if (!key_ok(c, key)) return G53_CLOCK_E_KEY_RANGE;
    *count = c->freq[key];
    return G53_CLOCK_OK;
}

int g53_clock_freq_copy(const g53_clock *c, uint32_t *out, int32_t cap) {
    if (!c || cap < 0 || (cap > 0 && !out)) return G53_CLOCK_E_ARG;
    if (!c->freq) return G53_CLOCK_E_NOT_FREQ;
    if (cap < c->n_keys) return G53_CLOCK_E_OUT_SMALL;
    memcpy(out, c->freq, sizeof(uint32_t) * (size_t)c->n_keys);
    return G53_CLOCK_OK;
}

int g53_clock_on_probation(const g53_clock *c, int32_t slot, int32_t *on_probation) {
    if (!c || !on_probation) return G53_CLOCK_E_ARG;
    if (!c->freq) return G53_CLOCK_E_NOT_FREQ;
    if (!slot_ok(c, slot)) return G53_CLOCK_E_SLOT_RANGE;
    *on_probation = c->in_prob[slot];
    return G53_CLOCK_OK;
}

int g53_clock_freq_info_get(const g53_clock *c, g53_clock_freq_info *out) {
    if (!c || !out) return G53_CLOCK_E_ARG;
    if (!c->freq) return G53_CLOCK_E_NOT_FREQ;
    out->max_count = c->max_count;
    out->n_probation = c->n_prob;
    out->freq_window = c->freq_window;
    out->freq_events = c->freq_events;
    out->counters = c->fn;
    return G53_CLOCK_OK;
}
