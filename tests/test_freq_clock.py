"""The RAM tier's policy, glm53._clock.Clock(policy="freq"): step by step on hand-worked cases,
a one-shot burst that must not evict the frequent keys, and random call sequences against the
pure-Python twin (glm53.tiers.freq_clock_ref.FreqClockRef). Plain CLOCK is tests/test_clock.py."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from test_clock import ClockVsModel, raises, snapshot

from glm53._clock import Clock
from glm53.tiers.freq_clock_ref import FreqClockRef


def freq_table(n_slots, n_keys, **kw):
    kw.setdefault("freq_window", 0)
    return Clock(n_slots, n_keys, policy="freq", **kw)


def test_a_miss_no_more_frequent_than_the_victim_goes_on_probation():
    c = freq_table(2, 10)
    c.batch([0, 1])  # free slots: 0 -> slot 0, 1 -> slot 1, no contest
    c.batch([0])  # key 0: count 2, its slot's reference count 1
    b = c.batch([5])  # the hand passes slot 0 (count 1 -> 0), victim slot 1 (key 1, count 1)
    # key 5's count 1 is not above key 1's 1: probation, and with no member yet, slot 1
    assert (b.keys.tolist(), b.slots.tolist(), b.evicted.tolist()) == ([5], [1], [1])
    assert c.on_probation(1) and not c.on_probation(0)
    # the hand rests on slot 1: key 6 (count 1) loses to key 5 there (count 1) and takes the
    # newest probation member's slot, the same one, evicting key 5; key 0 stays
    b = c.batch([6])
    assert (b.slots.tolist(), b.evicted.tolist()) == ([1], [5])
    assert c.key_of(0) == 0 and c.counters()["rejected"] == 2
    # key 6 again: a hit, which ends its probation
    c.batch([6])
    assert not c.on_probation(1) and c.counters()["probation_hits"] == 1


def test_a_more_frequent_miss_takes_the_victims_slot():
    c = freq_table(1, 4)
    c.batch([0])
    for _ in range(2):
        c.batch([1])  # key 1 loses to key 0 (1 vs 1), probation; second time it is a hit
    assert c.key_of(0) == 1 and c.freq_of(1) == 2
    c.batch([0])  # key 0: count 2, not above key 1's 2: probation, in key 1's slot (no other)
    assert c.key_of(0) == 0 and c.on_probation(0)
    assert [c.freq_of(k) for k in range(4)] == [2, 2, 0, 0]


def test_the_reference_count_saturates_and_the_hand_lowers_it():
    c = freq_table(2, 10, max_count=2)
    c.batch([0, 1])
    for _ in range(5):
        c.batch([0])
    assert c.ref_bit(0) == 2
    c.batch([9])  # the hand lowers slot 0 to 1 and takes slot 1 (count 0), key 1 as its
    # victim: key 9 (count 1) does not beat key 1 (1), so it goes on probation, in slot 1 (no
    # other member), and the hand rests there
    assert c.ref_bit(0) == 1 and c.key_of(1) == 9 and c.hand == 1


def test_counts_age_every_freq_window_accesses():
    c = freq_table(2, 4, freq_window=4)
    c.batch([0, 1])
    c.batch([0])
    assert c.freq_of(0) == 2 and c.freq_info()["freq_events"] == 3
    c.batch([0])  # the 4th access: every count halves, and so does the access count
    assert [c.freq_of(k) for k in range(4)] == [1, 0, 0, 0]
    assert c.counters()["agings"] == 1 and c.freq_info()["freq_events"] == 2
    assert c.freq_counts().tolist() == [1, 0, 0, 0]


def test_default_freq_window_and_bad_settings():
    assert Clock(4, 10, policy="freq").freq_info() == {
        "max_count": 3,
        "n_probation": 0,
        "freq_window": 128,  # 32 per slot, at least n_keys
        "freq_events": 0,
    }
    assert Clock(2, 100, policy="freq").freq_info()["freq_window"] == 100
    with raises(ValueError, "Clock: policy must be one of clock, freq, got 'lfu'"):
        Clock(2, 4, policy="lfu")
    with raises(ValueError, "Clock: max_count must be in [1, 15], got 0"):
        Clock(2, 4, policy="freq", max_count=0)
    with raises(ValueError, "Clock: freq_window must be >= 0 (0: the counts never age), got -1"):
        Clock(2, 4, policy="freq", freq_window=-1)
    plain = Clock(2, 4)
    assert plain.policy == "clock" and set(plain.counters()) == {
        "hits", "misses", "admits", "evictions", "pinned_skips", "no_victim"
    }  # fmt: skip
    message = "Clock.freq_of: this table is plain CLOCK; make it with Clock(n_slots, n_keys, policy='freq')"
    with raises(RuntimeError, message):
        plain.freq_of(0)


def test_a_batch_never_evicts_its_own_hits_or_admissions():
    c = freq_table(3, 20)
    c.batch([0, 1, 2])
    b = c.batch([0, 10, 11, 12])  # 0 hits; three misses, two victims: one left out
    assert b.n_hits == 1 and b.n_admitted == 2
    assert sorted(b.slots[:3].tolist()) == [0, 1, 2] and b.slots[3] == -1
    assert c.counters()["no_victim"] == 1


def test_probation_never_takes_back_a_slot_of_the_same_batch():
    c = freq_table(4, 40)
    c.batch([0, 1, 2, 3])
    for _ in range(3):
        c.batch([0, 1])  # keys 0 and 1 hot
    b = c.batch([20, 21])  # both lose; the first takes a victim's slot, the second another
    assert len(set(b.slots.tolist())) == 2 and -1 not in b.slots.tolist()
    assert all(c.on_probation(int(s)) for s in b.slots)


def burst_run(c, hot, burst, burst_wave, rng):
    for _ in range(20):
        for w in np.split(rng.permutation(hot), 4):
            c.batch(w)
    for w in np.split(burst, len(burst) // burst_wave):
        c.batch(w)
    return sum(c.contains(int(k)) for k in hot)


def test_a_one_shot_burst_does_not_evict_the_hot_set():
    # 64 slots, a hot set of 40 keys decoded for a while (waves of 10), then a prefill-like
    # burst of 640 distinct keys seen once, in waves of 16: the burst's keys lose every contest
    # and evict one another on probation; plain CLOCK is flushed
    hot = np.arange(40, dtype=np.int32)
    burst = np.random.default_rng(1).permutation(np.arange(100, 1000, dtype=np.int32))[:640]
    rng = np.random.default_rng(0)
    assert burst_run(freq_table(64, 1000), hot, burst, 16, rng) == 40
    assert burst_run(Clock(64, 1000), hot, burst, 16, rng) == 0


def test_a_burst_wave_wider_than_the_slack_costs_at_most_its_excess():
    # 48 slots, 40 hot keys: waves of 16 distinct burst keys need 16 slots at once, 8 more
    # than the slack. Probation grows to one wave's width (the burst keys that took the free
    # slots are ordinary slots, so the hand may come back to hot keys until it has); after
    # that the burst keys only evict one another: at most one wave's width of hot keys is lost
    hot = np.arange(40, dtype=np.int32)
    burst = np.random.default_rng(1).permutation(np.arange(100, 1000, dtype=np.int32))[:640]
    c = freq_table(48, 1000)
    assert burst_run(c, hot, burst, 16, np.random.default_rng(0)) >= 40 - 16
    assert c.freq_info()["n_probation"] == 16
    lost = 40 - sum(c.contains(int(k)) for k in hot)
    unseen = np.setdiff1d(np.arange(100, 1000, dtype=np.int32), burst)[:160]
    for w in np.split(unseen, 10):  # another burst, of keys never seen: no more hot keys lost
        c.batch(w)
    assert 40 - sum(c.contains(int(k)) for k in hot) == lost


def test_seeded_keys_are_not_displaced_by_keys_seen_once():
    c = freq_table(3, 10)
    assert c.seed([4, 5, 6]) == 3
    assert [c.freq_of(k) for k in (4, 5, 6)] == [1, 1, 1]
    c.batch([7])
    c.batch([8])
    assert sorted(c.key_of(s) for s in range(3)) in ([4, 5, 7], [4, 5, 8], [4, 6, 8], [4, 6, 7],
                                                     [5, 6, 7], [5, 6, 8])  # fmt: skip
    assert sum(c.contains(k) for k in (4, 5, 6)) == 2  # one seeded key gave way, once


# --- the C table against the pure-Python twin -------------------------------------------


class FreqClockVsModel(ClockVsModel):
    """ClockVsModel's random call sequences on the frequency table and its twin: after every
    step both agree on every slot, key, reference count, pin count, the hand, the counters,
    every key's access count and every slot's probation."""

    @initialize(
        n_slots=st.integers(1, 6),
        n_keys=st.integers(1, 14),
        max_count=st.integers(1, 3),
        freq_window=st.sampled_from([0, 3, 7, 20]),
    )
    def make(self, n_slots, n_keys, max_count, freq_window):
        self.c = Clock(n_slots, n_keys, policy="freq", max_count=max_count, freq_window=freq_window)
        self.m = FreqClockRef(n_slots, n_keys, max_count, freq_window)

    @invariant()
    def same_counts_and_probation(self):
        assert self.c.freq_counts().tolist() == self.m.freq
        assert [self.c.on_probation(s) for s in range(self.c.n_slots)] == [
            s in self.m.probation for s in range(self.m.n_slots)
        ]
        assert self.c.freq_info()["n_probation"] == len(self.m.probation)
        assert self.c.freq_info()["freq_events"] == self.m.freq_events


FreqClockVsModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_freq_clock_matches_model = FreqClockVsModel.TestCase


@pytest.mark.parametrize("call", ["freq_of", "freq_counts", "on_probation", "freq_info"])
def test_frequency_calls_refuse_a_plain_table(call):
    args = () if call in ("freq_counts", "freq_info") else (0,)
    with pytest.raises(RuntimeError, match="this table is plain CLOCK"):
        getattr(Clock(2, 4), call)(*args)


def test_snapshot_covers_the_frequency_table():
    c = freq_table(2, 4)
    c.batch([1])
    assert snapshot(c)[0] == [1, -1]
