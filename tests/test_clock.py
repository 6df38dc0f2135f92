import re

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from glm53._clock import Clock, ClockBatch
from glm53.tiers.clock_ref import ClockRef


def raises(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def snapshot(c):
    return (
        [c.key_of(s) for s in range(c.n_slots)],
        [c.ref_bit(s) for s in range(c.n_slots)],
        [c.pin_count(s) for s in range(c.n_slots)],
        [c.slot_of(k) for k in range(c.n_keys)],
        (c.n_active, c.n_used, c.n_pinned, c.hand),
        c.counters() if callable(c.counters) else dict(c.counters),
    )


def full(n_slots, n_keys, keys):
    c = Clock(n_slots, n_keys)
    for k in keys:
        c.admit(k)
    return c


# --- the policy, step by step ------------------------------------------------------------


def test_admit_fills_lowest_free_slot_first():
    c = Clock(4, 10)
    assert [c.admit(k) for k in (7, 3, 5)] == [(0, -1), (1, -1), (2, -1)]
    assert c.remove(3) == 1
    assert c.admit(9) == (1, -1)
    assert c.hand == 0


def test_evicts_first_unreferenced_slot_after_second_chance():
    c = full(3, 10, [0, 1, 2])
    assert c.lookup(0) == 0 and c.ref_bit(0) == 1
    assert c.admit(3) == (1, 1)  # slot 0 gets its second chance, slot 1 goes
    assert c.ref_bit(0) == 0 and c.hand == 2
    assert c.admit(4) == (2, 2)
    assert c.admit(5) == (0, 0)
    assert c.counters() == {
        "hits": 1,
        "misses": 0,
        "admits": 6,
        "evictions": 3,
        "pinned_skips": 0,
        "no_victim": 0,
    }


def test_admission_starts_with_reference_bit_clear():
    c = full(2, 10, [0, 1])
    assert c.ref_bit(0) == 0 and c.ref_bit(1) == 0
    assert c.admit(2) == (0, 0)


def test_all_referenced_sweeps_once_and_takes_slot_at_hand():
    c = full(3, 10, [0, 1, 2])
    for k in (0, 1, 2):
        c.lookup(k)
    assert c.admit(9) == (0, 0)
    assert [c.ref_bit(s) for s in range(3)] == [0, 0, 0]
    assert c.hand == 1


def test_pinned_slot_is_skipped_and_counted():
    c = full(3, 10, [0, 1, 2])
    c.pin(0)
    c.pin(0)
    assert c.pin_count(0) == 2 and c.n_pinned == 1
    assert c.admit(5) == (1, 1)
    assert c.counters()["pinned_skips"] == 1
    c.unpin(0)
    assert c.admit(6) == (2, 2)
    assert c.admit(7) == (1, 5)  # still pinned once: skipped again
    assert c.counters()["pinned_skips"] == 2
    c.unpin(0)
    assert c.pin_count(0) == 0 and c.n_pinned == 0


def test_lookup_miss_counts_and_peeks_do_not():
    c = full(2, 10, [4])
    assert c.lookup(5) == -1
    assert c.contains(4) and 4 in c and 5 not in c
    assert c.slot_of(4) == 0 and c.slot_of(5) == -1
    assert c.key_of(0) == 4 and c.key_of(1) == -1
    assert c.ref_bit(0) == 0
    assert c.counters()["hits"] == 0 and c.counters()["misses"] == 1
    c.reset_counters()
    assert set(c.counters().values()) == {0}
    assert len(c) == 1


def test_remove_absent_key_returns_minus_one():
    c = Clock(2, 10)
    assert c.remove(3) == -1


def test_handle_is_the_table_address():
    a, b = Clock(2, 4), Clock(2, 4)
    assert isinstance(a.handle, int) and a.handle > 0 and a.handle != b.handle


# --- bad input: clear errors, table unchanged --------------------------------------------


@pytest.mark.parametrize("call", ["lookup", "admit", "remove", "contains", "slot_of"])
@pytest.mark.parametrize("key", [-1, 10, 2**40])
def test_key_out_of_range(call, key):
    c = full(3, 10, [1, 2])
    before = snapshot(c)
    with raises(
        IndexError,
        f"Clock.{call}: key {key} is outside [0, 10); a key is layer * experts_per_layer + expert",
    ):
        getattr(c, call)(key)
    assert snapshot(c) == before


@pytest.mark.parametrize("call", ["pin", "unpin", "key_of", "pin_count", "ref_bit"])
@pytest.mark.parametrize("slot", [-1, 3])
def test_slot_out_of_range(call, slot):
    c = full(3, 10, [1])
    with raises(IndexError, f"Clock.{call}: slot {slot} is outside [0, 3)"):
        getattr(c, call)(slot)


def test_non_integer_key_and_slot():
    c = Clock(3, 10)
    with raises(TypeError, "Clock.lookup: key must be an integer, got float"):
        c.lookup(1.0)
    with raises(TypeError, "Clock.pin: slot must be an integer, got str"):
        c.pin("0")
    assert c.lookup(np.int64(1)) == -1


def test_unpin_unpinned_slot():
    c = full(3, 10, [1])
    with raises(
        RuntimeError, "Clock.unpin: slot 0 is not pinned; each unpin() must match an earlier pin()"
    ):
        c.unpin(0)


def test_admit_when_every_slot_is_pinned():
    c = full(2, 10, [1, 2])
    c.lookup(1)
    c.pin(0)
    c.pin(1)
    before = snapshot(c)
    with raises(
        RuntimeError,
        "Clock.admit: no free slot and all 2 enabled slots are pinned; unpin a slot first",
    ):
        c.admit(3)
    assert snapshot(c) == before


def test_admit_with_no_enabled_slot():
    c = Clock(2, 10)
    c.shrink(2)
    with raises(
        RuntimeError, "Clock.admit: no enabled slot (shrunk to 0 of 2); grow() the table first"
    ):
        c.admit(3)


def test_admit_resident_key():
    c = full(2, 10, [5])
    with raises(
        RuntimeError, "Clock.admit: key 5 already holds slot 0; call lookup() before admit()"
    ):
        c.admit(5)


def test_pin_empty_or_disabled_slot():
    c = full(3, 10, [5])
    with raises(
        RuntimeError,
        "Clock.pin: slot 1 holds no key; pin only a slot that lookup(), admit() or batch() returned",
    ):
        c.pin(1)
    c.shrink(1)
    with raises(
        RuntimeError,
        "Clock.pin: slot 2 is disabled (enabled slots are [0, 2)); grow() the table first",
    ):
        c.pin(2)


def test_remove_pinned_key():
    c = full(2, 10, [5])
    c.pin(0)
    with raises(
        RuntimeError, "Clock.remove: key 5 is in slot 0, which is pinned (1 pins); unpin it first"
    ):
        c.remove(5)
    assert c.slot_of(5) == 0


@pytest.mark.parametrize(
    ("n_slots", "n_keys", "message"),
    [
        (0, 5, "Clock: n_slots must be in [1, 2**28], got 0"),
        (2**28 + 1, 5, "Clock: n_slots must be in [1, 2**28], got 268435457"),
        (5, -1, "Clock: n_keys must be in [1, 2**28], got -1"),
    ],
)
def test_bad_sizes(n_slots, n_keys, message):
    with raises(ValueError, message):
        Clock(n_slots, n_keys)


# --- batch -------------------------------------------------------------------------------


def test_batch_dedups_and_orders_hits_admitted_rest():
    c = full(4, 20, [10, 11])
    c.lookup(11)
    r = c.batch([5, 10, 5, 6, 7, 10, 11, 8], admit_limit=2)
    assert isinstance(r, ClockBatch)
    assert r.keys.tolist() == [10, 11, 5, 6, 7, 8]
    assert r.slots.tolist() == [0, 1, 2, 3, -1, -1]
    assert r.evicted.tolist() == [-1, -1, -1, -1, -1, -1]
    assert (r.n_hits, r.n_admitted) == (2, 2)
    assert c.counters() == {
        "hits": 3,
        "misses": 4,
        "admits": 4,
        "evictions": 0,
        "pinned_skips": 0,
        "no_victim": 0,
    }


def test_batch_never_evicts_its_own_hits_or_admissions():
    c = full(3, 20, [0, 1, 2])
    for k in (0, 1, 2):
        c.lookup(k)
    # Every slot referenced: a plain admit would sweep once and evict slot 0, this batch's hit.
    r = c.batch([0, 5])
    assert (
        r.keys.tolist() == [0, 5] and r.slots.tolist() == [0, 1] and r.evicted.tolist() == [-1, 1]
    )
    r = c.batch([5, 6, 7, 8])
    assert r.keys.tolist() == [5, 6, 7, 8]
    assert r.slots.tolist() == [1, 2, 0, -1]
    assert r.evicted.tolist() == [-1, 2, 0, -1]
    assert (r.n_hits, r.n_admitted) == (1, 2)
    assert c.counters()["no_victim"] == 1


def test_batch_with_zero_limit_only_marks_hits():
    c = full(2, 20, [3])
    r = c.batch([3, 4], admit_limit=0)
    assert r.slots.tolist() == [0, -1] and c.ref_bit(0) == 1 and not c.contains(4)
    assert c.counters()["no_victim"] == 0


def test_batch_into_fills_caller_arrays():
    c = Clock(4, 20)
    picks = np.array([3, 3, 9], np.int32)
    out = [np.full(3, 99, np.int32) for _ in range(3)]
    assert c.batch_into(picks, *out) == (2, 0, 2)
    assert [o[:2].tolist() for o in out] == [[3, 9], [0, 1], [-1, -1]]
    assert out[0][2] == 99


def test_batch_bad_pick_changes_nothing():
    c = full(2, 20, [1, 2])
    before = snapshot(c)
    with raises(
        IndexError,
        "Clock.batch_into: picks[2] = 20 is outside [0, 20); a key is layer * experts_per_layer "
        "+ expert",
    ):
        c.batch_into(np.array([1, 3, 20], np.int32), *[np.empty(3, np.int32)] * 3)
    with raises(
        IndexError,
        "Clock.batch: picks[1] = -4 is outside [0, 20); a key is layer * experts_per_layer + expert",
    ):
        c.batch([1, -4])
    assert snapshot(c) == before


def test_batch_bad_arrays():
    c = Clock(2, 20)
    picks = np.array([1, 2, 3], np.int32)
    outs = [np.empty(3, np.int32) for _ in range(3)]
    with raises(
        TypeError,
        "Clock.batch_into: picks must be a 1-D C-contiguous int32 array, got ndarray of dtype "
        "int64 and shape (3,); convert it with np.ascontiguousarray(picks, dtype=np.int32)",
    ):
        c.batch_into(picks.astype(np.int64), *outs)
    ro = np.empty(3, np.int32)
    ro.flags.writeable = False
    with raises(
        TypeError,
        "Clock.batch_into: slots_out must be a writable 1-D C-contiguous int32 array, got "
        "ndarray of dtype int32 and shape (3,); allocate it with np.empty(n, dtype=np.int32)",
    ):
        c.batch_into(picks, outs[0], ro, outs[2])
    with raises(
        ValueError,
        "Clock.batch_into: the outputs hold 2 entries but picks has more distinct keys; size "
        "keys_out, slots_out and evicted_out to len(picks) = 3",
    ):
        c.batch_into(picks, outs[0], outs[1][:2], outs[2])
    with raises(
        ValueError, "Clock.batch_into: admit_limit must be >= 0 or None (no limit), got -1"
    ):
        c.batch_into(picks, *outs, admit_limit=-1)
    with raises(TypeError, "Clock.batch: picks must hold integers, got dtype float64"):
        c.batch([1.0])
    with raises(ValueError, "Clock.batch: picks must be 1-D, got shape (1, 2)"):
        c.batch([[1, 2]])
    assert c.n_used == 0 and c.counters()["misses"] == 0


def test_batch_of_nothing():
    c = Clock(2, 20)
    r = c.batch([])
    assert r.keys.tolist() == [] and (r.n_hits, r.n_admitted) == (0, 0)


def test_replay_matches_successive_batches():
    rng = np.random.default_rng(7)
    picks = rng.integers(0, 40, size=(50, 6)).astype(np.int32)
    a, b = Clock(8, 40), Clock(8, 40)
    counts = a.replay(picks, admit_limit=3)
    for row, (u, h, n) in zip(picks, counts.tolist(), strict=True):
        r = b.batch(row, admit_limit=3)
        assert (u, h, n) == (len(r.keys), r.n_hits, r.n_admitted)
    assert snapshot(a) == snapshot(b)


def test_replay_checks_every_pick_first():
    c = Clock(4, 10)
    picks = np.array([[1, 2], [3, 10]], np.int32)
    with raises(
        IndexError,
        "Clock.replay: picks[1, 1] = 10 is outside [0, 10); a key is layer * experts_per_layer "
        "+ expert",
    ):
        c.replay(picks)
    assert c.n_used == 0


# --- elastic capacity --------------------------------------------------------------------


def test_shrink_evicts_last_slots_and_grow_brings_them_back_empty():
    c = full(5, 20, [10, 11, 12, 13, 14])
    c.remove(13)
    assert c.shrink(3).tolist() == [12, 14]  # slots 2, 3, 4 held 12, nothing, 14
    assert c.n_active == 2 and c.n_used == 2 and not c.contains(14)
    assert c.admit(16) == (0, 10)  # no free slot among the enabled two
    c.grow(3)
    assert c.n_active == 5 and [c.key_of(s) for s in range(2, 5)] == [-1, -1, -1]
    assert c.admit(17) == (2, -1)


def test_shrink_moves_hand_back_inside():
    c = full(4, 20, [0, 1, 2, 3])
    c.admit(4)
    c.admit(5)
    c.admit(6)
    assert c.hand == 3
    c.shrink(2)
    assert c.hand == 0


def test_shrink_with_pinned_slot_changes_nothing():
    c = full(4, 20, [0, 1, 2, 3])
    c.pin(2)
    before = snapshot(c)
    with raises(
        RuntimeError,
        "Clock.shrink: slot 2 of [1, 4) is pinned (1 pins); unpin it before shrinking",
    ):
        c.shrink(3)
    assert snapshot(c) == before


def test_shrink_and_grow_ranges():
    c = Clock(4, 20)
    with raises(ValueError, "Clock.shrink: k must be in [0, 4] (enabled slots), got 5"):
        c.shrink(5)
    with raises(ValueError, "Clock.grow: k must be in [0, 0] (disabled slots), got 1"):
        c.grow(1)
    c.shrink(1)
    with raises(ValueError, "Clock.grow: k must be in [0, 1] (disabled slots), got -1"):
        c.grow(-1)
    assert c.shrink(0).tolist() == []


# --- warm start --------------------------------------------------------------------------


def test_seed_places_hottest_last_so_coldest_goes_first():
    c = Clock(3, 20)
    assert c.seed([9, 8, 7, 6]) == 3
    assert [c.key_of(s) for s in range(3)] == [7, 8, 9]
    assert c.counters()["admits"] == 0 and c.hand == 0
    c.lookup(8)
    assert c.admit(1) == (0, 7)
    assert c.admit(2) == (2, 9)  # 8 was referenced


def test_seed_partial_leaves_free_slots_first():
    c = Clock(4, 20)
    assert c.seed(np.array([5, 6], np.int64)) == 2
    assert [c.key_of(s) for s in range(4)] == [6, 5, -1, -1]
    assert c.admit(1) == (2, -1)


def test_seed_errors():
    c = Clock(3, 20)
    with raises(
        ValueError, "Clock.seed: key 4 is listed at 1 and 3; a heat list names each key once"
    ):
        c.seed([3, 4, 5, 4])
    with raises(
        IndexError,
        "Clock.seed: keys[2] = 20 is outside [0, 20); a key is layer * experts_per_layer + expert",
    ):
        c.seed([3, 4, 20])
    assert c.n_used == 0
    c.admit(1)
    with raises(
        RuntimeError,
        "Clock.seed: the table holds 1 keys; seed() fills an empty table (call clear() first)",
    ):
        c.seed([2])
    c.clear()
    assert c.seed([2]) == 1


def test_clear_refuses_pinned_and_keeps_counters():
    c = full(3, 20, [1, 2])
    c.pin(1)
    with raises(RuntimeError, "Clock.clear: 1 slots are pinned; unpin them first"):
        c.clear()
    c.unpin(1)
    c.clear()
    assert c.n_used == 0 and c.hand == 0 and c.counters()["admits"] == 2
    assert c.admit(3) == (0, -1)


# --- the C table against the pure-Python model ------------------------------------------


class ClockVsModel(RuleBasedStateMachine):
    """Random call sequences on a small table; after every step both tables must agree on
    every slot, key, reference bit, pin count, the hand and the counters. Draws lean towards
    valid, state-changing calls (full tables, pinned slots, resident keys), with about one
    bad argument in ten."""

    @initialize(n_slots=st.integers(1, 6), n_keys=st.integers(1, 14))
    def make(self, n_slots, n_keys):
        self.c, self.m = Clock(n_slots, n_keys), ClockRef(n_slots, n_keys)

    def both(self, name, *args):
        out = []
        for t in (self.c, self.m):
            try:
                out.append(("ok", getattr(t, name)(*args)))
            except (IndexError, ValueError, RuntimeError) as e:
                out.append(("error", type(e)))
        assert out[0][0] == out[1][0], (name, args, out)
        if out[0][0] == "error":
            assert out[0][1] is out[1][1], (name, args, out)
        return out[0][1], out[1][1]

    def mostly(self, data, good, bad):
        return data.draw(bad if data.draw(st.integers(0, 9)) == 0 else good)

    def key(self, data, resident=None):
        m = self.m
        keys = [
            k for k in range(m.n_keys) if resident is None or (m.slot_of_key[k] >= 0) == resident
        ]
        good = st.sampled_from(keys) if keys else st.integers(0, m.n_keys - 1)
        return self.mostly(data, good, st.sampled_from([-1, m.n_keys, 2**40]))

    def slot(self, data, pinned):
        m = self.m
        slots = [
            s for s in range(m.n_active) if (m.pins[s] > 0 if pinned else m.key_of_slot[s] >= 0)
        ]
        good = st.sampled_from(slots) if slots else st.integers(0, m.n_slots - 1)
        return self.mostly(data, good, st.integers(-1, m.n_slots))

    def picks(self, data):
        m = self.m
        resident = [k for k in range(m.n_keys) if m.slot_of_key[k] >= 0]
        key = st.integers(0, m.n_keys - 1)
        picks = data.draw(
            st.lists(st.sampled_from(resident) | key if resident else key, max_size=9)
        )
        if picks and data.draw(st.integers(0, 9)) == 0:
            picks[-1] = data.draw(st.sampled_from([-1, m.n_keys]))
        return picks

    @rule(data=st.data())
    def lookup(self, data):
        for _ in range(data.draw(st.integers(1, 4))):
            a, b = self.both("lookup", self.key(data, resident=data.draw(st.booleans())))
            assert a == b

    @rule(data=st.data())
    def admit(self, data):
        a, b = self.both("admit", self.key(data, resident=False))
        assert a == b

    @rule(data=st.data())
    def remove(self, data):
        a, b = self.both("remove", self.key(data))
        assert a == b

    @rule(data=st.data())
    def pin(self, data):
        self.both("pin", self.slot(data, pinned=False))

    @rule(data=st.data())
    def unpin(self, data):
        self.both("unpin", self.slot(data, pinned=True))

    @rule(data=st.data(), limit=st.none() | st.integers(0, 4))
    def batch(self, data, limit):
        a, b = self.both("batch", np.array(self.picks(data), np.int32), limit)
        if not isinstance(a, type):
            assert [x.tolist() for x in a[:3]] == [list(x) for x in b[:3]]
            assert a[3:] == tuple(b[3:])

    @rule(data=st.data())
    def shrink(self, data):
        k = self.mostly(
            data, st.integers(0, self.m.n_active), st.sampled_from([-1, self.m.n_active + 1])
        )
        a, b = self.both("shrink", k)
        if not isinstance(a, type):
            assert a.tolist() == b

    @rule(data=st.data())
    def grow(self, data):
        room = self.m.n_slots - self.m.n_active
        self.both("grow", self.mostly(data, st.integers(0, room), st.sampled_from([-1, room + 1])))

    @rule(data=st.data())
    def restart(self, data):
        # Rare on purpose: a cleared table has no victims to choose.
        if data.draw(st.integers(0, 3)) > 0:
            return
        self.both("clear")
        if data.draw(st.booleans()):
            self.both("reset_counters")
        keys = data.draw(st.lists(st.integers(0, self.m.n_keys - 1), max_size=8))
        a, b = self.both("seed", np.array(keys, np.int64))
        assert a == b

    @invariant()
    def same_table(self):
        assert snapshot(self.c) == snapshot(self.m)


ClockVsModel.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_clock_matches_model = ClockVsModel.TestCase


@pytest.mark.parametrize("seed", range(20))
def test_heat_order_is_the_eviction_order_reversed(seed):
    """The VRAM cache's heat list (glm53.tiers.vram_cache.clock_heat_order) ranks the cached
    keys as this CLOCK policy will evict them: replaying admissions of new keys evicts the
    originals in exactly the reverse of that order."""
    from glm53.tiers.vram_cache import clock_heat_order

    rng = np.random.default_rng(seed)
    n_slots, n_keys = int(rng.integers(1, 12)), 200
    c = Clock(n_slots, n_keys)
    for _ in range(int(rng.integers(0, 60))):
        k = int(rng.integers(0, 100))
        if c.slot_of(k) < 0:
            c.admit(k)
        else:
            c.lookup(k)
    keys = [c.key_of(s) for s in range(n_slots)]
    refs = [c.ref_bit(s) for s in range(n_slots)]
    heat = clock_heat_order(keys, refs, c.hand)
    assert sorted(heat) == sorted(k for k in keys if k >= 0)
    evicted = []
    for fresh in range(100, 100 + 2 * n_slots):
        _, old = c.admit(fresh)
        if old >= 0 and old < 100:
            evicted.append(old)
    assert evicted == heat[::-1]


def test_heat_order_of_a_seeded_table_is_the_seed_list():
    from glm53.tiers.vram_cache import clock_heat_order

    c = Clock(5, 50)
    c.seed([9, 3, 12])
    keys = [c.key_of(s) for s in range(5)]
    assert clock_heat_order(keys, [c.ref_bit(s) for s in range(5)], c.hand) == [9, 3, 12]


def test_heat_order_with_filter_counts_ranks_by_count_then_clock_order():
    from glm53.tiers.vram_cache import clock_heat_order

    keys, refs, hand = [7, 2, -1, 5, 9], [0, 1, 0, 0, 1], 3
    plain = clock_heat_order(keys, refs, hand)
    assert plain == [2, 9, 7, 5]
    freq = np.zeros(10, dtype=np.uint32)
    freq[[7, 2, 5, 9]] = [4, 1, 4, 6]
    # 9 (6 lookups) first; 7 and 5 tie at 4 and keep their CLOCK order; 2 (1 lookup) last
    assert clock_heat_order(keys, refs, hand, freq) == [9, 7, 5, 2]
