"""Offline replay of the RAM tier's accesses: its own policy against plain CLOCK and Belady.

A trace is what the RAM tier sees: per MoE layer and forward, the distinct experts that the
VRAM cache did not hold (glm53.tiers.gpu_home.RamHome.resolve's `need`), as one wave of keys
(`moe_index * num_experts + expert`, the tier's keys). Four policies replay it at the same
number of slots and count hits (a key of a wave already resident):

- `replay_ram_tier`: the tier's policy itself, the compiled table RamTier holds
  (glm53.tiers.ram_tier.tier_table: CLOCK with admission by frequency, pyx/clock.h) driven as
  RamTier.make_resident drives it: one `batch_into` per wave (hits first, misses admitted,
  never into a slot of the same wave); keys a full wave could not place go in further waves,
  as the CPU engine's caller does.
- `replay_wave_clock`: the same waves through a plain CLOCK table (the tier's policy before
  frequency admission).
- `replay_clock`: plain CLOCK, one key at a time (`lookup`, then `admit` on a miss), with no
  protection of the wave's other keys.
- `replay_belady`: Belady's MIN over the waves laid end to end: a miss is admitted, evicting
  the resident key whose next use is farthest (never used again counts as farthest). No
  demand-paging policy has more hits on the same sequence, so it bounds the others. Given the
  keys a warm start placed (`initial`), it starts from them, as the others do after `seed`.

Trace files (`write_trace`/`read_trace`) are .npz: `keys` (int32, the waves end to end),
`wave_ends` (int64, the end of each wave in `keys`) and `num_keys`, `num_experts` (scalars).
"""

from __future__ import annotations

import heapq
from pathlib import Path

import msgspec
import numpy as np

from glm53 import _clock
from glm53.tiers.ram_tier import tier_table


class PolicyResult(msgspec.Struct, frozen=True):
    """Hits among the accesses (distinct keys per wave) of one replay."""

    hits: int
    accesses: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class Trace(msgspec.Struct, frozen=True):
    """Waves of distinct keys in [0, num_keys), in the order the tier saw them."""

    waves: list[np.ndarray]
    num_keys: int
    num_experts: int

    @property
    def num_accesses(self) -> int:
        return sum(len(w) for w in self.waves)


def _checked(waves, num_keys: int) -> list[np.ndarray]:
    out = []
    for i, wave in enumerate(waves):
        w = np.asarray(wave, dtype=np.int32).reshape(-1)
        if len(np.unique(w)) != len(w):
            raise ValueError(f"wave {i} names a key twice: {w.tolist()}")
        if len(w) and (w.min() < 0 or w.max() >= num_keys):
            raise ValueError(f"wave {i} has a key outside [0, {num_keys}): {w.tolist()}")
        out.append(w)
    return out


def replay_ram_tier(waves, num_slots: int, num_keys: int) -> PolicyResult:
    return replay_waves(waves, tier_table(num_slots, num_keys))


def replay_wave_clock(waves, num_slots: int, num_keys: int) -> PolicyResult:
    return replay_waves(waves, _clock.Clock(num_slots, num_keys))


def replay_waves(waves, clock: _clock.Clock) -> PolicyResult:
    """Replay the waves through a table as RamTier.make_resident drives it (from whatever it
    holds: a fresh table, or one seeded by a warm start)."""
    hits = hits_per_wave(waves, clock)
    return PolicyResult(int(hits.sum()), sum(len(w) for w in waves))


def replay_clock(waves, num_slots: int, num_keys: int) -> PolicyResult:
    waves = _checked(waves, num_keys)
    clock = _clock.Clock(num_slots, num_keys)
    hits = accesses = 0
    for wave in waves:
        for key in wave.tolist():
            accesses += 1
            if clock.lookup(key) >= 0:
                hits += 1
            else:
                clock.admit(key)
    return PolicyResult(hits, accesses)


