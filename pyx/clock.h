// CLOCK (second chance) table: which integer key lives in which of n_slots fixed-size slots.
//
// The VRAM expert cache and the RAM tier each keep one table. A key is
// `layer * experts_per_layer + expert`, in [0, n_keys). The table holds bookkeeping only;
// the caller moves the bytes.
//
// Policy, exactly (glm53/tiers/clock_ref.py is the pure-Python twin the tests compare with):
// - Slots [0, n_active) are enabled; shrink/grow move n_active within [0, n_slots].
// - A hit sets the slot's reference bit. A fresh admission starts with it clear (hit rate
//   0.394 against 0.367 with it set, bench/micro_clock.py stream, 6,000 tokens).
// - Admission takes the lowest free enabled slot. With none free, the hand runs over
//   [0, n_active): a pinned slot is skipped (pinned_skips += 1), a set reference bit is
//   cleared (second chance), the first unpinned slot with a clear bit is the victim and the
//   hand stops one past it.
// - A pinned slot (pin count > 0) is never a victim, never removed, never shrunk away.
// - g53_clock_batch handles one layer's picks: dedup in first-seen order, mark every hit,
//   then admit misses up to a limit. Slots hit or filled by the batch are protected from
//   the rest of that batch (skipped by the hand, not counted as pinned skips). If no victim
//   is left, admission stops for the batch (no_victim += 1); that is not an error.
//
//
// Frequency mode (g53_clock_create_freq; the RAM tier's policy, glm53/tiers/policy_sim.py
// measures it): the same table, hand, pins and batch contract, plus
// - a count per key (resident or not) of its accesses: each lookup, and each distinct pick of
//   a batch, hit or miss, adds one (saturating). Every freq_window accesses all counts halve
//   (0: never), so the counts follow a skew that drifts.
// - a slot's reference bit is a count in [0, max_count]: a hit raises it by one, the hand
//   lowers it by one and takes the first unpinned (and unprotected) slot at 0. max_count 1 is
//   plain CLOCK's bit.
// - admission by frequency: a miss that finds a free slot takes it. Else the hand picks a
//   victim v as above; the missed key takes v's slot only if its count is higher than v's
//   key's. If not, it goes on probation: it takes the slot of the newest probation member
//   placed before this batch (or call) that is not pinned, evicting that member, and v stays;
//   with no such member it takes v's slot. Either way it joins probation as the newest, and
//   the hand goes back to v, so the next miss is weighed against the same victim (hit rate
//   +0.3 point, bench/ram_tier_policy.py, against moving on past a victim that won). A
//   probation member that is hit leaves probation. So keys seen once (a long prompt's
//   prefill, a burst) evict one another and not the frequent keys: one batch can displace at
//   most its own misses' worth of them, where plain CLOCK is flushed by a long burst.
// - seed sets the count of each seeded key to at least 1, so a key seen once does not beat it.
// Every peek above (ref_bit: the count) and every error code hold in both modes.
//
// Errors: every function returns 0 or a negative G53_CLOCK_E_* code. On an error the table
// is unchanged (counters included).
// Threading: none inside. One thread owns a table; calls need no GIL and do no I/O.
// Memory: create allocates about 12 * n_keys + 13 * n_slots bytes (frequency mode: another
// 4 * n_keys + 9 * n_slots); destroy frees it. Cost: a batch is O(picks) plus the hand's
// steps, which the hits' count raises pay for; frequency mode adds O(1) per pick and an aging
// pass of O(n_keys) every freq_window accesses (amortized O(1) when freq_window >= n_keys).
#ifndef G53_CLOCK_H
#define G53_CLOCK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    G53_CLOCK_OK = 0,
    G53_CLOCK_E_NOMEM = -1,         // allocation failed
    G53_CLOCK_E_ARG = -2,           // NULL pointer, negative count or size out of range
    G53_CLOCK_E_KEY_RANGE = -3,     // key outside [0, n_keys)
    G53_CLOCK_E_SLOT_RANGE = -4,    // slot outside [0, n_slots)
    G53_CLOCK_E_NOT_PINNED = -5,    // unpin of a slot whose pin count is 0
    G53_CLOCK_E_ALL_PINNED = -6,    // admit with no free slot and every enabled slot pinned
    G53_CLOCK_E_NO_CAPACITY = -7,   // admit with zero enabled slots (all shrunk away)
    G53_CLOCK_E_PINNED = -8,        // remove/shrink/clear would drop a pinned slot
    G53_CLOCK_E_RESIDENT = -9,      // admit of a key that already has a slot
    G53_CLOCK_E_SLOT_EMPTY = -10,   // pin of a slot that holds no key
    G53_CLOCK_E_SLOT_DISABLED = -11,// pin of a slot at or past n_active
    G53_CLOCK_E_NOT_EMPTY = -12,    // seed on a table that holds keys
    G53_CLOCK_E_DUPLICATE = -13,    // seed list names a key twice
    G53_CLOCK_E_OUT_SMALL = -14,    // output array too short
    G53_CLOCK_E_PIN_OVERFLOW = -15, // pin count would pass INT32_MAX
    G53_CLOCK_E_NOT_FREQ = -16,     // a frequency-mode call on a plain CLOCK table
};

