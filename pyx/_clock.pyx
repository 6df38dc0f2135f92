"""CLOCK table of expert slots, plain or with frequency admission (policy="freq", the RAM tier's):
a thin door onto pyx/clock.c (both policies are in pyx/clock.h)."""

from libc.stdint cimport int32_t, int64_t, uint32_t, uintptr_t

from clock cimport *

from collections import namedtuple

import operator

import numpy as np

ClockBatch = namedtuple("ClockBatch", ["keys", "slots", "evicted", "n_hits", "n_admitted"])
ClockBatch.__doc__ = """One layer's picks after Clock.batch: int32 arrays over the distinct picks, in
sections [hits | admitted misses | misses not admitted]; slots is -1 for a miss not admitted,
evicted is the key an admission displaced, else -1."""

COUNTER_NAMES = ("hits", "misses", "admits", "evictions", "pinned_skips", "no_victim")
FREQ_COUNTER_NAMES = ("rejected", "probation_hits", "agings")  # policy="freq" only
POLICIES = ("clock", "freq")
MAX_SIZE = 1 << 28
MAX_COUNT = G53_CLOCK_MAX_COUNT
FREQ_WINDOW_PER_SLOT = 32  # policy="freq": the counts age every 32 accesses per slot by default
cdef int32_t NO_LIMIT = 2147483647


def _describe(obj):
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return f"{type(obj).__name__} of dtype {obj.dtype} and shape {tuple(obj.shape)}"
    return type(obj).__name__


cdef const int32_t[::1] _in_i32(str call, object arr, str name):
    try:
        return arr
    except (TypeError, ValueError, BufferError):
        raise TypeError(
            f"Clock.{call}: {name} must be a 1-D C-contiguous int32 array, got "
            f"{_describe(arr)}; "
            f"convert it with np.ascontiguousarray({name}, dtype=np.int32)"
        ) from None


cdef int32_t[::1] _out_i32(str call, object arr, str name):
    try:
        return arr
    except (TypeError, ValueError, BufferError):
        raise TypeError(
            f"Clock.{call}: {name} must be a writable 1-D C-contiguous int32 array, got "
            f"{_describe(arr)}; "
            f"allocate it with np.empty(n, dtype=np.int32)"
        ) from None


cdef int32_t _limit(str call, object admit_limit) except -2:
    if admit_limit is None:
        return NO_LIMIT
    cdef long long v = _as_int(call, "admit_limit", admit_limit)
    if v < 0 and admit_limit < 0:
        raise ValueError(f"Clock.{call}: admit_limit must be >= 0 or None (no limit), got "
                         f"{admit_limit}")
    return NO_LIMIT if v < 0 or v > NO_LIMIT else <int32_t>v


cdef inline long long _as_int(str call, str name, object v) except? -1:
    # Python ints and objects with __index__ (numpy integers); never a float. Values beyond
    # +-2**62 come back as -1, which every range check rejects.
    if not isinstance(v, int):
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"Clock.{call}: {name} must be an integer, got "
                            f"{type(v).__name__}") from None
    if -(1 << 62) < v < (1 << 62):
        return v
    return -1


cdef _error_type(int rc):
    if rc == G53_CLOCK_E_KEY_RANGE or rc == G53_CLOCK_E_SLOT_RANGE:
        return IndexError
    if rc == G53_CLOCK_E_ARG or rc == G53_CLOCK_E_OUT_SMALL or rc == G53_CLOCK_E_DUPLICATE:
        return ValueError
    if rc == G53_CLOCK_E_NOMEM:
        return MemoryError
    return RuntimeError