def replay_belady(waves, num_slots: int, num_keys: int, initial=()) -> PolicyResult:
    waves = _checked(waves, num_keys)
    if num_slots < 1:
        raise ValueError(f"num_slots {num_slots} must be at least 1")
    initial = np.asarray(initial, dtype=np.int64).reshape(-1)
    if len(np.unique(initial)) != len(initial) or (
        len(initial) and (initial.min() < 0 or initial.max() >= num_keys)
    ):
        raise ValueError(f"initial keys must be distinct keys in [0, {num_keys})")
    if len(initial) > num_slots:
        raise ValueError(f"{len(initial)} initial keys do not fit in {num_slots} slots")
    seq = np.concatenate(waves).tolist() if waves else []
    never = len(seq)  # farther than any real next use
    next_use = [never] * len(seq)
    seen: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = seen.get(seq[i], never)
        seen[seq[i]] = i
    # key -> its next use; the warm start's keys are next used at their first use
    resident: dict[int, int] = {k: seen.get(k, never) for k in initial.tolist()}
    farthest = [(-use, k) for k, use in resident.items()]  # (-next use, key), stale skipped
    heapq.heapify(farthest)
    hits = 0
    for i, key in enumerate(seq):
        if key in resident:
            hits += 1
        elif len(resident) == num_slots:
            while True:
                neg, victim = heapq.heappop(farthest)
                if resident.get(victim) == -neg:
                    break
            del resident[victim]
        resident[key] = next_use[i]
        heapq.heappush(farthest, (-next_use[i], key))
    return PolicyResult(hits, len(seq))


def with_burst(waves, at: int, burst: list[np.ndarray]) -> list[np.ndarray]:
    """The waves with a burst (a long prompt's prefill: waves of keys seen once) put in
    before wave `at`."""
    return list(waves[:at]) + [np.asarray(w, dtype=np.int32) for w in burst] + list(waves[at:])


def prefill_burst(num_keys: int, num_experts: int, share: float, seed: int) -> list[np.ndarray]:
    """One prefill chunk's waves as the tier sees them: per MoE layer, in layer order, one wave
    of `share` of the layer's experts, drawn at random and in random order."""
    rng = np.random.default_rng(seed)
    count = max(1, round(share * num_experts))
    return [
        (layer * num_experts + rng.permutation(num_experts)[:count]).astype(np.int32)
        for layer in range(num_keys // num_experts)
    ]


def hits_per_wave(waves, clock: _clock.Clock) -> np.ndarray:
    """replay_waves, with the hits of each wave (int64 [len(waves)])."""
    waves = _checked(waves, clock.n_keys)
    keys = np.empty(clock.n_keys, dtype=np.int32)
    slots = np.empty(clock.n_keys, dtype=np.int32)
    evicted = np.empty(clock.n_keys, dtype=np.int32)
    out = np.zeros(len(waves), dtype=np.int64)
    for i, wave in enumerate(waves):
        rest = wave
        while len(rest):
            _, n_hits, n_admitted = clock.batch_into(rest, keys, slots, evicted)
            out[i] += n_hits
            rest = keys[n_hits + n_admitted : len(rest)].copy()
    return out


def misses_after_vram(
    picks: list[np.ndarray], num_experts: int, vram_slots: int
) -> list[np.ndarray]:
    """The RAM tier's trace from per-forward picks: `picks[i]` is one MoE layer's forward as
    (moe_index, expert) rows; a VRAM cache of `vram_slots` (CLOCK, one batch per wave, as the
    device cache admits decode picks, without its frequency gate) takes the hits, and the
    distinct misses of each forward, in first-seen order, are one wave."""
    num_keys = max(int(p[:, 0].max()) for p in picks if len(p)) + 1
    num_keys *= num_experts
    vram = _clock.Clock(vram_slots, num_keys)
    keys = np.empty(num_keys, dtype=np.int32)
    slots = np.empty(num_keys, dtype=np.int32)
    evicted = np.empty(num_keys, dtype=np.int32)
    waves = []
    for p in picks:
        flat = (p[:, 0] * num_experts + p[:, 1]).astype(np.int32)
        _, first = np.unique(flat, return_index=True)
        distinct = flat[np.sort(first)]
        _, n_hits, _ = vram.batch_into(distinct, keys, slots, evicted)
        hit = set(keys[:n_hits].tolist())
        waves.append(np.array([k for k in distinct.tolist() if k not in hit], dtype=np.int32))
    return waves


def write_trace(path: str | Path, trace: Trace) -> None:
    waves = _checked(trace.waves, trace.num_keys)
    keys = np.concatenate(waves) if waves else np.empty(0, np.int32)
    ends = np.cumsum([len(w) for w in waves], dtype=np.int64)
    np.savez(
        path, keys=keys, wave_ends=ends, num_keys=trace.num_keys, num_experts=trace.num_experts
    )


def read_trace(path: str | Path) -> Trace:
    with np.load(path) as f:
        keys, ends = f["keys"].astype(np.int32), f["wave_ends"]
        num_keys, num_experts = int(f["num_keys"]), int(f["num_experts"])
    waves = np.split(keys, ends[:-1]) if len(ends) else []
    return Trace(_checked(waves, num_keys), num_keys, num_experts)