#define G53_CLOCK_MAX_COUNT 15  // the largest max_count of a frequency table

typedef struct g53_clock g53_clock;  // opaque

typedef struct {
    uint64_t hits;          // lookups (and distinct batch picks) found resident
    uint64_t misses;        // lookups (and distinct batch picks) not resident
    uint64_t admits;        // keys given a slot by admit or batch
    uint64_t evictions;     // resident keys displaced by admit or batch (not shrink/remove)
    uint64_t pinned_skips;  // times the hand passed a pinned slot
    uint64_t no_victim;     // batches that stopped admitting for lack of a victim
} g53_clock_counters;

typedef struct {
    int32_t n_slots;   // capacity given to create
    int32_t n_keys;
    int32_t n_active;  // enabled slots: [0, n_active)
    int32_t n_used;    // slots holding a key
    int32_t n_pinned;  // slots with pin count > 0
    int32_t hand;      // next slot the hand inspects, in [0, max(n_active, 1))
} g53_clock_info;

typedef struct {
    int32_t max_count;    // in [1, G53_CLOCK_MAX_COUNT]
    int64_t freq_window;  // accesses between agings (halving every count); 0: never
} g53_clock_freq_config;

typedef struct {
    uint64_t rejected;        // misses that lost the admission contest (went on probation)
    uint64_t probation_hits;  // probation members hit (they leave probation)
    uint64_t agings;          // times every count was halved
} g53_clock_freq_counters;

typedef struct {
    int32_t max_count;
    int32_t n_probation;  // slots on probation now
    int64_t freq_window;
    int64_t freq_events;  // accesses counted since the last aging (halved at each)
    g53_clock_freq_counters counters;
} g53_clock_freq_info;

typedef struct {
    int32_t n_unique;    // distinct picks, = n_hits + n_admitted + misses not admitted
    int32_t n_hits;
    int32_t n_admitted;
} g53_clock_batch_result;

const char *g53_clock_strerror(int code);

// 1 <= n_slots, 1 <= n_keys, both <= 1 << 28. All slots start enabled and empty.
int g53_clock_create(int32_t n_slots, int32_t n_keys, g53_clock **out);
// The same, in frequency mode (cfg is copied; G53_CLOCK_E_ARG if a field is out of range).
int g53_clock_create_freq(int32_t n_slots, int32_t n_keys, const g53_clock_freq_config *cfg,
                          g53_clock **out);
void g53_clock_destroy(g53_clock *c);  // NULL is fine

