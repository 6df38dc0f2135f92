"""Pure-Python twin of glm53._clock.Clock: the same CLOCK policy, victims, hand and counters.

It exists to be read and to be compared against (tests, bench/micro_clock.py); it is slow.
The policy is written out in pyx/clock.h. Errors are the same exception types as Clock's.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

COUNTER_NAMES = ("hits", "misses", "admits", "evictions", "pinned_skips", "no_victim")
INT32_MAX = 2**31 - 1


class RefBatch(NamedTuple):
    keys: list[int]  # distinct picks: hits, then admitted misses, then misses not admitted
    slots: list[int]  # slot per entry, -1 for a miss not admitted
    evicted: list[int]  # key displaced by an admission, else -1
    n_hits: int
    n_admitted: int


class ClockRef:
    def __init__(self, n_slots: int, n_keys: int):
        if not (1 <= n_slots <= 1 << 28 and 1 <= n_keys <= 1 << 28):
            raise ValueError(f"n_slots {n_slots} and n_keys {n_keys} must be in [1, 2**28]")
        self.n_slots, self.n_keys, self.n_active = n_slots, n_keys, n_slots
        self.pins = [0] * n_slots
        self.n_pinned = 0  # slots with pin count > 0
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._reset_slots()

    def _reset_slots(self) -> None:
        self.slot_of_key = [-1] * self.n_keys
        self.key_of_slot = [-1] * self.n_slots
        self.ref = [0] * self.n_slots
        self.free = list(range(self.n_active))  # a heap: the lowest free slot is taken first
        self.hand = 0
        self.n_used = 0

    def _check_key(self, key: int) -> None:
        if not 0 <= key < self.n_keys:
            raise IndexError(f"key {key} is outside [0, {self.n_keys})")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} is outside [0, {self.n_slots})")

    # --- the hand -------------------------------------------------------------------------

    def _victim(self, protected: set[int]) -> int:
        while True:
            s = self.hand
            self.hand = (self.hand + 1) % self.n_active
            if self.pins[s] > 0:
                self.counters["pinned_skips"] += 1
            elif s in protected:
                pass
            elif self.ref[s]:
                self.ref[s] = 0
            else:
                return s

    def _place(self, key: int, s: int) -> int:
        old = self.key_of_slot[s]
        if old >= 0:
            self.slot_of_key[old] = -1
            self.counters["evictions"] += 1
        else:
            self.n_used += 1
        self.key_of_slot[s], self.slot_of_key[key], self.ref[s] = key, s, 0
        self.counters["admits"] += 1
        return old

    # --- single-key calls -----------------------------------------------------------------

    def lookup(self, key: int) -> int:
        self._check_key(key)
        s = self.slot_of_key[key]
        if s >= 0:
            self.ref[s] = 1
            self.counters["hits"] += 1
        else:
            self.counters["misses"] += 1
        return s

    def admit(self, key: int) -> tuple[int, int]:
        self._check_key(key)
        if self.slot_of_key[key] >= 0:
            raise RuntimeError(f"key {key} already holds slot {self.slot_of_key[key]}")
        if self.free:
            s = heapq.heappop(self.free)
        elif self.n_active == 0:
            raise RuntimeError("no enabled slot")
        elif self.n_pinned == self.n_active:
            raise RuntimeError("every enabled slot is pinned")
        else:
            s = self._victim(set())
        return s, self._place(key, s)

    def remove(self, key: int) -> int:
        self._check_key(key)
        s = self.slot_of_key[key]
        if s >= 0:
            if self.pins[s] > 0:
                raise RuntimeError(f"slot {s} of key {key} is pinned")
            self.slot_of_key[key], self.key_of_slot[s], self.ref[s] = -1, -1, 0
            self.n_used -= 1
            heapq.heappush(self.free, s)
        return s

    def pin(self, slot: int) -> None:
        self._check_slot(slot)
        if slot >= self.n_active:
            raise RuntimeError(f"slot {slot} is disabled")
        if self.key_of_slot[slot] < 0:
            raise RuntimeError(f"slot {slot} holds no key")
        if self.pins[slot] == INT32_MAX:
            raise RuntimeError(f"slot {slot} pin count overflow")
        self.n_pinned += self.pins[slot] == 0
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._check_slot(slot)
        if self.pins[slot] == 0:
            raise RuntimeError(f"slot {slot} is not pinned")
        self.pins[slot] -= 1
        self.n_pinned -= self.pins[slot] == 0

    def pin_count(self, slot: int) -> int:
        self._check_slot(slot)
        return self.pins[slot]

    def contains(self, key: int) -> bool:
        self._check_key(key)
        return self.slot_of_key[key] >= 0

    def slot_of(self, key: int) -> int:
        self._check_key(key)
        return self.slot_of_key[key]

    def key_of(self, slot: int) -> int:
        self._check_slot(slot)
        return self.key_of_slot[slot]

    def ref_bit(self, slot: int) -> int:
        self._check_slot(slot)
        return self.ref[slot]

    # --- batch ----------------------------------------------------------------------------

    # the batch's hooks, which the frequency policy's twin (freq_clock_ref.FreqClockRef)
    # overrides: plain CLOCK counts nothing, marks a hit's slot referenced, and fills the slot
    # the free list or the hand gave
    def _batch_start(self, distinct: list[int]) -> None:
        """Before a batch's hits and misses (its distinct keys, hits first)."""

    def _hit(self, s: int) -> None:
        self.ref[s] = 1

    def _admit_one(self, key: int, s: int, contest: bool) -> tuple[int, int]:
        """(the slot `key` takes, the key it evicted or -1) for slot `s` (`contest`: the hand
        chose it, rather than the free list)."""
        return s, self._place(key, s)

    def batch(self, picks, admit_limit: int | None = None) -> RefBatch:
        limit = INT32_MAX if admit_limit is None else admit_limit
        if limit < 0:
            raise ValueError(f"admit_limit {limit} must be >= 0 or None")
        for key in picks:
            self._check_key(key)
        hits, misses = [], []
        for key in dict.fromkeys(picks):  # first-seen order
            (hits if self.slot_of_key[key] >= 0 else misses).append(key)
        self._batch_start(hits + misses)
        keys, slots, evicted = list(hits), [self.slot_of_key[k] for k in hits], [-1] * len(hits)
        protected = set(slots)  # hit or filled by this batch: the hand skips them
        n_protected = 0  # of those, the unpinned ones
        for s in slots:
            self._hit(s)
            n_protected += self.pins[s] == 0
        n_admitted = 0
        for key in misses[:limit]:
            if self.free:
                s, contest = heapq.heappop(self.free), False
            elif self.n_active - self.n_pinned - n_protected > 0:
                s, contest = self._victim(protected), True
            else:
                self.counters["no_victim"] += 1
                break
            s, old = self._admit_one(key, s, contest)
            evicted.append(old)
            keys.append(key)
            slots.append(s)
            protected.add(s)
            n_protected += 1
            n_admitted += 1
        rest = misses[n_admitted:]
        keys += rest
        slots += [-1] * len(rest)
        evicted += [-1] * len(rest)
        self.counters["hits"] += len(hits)
        self.counters["misses"] += len(misses)
        return RefBatch(keys, slots, evicted, len(hits), n_admitted)

    # --- elastic capacity, warm start -----------------------------------------------------

    def shrink(self, k: int) -> list[int]:
        if not 0 <= k <= self.n_active:
            raise ValueError(f"shrink({k}): k must be in [0, {self.n_active}]")
        lo = self.n_active - k
        if any(self.pins[s] > 0 for s in range(lo, self.n_active)):
            raise RuntimeError(f"shrink({k}) would disable a pinned slot")
        evicted = []
        for s in range(lo, self.n_active):
            key = self.key_of_slot[s]
            if key >= 0:
                evicted.append(key)
                self.slot_of_key[key], self.key_of_slot[s] = -1, -1
                self.n_used -= 1
            self.ref[s] = 0
        self.free = [s for s in self.free if s < lo]
        heapq.heapify(self.free)
        self.n_active = lo
        if self.hand >= lo:
            self.hand = 0
        return evicted

    def grow(self, k: int) -> None:
        if not 0 <= k <= self.n_slots - self.n_active:
            raise ValueError(f"grow({k}): k must be in [0, {self.n_slots - self.n_active}]")
        for s in range(self.n_active, self.n_active + k):
            heapq.heappush(self.free, s)
        self.n_active += k

    def seed(self, keys) -> int:
        keys = list(keys)
        for key in keys:
            self._check_key(key)
        if self.n_used > 0:
            raise RuntimeError("seed needs an empty table")
        seen = set()
        for key in keys:
            if key in seen:
                raise ValueError(f"seed list names key {key} twice")
            seen.add(key)
        m = min(len(keys), self.n_active)
        for i, key in enumerate(keys[:m]):
            s = m - 1 - i
            self.key_of_slot[s], self.slot_of_key[key], self.ref[s] = key, s, 0
        self.free = list(range(m, self.n_active))
        self.hand = 0
        self.n_used = m
        return m

    def clear(self) -> None:
        if self.n_pinned > 0:
            raise RuntimeError("clear would drop pinned slots")
        self._reset_slots()

    def reset_counters(self) -> None:
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