cdef class Clock:
    """CLOCK (second chance) table: n_slots slots holding integer keys in [0, n_keys).

    policy="clock" (the default) is plain CLOCK. policy="freq" adds a count of accesses per key
    (halved every freq_window accesses; default FREQ_WINDOW_PER_SLOT * n_slots, at least n_keys;
    0: never), a reference count in [0, max_count] per slot, and admission by frequency: a miss
    that is not more frequent than the hand's victim goes on probation and evicts the newest
    probation member instead (pyx/clock.h has the policy exactly).

    Not thread-safe: one thread (the tier controller) owns a table. `handle` gives C code the
    table for nogil calls through pyx/clock.pxd; keep this object alive meanwhile.
    """

    cdef g53_clock *_c
    cdef readonly int32_t n_slots
    cdef readonly int32_t n_keys
    cdef readonly str policy

    def __cinit__(self, long long n_slots, long long n_keys, *, str policy="clock",
                  max_count=3, freq_window=None):
        if not 1 <= n_slots <= MAX_SIZE:
            raise ValueError(f"Clock: n_slots must be in [1, 2**28], got {n_slots}")
        if not 1 <= n_keys <= MAX_SIZE:
            raise ValueError(f"Clock: n_keys must be in [1, 2**28], got {n_keys}")
        if policy not in POLICIES:
            raise ValueError(f"Clock: policy must be one of {', '.join(POLICIES)}, got "
                             f"{policy!r}")
        cdef g53_clock_freq_config cfg
        if policy == "clock":
            rc = g53_clock_create(<int32_t>n_slots, <int32_t>n_keys, &self._c)
        else:
            count = _as_int("__init__", "max_count", max_count)
            if not 1 <= count <= MAX_COUNT:
                raise ValueError(f"Clock: max_count must be in [1, {MAX_COUNT}], got "
                                 f"{max_count}")
            if freq_window is None:
                window = max(FREQ_WINDOW_PER_SLOT * n_slots, n_keys)
            else:
                window = _as_int("__init__", "freq_window", freq_window)
                if not 0 <= window < (1 << 62):
                    raise ValueError(f"Clock: freq_window must be >= 0 (0: the counts never "
                                     f"age), got {freq_window}")
            cfg.max_count = <int32_t>count
            cfg.freq_window = <int64_t>window
            rc = g53_clock_create_freq(<int32_t>n_slots, <int32_t>n_keys, &cfg, &self._c)
        if rc:
            raise _error_type(rc)(f"Clock({n_slots}, {n_keys}): {g53_clock_strerror(rc).decode()}")
        self.n_slots = <int32_t>n_slots
        self.n_keys = <int32_t>n_keys
        self.policy = policy

    def __dealloc__(self):
        g53_clock_destroy(self._c)

    # --- errors ---------------------------------------------------------------------------

    cdef _fail(self, int rc, str call, object key, object slot):
        cdef g53_clock_info i
        cdef int32_t n = 0
        g53_clock_info_get(self._c, &i)
        if rc == G53_CLOCK_E_KEY_RANGE:
            msg = (f"key {key} is outside [0, {i.n_keys}); "
                   f"a key is layer * experts_per_layer + expert")
        elif rc == G53_CLOCK_E_SLOT_RANGE:
            msg = f"slot {slot} is outside [0, {i.n_slots})"
        elif rc == G53_CLOCK_E_NOT_PINNED:
            msg = f"slot {slot} is not pinned; each unpin() must match an earlier pin()"
        elif rc == G53_CLOCK_E_ALL_PINNED:
            msg = (f"no free slot and all {i.n_active} enabled slots are pinned; "
                   f"unpin a slot first")
        elif rc == G53_CLOCK_E_NO_CAPACITY:
            msg = f"no enabled slot (shrunk to 0 of {i.n_slots}); grow() the table first"
        elif rc == G53_CLOCK_E_PINNED:
            g53_clock_pin_count(self._c, <int32_t>slot, &n)
            msg = f"key {key} is in slot {slot}, which is pinned ({n} pins); unpin it first"
        elif rc == G53_CLOCK_E_RESIDENT:
            msg = f"key {key} already holds slot {slot}; call lookup() before admit()"
        elif rc == G53_CLOCK_E_SLOT_EMPTY:
            msg = (f"slot {slot} holds no key; pin only a slot that lookup(), admit() "
                   f"or batch() returned")
        elif rc == G53_CLOCK_E_SLOT_DISABLED:
            msg = (f"slot {slot} is disabled (enabled slots are [0, {i.n_active})); "
                   f"grow() the table first")
        elif rc == G53_CLOCK_E_NOT_EMPTY:
            msg = (f"the table holds {i.n_used} keys; seed() fills an empty table "
                   f"(call clear() first)")
        elif rc == G53_CLOCK_E_PIN_OVERFLOW:
            msg = f"slot {slot} is already pinned 2**31 - 1 times"
        else:
            msg = g53_clock_strerror(rc).decode()
        return _error_type(rc)(f"Clock.{call}: {msg}")

    cdef inline int32_t _key(self, str call, object key) except -1:
        cdef long long k = _as_int(call, "key", key)
        if not 0 <= k < self.n_keys:
            raise self._fail(G53_CLOCK_E_KEY_RANGE, call, key, -1)
        return <int32_t>k

    cdef inline int32_t _slot(self, str call, object slot) except -1:
        cdef long long s = _as_int(call, "slot", slot)
        if not 0 <= s < self.n_slots:
            raise self._fail(G53_CLOCK_E_SLOT_RANGE, call, -1, slot)
        return <int32_t>s

    # --- single-key calls -----------------------------------------------------------------

    def lookup(self, key):
        """The key's slot (its reference bit set; counts a hit), or -1 (counts a miss)."""
        cdef int32_t slot
        rc = g53_clock_lookup(self._c, self._key("lookup", key), &slot)
        if rc:
            raise self._fail(rc, "lookup", key, -1)
        return slot

    def admit(self, key):
        """Give a non-resident key a slot: (slot, evicted_key or -1)."""
        cdef int32_t k = self._key("admit", key), slot = -1, evicted = -1
        rc = g53_clock_admit(self._c, k, &slot, &evicted)
        if rc:
            g53_clock_slot_of(self._c, k, &slot)
            raise self._fail(rc, "admit", key, slot)
        return slot, evicted

    def remove(self, key):
        """Drop the key; returns the freed slot, or -1 if the key was not resident."""
        cdef int32_t k = self._key("remove", key), slot = -1
        rc = g53_clock_remove(self._c, k, &slot)
        if rc:
            g53_clock_slot_of(self._c, k, &slot)
            raise self._fail(rc, "remove", key, slot)
        return slot

    def pin(self, slot):
        """Protect an occupied enabled slot from eviction; pins count, each needs an unpin."""
        rc = g53_clock_pin(self._c, self._slot("pin", slot))
        if rc:
            raise self._fail(rc, "pin", -1, slot)

    def unpin(self, slot):
        rc = g53_clock_unpin(self._c, self._slot("unpin", slot))
        if rc:
            raise self._fail(rc, "unpin", -1, slot)

    def pin_count(self, slot):
        cdef int32_t n
        g53_clock_pin_count(self._c, self._slot("pin_count", slot), &n)
        return n

    def contains(self, key):
        """Whether the key holds a slot (no reference bit, no counter)."""
        cdef int32_t r
        g53_clock_contains(self._c, self._key("contains", key), &r)
        return bool(r)

    def __contains__(self, key):
        return self.contains(key)

    def slot_of(self, key):
        """The key's slot or -1 (no reference bit, no counter)."""
        cdef int32_t s
        g53_clock_slot_of(self._c, self._key("slot_of", key), &s)
        return s

    def key_of(self, slot):
        """The slot's key or -1."""
        cdef int32_t k
        g53_clock_key_of(self._c, self._slot("key_of", slot), &k)
        return k

    def ref_bit(self, slot):
        """The slot's reference bit (policy="freq": its reference count, 0..max_count)."""
        cdef int32_t r
        g53_clock_ref_bit(self._c, self._slot("ref_bit", slot), &r)
        return r

    # --- frequency mode -------------------------------------------------------------------

    cdef _need_freq(self, str call):
        if self.policy != "freq":
            raise RuntimeError(f"Clock.{call}: this table is plain CLOCK; make it with "
                               f"Clock(n_slots, n_keys, policy='freq')")

    def freq_of(self, key):
        """policy="freq": the key's access count (resident or not; no counter changes)."""
        self._need_freq("freq_of")
        cdef uint32_t f
        g53_clock_freq_of(self._c, self._key("freq_of", key), &f)
        return f

    def freq_counts(self):
        """policy="freq": every key's access count, uint32 [n_keys] (a copy)."""
        self._need_freq("freq_counts")
        out = np.empty(self.n_keys, np.uint32)
        cdef uint32_t[::1] o = out
        rc = g53_clock_freq_copy(self._c, &o[0], self.n_keys)
        if rc:
            raise self._fail(rc, "freq_counts", -1, -1)
        return out

    def on_probation(self, slot):
        """policy="freq": whether the slot's key is on probation (lost its admission contest
        and has not been hit since)."""
        self._need_freq("on_probation")
        cdef int32_t r
        g53_clock_on_probation(self._c, self._slot("on_probation", slot), &r)
        return bool(r)

    def freq_info(self):
        """policy="freq": {max_count, n_probation, freq_window, freq_events}."""
        self._need_freq("freq_info")
        cdef g53_clock_freq_info i
        g53_clock_freq_info_get(self._c, &i)
        return {"max_count": i.max_count, "n_probation": i.n_probation,
                "freq_window": i.freq_window, "freq_events": i.freq_events}

    # --- batch ----------------------------------------------------------------------------

    def batch_into(self, picks, keys_out, slots_out, evicted_out, admit_limit=None):
        """One layer's picks (int32 array, repeats allowed): dedup, mark hits, admit up to
        admit_limit misses (None: all). Fills the three int32 outputs (length >= distinct
        picks; len(picks) always suffices) in sections [hits | admitted | not admitted], as
        ClockBatch describes. Returns (n_unique, n_hits, n_admitted)."""
        cdef const int32_t[::1] p = _in_i32("batch_into", picks, "picks")
        cdef int32_t[::1] k = _out_i32("batch_into", keys_out, "keys_out")
        cdef int32_t[::1] s = _out_i32("batch_into", slots_out, "slots_out")
        cdef int32_t[::1] e = _out_i32("batch_into", evicted_out, "evicted_out")
        cdef int32_t limit = _limit("batch_into", admit_limit)
        cdef g53_clock_batch_result r
        cdef Py_ssize_t cap = min(k.shape[0], s.shape[0], e.shape[0])
        if p.shape[0] > NO_LIMIT:
            raise ValueError(f"Clock.batch_into: {p.shape[0]} picks; at most 2**31 - 1")
        cdef int32_t n = <int32_t>p.shape[0]
        cdef int32_t c = <int32_t>min(cap, NO_LIMIT)
        cdef int rc
        with nogil:
            rc = g53_clock_batch(self._c, &p[0] if n else NULL, n, limit,
                                 &k[0] if c else NULL, &s[0] if c else NULL,
                                 &e[0] if c else NULL, c, &r)
        if rc == G53_CLOCK_E_KEY_RANGE:
            for i in range(n):
                if not 0 <= p[i] < self.n_keys:
                    raise IndexError(f"Clock.batch_into: picks[{i}] = {p[i]} is outside "
                                     f"[0, {self.n_keys}); a key is layer * experts_per_layer "
                                     f"+ expert")
        if rc == G53_CLOCK_E_OUT_SMALL:
            raise ValueError(
                f"Clock.batch_into: the outputs hold {cap} entries but picks has more distinct "
                f"keys; size keys_out, slots_out and evicted_out to len(picks) = {n}")
        if rc:
            raise self._fail(rc, "batch_into", -1, -1)
        return r.n_unique, r.n_hits, r.n_admitted

    def batch(self, picks, admit_limit=None):
        """batch_into with fresh outputs; picks may be any 1-D integer array or sequence.
        Returns a ClockBatch."""
        p = self._keys_array("batch", "picks", picks)
        n = p.shape[0]
        keys = np.empty(n, np.int32)
        slots = np.empty(n, np.int32)
        evicted = np.empty(n, np.int32)
        u, h, a = self.batch_into(p, keys, slots, evicted, admit_limit)
        return ClockBatch(keys[:u], slots[:u], evicted[:u], h, a)

    def replay(self, picks, admit_limit=None):
        """Run batch() on each row of a 2-D int32 array [n_rows, width], without the GIL;
        for simulations and benchmarks. Returns int32 [n_rows, 3]: n_unique, n_hits,
        n_admitted per row. Every pick is range-checked before the first row runs."""
        cdef const int32_t[:, ::1] p
        try:
            p = picks
        except (TypeError, ValueError, BufferError):
            raise TypeError(
                f"Clock.replay: picks must be a 2-D C-contiguous int32 array, got "
                f"{_describe(picks)}; convert it with np.ascontiguousarray(picks, dtype=np.int32)") from None
        cdef int32_t limit = _limit("replay", admit_limit)
        cdef Py_ssize_t n_rows = p.shape[0], width = p.shape[1], r
        if width > NO_LIMIT:
            raise ValueError(f"Clock.replay: rows of {width} picks; at most 2**31 - 1")
        arr = np.asarray(picks)
        if arr.size:
            bad = np.flatnonzero((arr < 0) | (arr >= self.n_keys))
            if bad.size:
                row, col = divmod(int(bad[0]), width)
                raise IndexError(f"Clock.replay: picks[{row}, {col}] = {arr[row, col]} is "
                                 f"outside [0, {self.n_keys}); a key is layer * "
                                 f"experts_per_layer + expert")
        counts_arr = np.zeros((n_rows, 3), np.int32)
        scratch = np.empty((3, max(width, 1)), np.int32)
        cdef int32_t[:, ::1] counts = counts_arr
        cdef int32_t[:, ::1] out = scratch
        cdef g53_clock_batch_result res
        cdef int rc = 0
        with nogil:
            for r in range(n_rows):
                rc = g53_clock_batch(self._c, &p[r, 0], <int32_t>width, limit, &out[0, 0],
                                     &out[1, 0], &out[2, 0], <int32_t>out.shape[1], &res)
                if rc:
                    break
                counts[r, 0] = res.n_unique
                counts[r, 1] = res.n_hits
                counts[r, 2] = res.n_admitted
        if rc:
            raise self._fail(rc, f"replay (row {r})", -1, -1)
        return counts_arr

    # --- elastic capacity, warm start -----------------------------------------------------

    def shrink(self, k):
        """Disable the last k enabled slots; returns the keys they held (int32, slot order)."""
        cdef int32_t n_active = self.n_active, n = 0, pins = 0
        cdef long long n_k = _as_int("shrink", "k", k)
        if not 0 <= n_k <= n_active:
            raise ValueError(f"Clock.shrink: k must be in [0, {n_active}] (enabled slots), "
                             f"got {k}")
        out = np.empty(n_k, np.int32)
        cdef int32_t[::1] o = out
        rc = g53_clock_shrink(self._c, <int32_t>n_k, &o[0] if n_k else NULL, <int32_t>n_k, &n)
        if rc == G53_CLOCK_E_PINNED:
            for s in range(n_active - n_k, n_active):
                g53_clock_pin_count(self._c, <int32_t>s, &pins)
                if pins:
                    raise RuntimeError(
                        f"Clock.shrink: slot {s} of [{n_active - n_k}, {n_active}) is pinned "
                        f"({pins} pins); unpin it before shrinking")
        if rc:
            raise self._fail(rc, "shrink", -1, -1)
        return out[:n]

    def grow(self, k):
        """Re-enable k slots past the enabled ones, empty."""
        cdef long long n_k = _as_int("grow", "k", k)
        room = self.n_slots - self.n_active
        if not 0 <= n_k <= room:
            raise ValueError(f"Clock.grow: k must be in [0, {room}] (disabled slots), got {k}")
        rc = g53_clock_grow(self._c, <int32_t>n_k)
        if rc:
            raise self._fail(rc, "grow", -1, -1)

    def seed(self, keys):
        """Warm start an empty table from a heat list (hottest first, no repeats); fills
        min(len(keys), n_active) slots, leaves counters alone. Returns how many were placed."""
        a = self._keys_array("seed", "keys", keys)
        cdef const int32_t[::1] k = a
        cdef int32_t n = <int32_t>k.shape[0], placed = 0
        rc = g53_clock_seed(self._c, &k[0] if n else NULL, n, &placed)
        if rc == G53_CLOCK_E_DUPLICATE:
            first = {}
            for i, key in enumerate(a.tolist()):
                if key in first:
                    raise ValueError(f"Clock.seed: key {key} is listed at {first[key]} and "
                                     f"{i}; a heat list names each key once")
                first[key] = i
        if rc:
            raise self._fail(rc, "seed", -1, -1)
        return placed

    def clear(self):
        """Empty every slot (no pinned slot allowed); hand to 0; counters kept."""
        rc = g53_clock_clear(self._c)
        if rc == G53_CLOCK_E_PINNED:
            raise RuntimeError(f"Clock.clear: {self.n_pinned} slots are pinned; unpin them "
                               f"first")
        if rc:
            raise self._fail(rc, "clear", -1, -1)

    def _keys_array(self, str call, str name, keys):
        a = np.asarray(keys)
        if a.ndim != 1:
            raise ValueError(f"Clock.{call}: {name} must be 1-D, got shape {a.shape}")
        if a.size == 0:
            return np.empty(0, np.int32)
        if a.dtype.kind not in "iu":
            raise TypeError(f"Clock.{call}: {name} must hold integers, got dtype {a.dtype}")
        bad = np.flatnonzero((a < 0) | (a >= self.n_keys))
        if bad.size:
            i = int(bad[0])
            raise IndexError(f"Clock.{call}: {name}[{i}] = {a[i]} is outside "
                             f"[0, {self.n_keys}); a key is layer * experts_per_layer + expert")
        return np.ascontiguousarray(a, dtype=np.int32)

    # --- state and counters ---------------------------------------------------------------

    cdef g53_clock_info _info(self):
        cdef g53_clock_info i
        g53_clock_info_get(self._c, &i)
        return i

    @property
    def n_active(self):
        """Enabled slots: [0, n_active)."""
        return self._info().n_active

    @property
    def n_used(self):
        return self._info().n_used

    @property
    def n_pinned(self):
        return self._info().n_pinned

    @property
    def hand(self):
        return self._info().hand

    @property
    def handle(self):
        """Address of the C table (g53_clock *) for nogil calls through pyx/clock.pxd."""
        return <uintptr_t>self._c

    def __len__(self):
        return self._info().n_used

    def counters(self):
        """{hits, misses, admits, evictions, pinned_skips, no_victim}, and with policy="freq"
        also {rejected, probation_hits, agings}; see pyx/clock.h."""
        cdef g53_clock_counters c
        cdef g53_clock_freq_info f
        g53_clock_counters_get(self._c, &c)
        out = {"hits": c.hits, "misses": c.misses, "admits": c.admits,
               "evictions": c.evictions, "pinned_skips": c.pinned_skips,
               "no_victim": c.no_victim}
        if self.policy == "freq":
            g53_clock_freq_info_get(self._c, &f)
            out.update(rejected=f.counters.rejected, probation_hits=f.counters.probation_hits,
                       agings=f.counters.agings)
        return out

    def reset_counters(self):
        g53_clock_counters_reset(self._c)

    def __repr__(self):
        cdef g53_clock_info i = self._info()
        policy = "" if self.policy == "clock" else f", policy={self.policy!r}"
        return (f"Clock(n_slots={i.n_slots}, n_keys={i.n_keys}, n_active={i.n_active}, "
                f"n_used={i.n_used}, n_pinned={i.n_pinned}, hand={i.hand}{policy})")