// *slot = the key's slot (reference bit set; hits += 1), or -1 (misses += 1).
int g53_clock_lookup(g53_clock *c, int32_t key, int32_t *slot);
// Gives a non-resident key a slot; *evicted_key = the displaced key or -1.
int g53_clock_admit(g53_clock *c, int32_t key, int32_t *slot, int32_t *evicted_key);
// Drops a key; *slot = the freed slot, or -1 if the key was not resident (not an error).
int g53_clock_remove(g53_clock *c, int32_t key, int32_t *slot);

// Pins count: each pin needs one unpin. Only an enabled slot that holds a key can be pinned.
int g53_clock_pin(g53_clock *c, int32_t slot);
int g53_clock_unpin(g53_clock *c, int32_t slot);
int g53_clock_pin_count(const g53_clock *c, int32_t slot, int32_t *count);

// Peeks: no reference bit, no counter.
int g53_clock_contains(const g53_clock *c, int32_t key, int32_t *is_resident);
int g53_clock_slot_of(const g53_clock *c, int32_t key, int32_t *slot);     // -1 if absent
int g53_clock_key_of(const g53_clock *c, int32_t slot, int32_t *key);      // -1 if empty
int g53_clock_ref_bit(const g53_clock *c, int32_t slot, int32_t *ref_bit);

// One layer's picks. picks[n_picks] may repeat keys. admit_limit >= 0 caps admissions.
// out_keys/out_slots/out_evicted[cap] (cap >= distinct picks; n_picks always suffices) get,
// per distinct pick, in sections:
//   [0, n_hits)                    hits in first-seen order, slot, evicted -1
//   [n_hits, n_hits + n_admitted)  admitted misses, their new slot, the displaced key or -1
//   [n_hits + n_admitted, n_unique) misses not admitted, slot -1, evicted -1
// A pick outside [0, n_keys) fails the whole call before anything changes.
int g53_clock_batch(g53_clock *c, const int32_t *picks, int32_t n_picks, int32_t admit_limit,
                    int32_t *out_keys, int32_t *out_slots, int32_t *out_evicted, int32_t cap,
                    g53_clock_batch_result *result);

// Disables the last k enabled slots (fails if one is pinned). Their keys, in slot order, go
// to evicted_keys[cap] (cap >= keys held there; k always suffices). The hand wraps to 0 if it
// falls outside. grow re-enables k slots, empty.
int g53_clock_shrink(g53_clock *c, int32_t k, int32_t *evicted_keys, int32_t cap,
                     int32_t *n_evicted);
int g53_clock_grow(g53_clock *c, int32_t k);

// Warm start on an empty table: keys[n] is a heat list, hottest first, no repeats. The first
// m = min(n, n_active) keys fill slots m-1 .. 0 (hottest highest), reference bits clear, hand
// at 0, so the hand meets the coldest seeded key first. Counters are not touched.
int g53_clock_seed(g53_clock *c, const int32_t *keys, int32_t n, int32_t *n_seeded);
// Empties every slot (fails if one is pinned); hand to 0; counters kept.
int g53_clock_clear(g53_clock *c);

int g53_clock_info_get(const g53_clock *c, g53_clock_info *out);

// Frequency mode only (G53_CLOCK_E_NOT_FREQ on a plain table). freq_copy: out[cap], cap >=
// n_keys, gets every key's count. counters_reset also zeroes the frequency counters.
int g53_clock_freq_of(const g53_clock *c, int32_t key, uint32_t *count);
int g53_clock_freq_copy(const g53_clock *c, uint32_t *out, int32_t cap);
int g53_clock_on_probation(const g53_clock *c, int32_t slot, int32_t *on_probation);
int g53_clock_freq_info_get(const g53_clock *c, g53_clock_freq_info *out);
int g53_clock_counters_get(const g53_clock *c, g53_clock_counters *out);
int g53_clock_counters_reset(g53_clock *c);

#ifdef __cplusplus
}
#endif
#endif
