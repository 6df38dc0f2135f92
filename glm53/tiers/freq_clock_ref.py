"""Pure-Python twin of glm53._clock.Clock(policy="freq"), the RAM tier's policy: CLOCK with a
reference count per slot, an access count per key, and admission by frequency with probation.

It exists to be read and to be compared against (tests/test_freq_clock.py); it is slow. The
policy is written out in pyx/clock.h. It builds on ClockRef (plain CLOCK, whose semantics it
leaves alone) and overrides what the frequency mode changes.
"""

from __future__ import annotations

from glm53.tiers.clock_ref import ClockRef

FREQ_COUNTER_NAMES = ("rejected", "probation_hits", "agings")
UINT32_MAX = 2**32 - 1


class FreqClockRef(ClockRef):
    def __init__(self, n_slots: int, n_keys: int, max_count: int = 3, freq_window: int = 0):
        if not 1 <= max_count <= 15 or freq_window < 0:
            raise ValueError(f"max_count {max_count} must be in [1, 15], freq_window >= 0")
        self.max_count, self.freq_window, self.freq_events = max_count, freq_window, 0
        self.freq = [0] * n_keys
        super().__init__(n_slots, n_keys)
        self.counters.update(dict.fromkeys(FREQ_COUNTER_NAMES, 0))

    def _reset_slots(self) -> None:
        super()._reset_slots()
        self.probation: dict[int, None] = {}  # slots, oldest first
        self._batch_pushed: set[int] = set()  # probation members placed by the current call

    def _count(self, key: int) -> None:
        self.freq[key] = min(self.freq[key] + 1, UINT32_MAX)
        self.freq_events += 1
        if self.freq_window and self.freq_events >= self.freq_window:
            self.freq = [f >> 1 for f in self.freq]
            self.freq_events >>= 1
            self.counters["agings"] += 1

    def _hit(self, s: int) -> None:
        self.ref[s] = min(self.ref[s] + 1, self.max_count)
        if s in self.probation:
            del self.probation[s]
            self.counters["probation_hits"] += 1

    def _victim(self, protected: set[int]) -> int:
        while True:
            s = self.hand
            self.hand = (self.hand + 1) % self.n_active
            if self.pins[s] > 0:
                self.counters["pinned_skips"] += 1
            elif s in protected:
                pass
            elif self.ref[s]:
                self.ref[s] -= 1
            else:
                return s

    def _place(self, key: int, s: int) -> int:
        self.probation.pop(s, None)
        return super()._place(key, s)

    def _contest(self, key: int, v: int) -> tuple[int, bool]:
        """The slot a missed key takes when the hand chose v, and whether it is on probation."""
        if self.freq[key] > self.freq[self.key_of_slot[v]]:
            return v, False
        self.counters["rejected"] += 1
        self.hand = v  # the hand rests on v: the next miss is weighed against it first
        for p in reversed(self.probation):  # newest first, placed before this call
            if p not in self._batch_pushed and self.pins[p] == 0:
                return p, True
        return v, True

    def _admit_one(self, key: int, s: int, contest: bool) -> tuple[int, int]:
        on_probation = False
        if contest:
            s, on_probation = self._contest(key, s)
        old = self._place(key, s)
        if on_probation:
            self.probation[s] = None
            self._batch_pushed.add(s)
        return s, old

    # --- single-key calls -----------------------------------------------------------------

    def lookup(self, key: int) -> int:
        self._check_key(key)
        self._count(key)
        s = self.slot_of_key[key]
        if s >= 0:
            self._hit(s)
            self.counters["hits"] += 1
        else:
            self.counters["misses"] += 1
        return s

    def admit(self, key: int) -> tuple[int, int]:
        self._check_key(key)
        if self.slot_of_key[key] >= 0:
            raise RuntimeError(f"key {key} already holds slot {self.slot_of_key[key]}")
        self._batch_pushed = set()
        if self.free:
            import heapq

            return self._admit_one(key, heapq.heappop(self.free), False)
        if self.n_active == 0:
            raise RuntimeError("no enabled slot")
        if self.n_pinned == self.n_active:
            raise RuntimeError("every enabled slot is pinned")
        return self._admit_one(key, self._victim(set()), True)

    def remove(self, key: int) -> int:
        s = super().remove(key)
        if s >= 0:
            self.probation.pop(s, None)
        return s

    # --- batch ----------------------------------------------------------------------------

    def _batch_start(self, distinct: list[int]) -> None:
        for key in distinct:
            self._count(key)
        self._batch_pushed = set()

    # --- elastic capacity, warm start -----------------------------------------------------

    def shrink(self, k: int) -> list[int]:
        lo = self.n_active - k
        evicted = super().shrink(k)
        for s in [s for s in self.probation if s >= lo]:
            del self.probation[s]
        return evicted

    def seed(self, keys) -> int:
        keys = list(keys)
        m = super().seed(keys)
        for key in keys[:m]:
            self.freq[key] = max(self.freq[key], 1)
        return m

    def reset_counters(self) -> None:
        super().reset_counters()
        self.counters.update(dict.fromkeys(FREQ_COUNTER_NAMES, 0))
