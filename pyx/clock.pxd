# The C API of pyx/clock.h, for Cython modules that call it without the GIL:
#     from clock cimport g53_clock, g53_clock_batch
#     cdef g53_clock *table = <g53_clock *><uintptr_t>clock_obj.handle
# Keep a reference to the glm53._clock.Clock object for as long as the pointer is used.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t


cdef extern from "clock.h" nogil:
    enum:
        G53_CLOCK_OK
        G53_CLOCK_E_NOMEM
        G53_CLOCK_E_ARG
        G53_CLOCK_E_KEY_RANGE
        G53_CLOCK_E_SLOT_RANGE
        G53_CLOCK_E_NOT_PINNED
        G53_CLOCK_E_ALL_PINNED
        G53_CLOCK_E_NO_CAPACITY
        G53_CLOCK_E_PINNED
        G53_CLOCK_E_RESIDENT
        G53_CLOCK_E_SLOT_EMPTY
        G53_CLOCK_E_SLOT_DISABLED
        G53_CLOCK_E_NOT_EMPTY
        G53_CLOCK_E_DUPLICATE
        G53_CLOCK_E_OUT_SMALL
        G53_CLOCK_E_PIN_OVERFLOW
        G53_CLOCK_E_NOT_FREQ
        G53_CLOCK_MAX_COUNT

    ctypedef struct g53_clock:
        pass

    ctypedef struct g53_clock_counters:
        uint64_t hits
        uint64_t misses
        uint64_t admits
        uint64_t evictions
        uint64_t pinned_skips
        uint64_t no_victim

    ctypedef struct g53_clock_info:
        int32_t n_slots
        int32_t n_keys
        int32_t n_active
        int32_t n_used
        int32_t n_pinned
        int32_t hand

    ctypedef struct g53_clock_freq_config:
        int32_t max_count
        int64_t freq_window

    ctypedef struct g53_clock_freq_counters:
        uint64_t rejected
        uint64_t probation_hits
        uint64_t agings

    ctypedef struct g53_clock_freq_info:
        int32_t max_count
        int32_t n_probation
        int64_t freq_window
        int64_t freq_events
        g53_clock_freq_counters counters

    ctypedef struct g53_clock_batch_result:
        int32_t n_unique
        int32_t n_hits
        int32_t n_admitted

    const char *g53_clock_strerror(int code)
    int g53_clock_create(int32_t n_slots, int32_t n_keys, g53_clock **out)
    int g53_clock_create_freq(int32_t n_slots, int32_t n_keys, const g53_clock_freq_config *cfg,
                              g53_clock **out)
    void g53_clock_destroy(g53_clock *c)

    int g53_clock_lookup(g53_clock *c, int32_t key, int32_t *slot)
    int g53_clock_admit(g53_clock *c, int32_t key, int32_t *slot, int32_t *evicted_key)
    int g53_clock_remove(g53_clock *c, int32_t key, int32_t *slot)

    int g53_clock_pin(g53_clock *c, int32_t slot)
    int g53_clock_unpin(g53_clock *c, int32_t slot)
    int g53_clock_pin_count(const g53_clock *c, int32_t slot, int32_t *count)

    int g53_clock_contains(const g53_clock *c, int32_t key, int32_t *is_resident)
    int g53_clock_slot_of(const g53_clock *c, int32_t key, int32_t *slot)
    int g53_clock_key_of(const g53_clock *c, int32_t slot, int32_t *key)
    int g53_clock_ref_bit(const g53_clock *c, int32_t slot, int32_t *ref_bit)

    int g53_clock_batch(g53_clock *c, const int32_t *picks, int32_t n_picks, int32_t admit_limit,
                        int32_t *out_keys, int32_t *out_slots, int32_t *out_evicted,
                        int32_t cap, g53_clock_batch_result *result)

    int g53_clock_shrink(g53_clock *c, int32_t k, int32_t *evicted_keys, int32_t cap,
                         int32_t *n_evicted)
    int g53_clock_grow(g53_clock *c, int32_t k)
    int g53_clock_seed(g53_clock *c, const int32_t *keys, int32_t n, int32_t *n_seeded)
    int g53_clock_clear(g53_clock *c)

    int g53_clock_info_get(const g53_clock *c, g53_clock_info *out)
    int g53_clock_counters_get(const g53_clock *c, g53_clock_counters *out)
    int g53_clock_counters_reset(g53_clock *c)

    int g53_clock_freq_of(const g53_clock *c, int32_t key, uint32_t *count)
    int g53_clock_freq_copy(const g53_clock *c, uint32_t *out, int32_t cap)
    int g53_clock_on_probation(const g53_clock *c, int32_t slot, int32_t *on_probation)
    int g53_clock_freq_info_get(const g53_clock *c, g53_clock_freq_info *out)
