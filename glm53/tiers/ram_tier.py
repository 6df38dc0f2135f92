"""The RAM tier: a capped arena of expert records in host memory, managed by a CLOCK table with
admission by frequency (glm53._clock.Clock(policy="freq"), made by `tier_table`).

Keys are `moe_index * num_experts + expert` over the checkpoint's MoE layers. Every slot is one
4 KiB-aligned record buffer; an admitted expert is read into its slot from the expert source
with O_DIRECT, and the CPU lane's expert table entry for that slot is pointed at the record's
arrays. Owned by the engine thread (the CLOCK table has one owner, pyx/clock.h).

The tier sees the VRAM cache's misses: recency is weak there (the VRAM cache keeps the recent
picks) and frequency strong (the routers' skew is stationary), so a miss evicts the hand's
victim only if it was picked more often; else it goes on probation, where keys seen once (a
long prompt's prefill) evict one another instead of the frequent ones. Below a 24 GB card's
VRAM cache, with 40 % of the experts in RAM, plain CLOCK hits 58.8-64.6 % of the misses, this
policy 65.4-74.2 %, Belady's offline optimum 75.0-84.1 % (bench/ram_tier_policy.py;
docs/cpu-engine.md has the table, and the case where plain CLOCK does better).
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import dataclass

import numpy as np

from glm53 import _clock, _gemv, _odirect
from glm53.errors import Glm53Error
from glm53.store.direct_io import ExpertReadError, ExpertReadTimeout
from glm53.tiers.expert_source import SafetensorsSource, record_views

log = logging.getLogger("glm53.tiers")

WATCH_S = 1.0  # how often a reading tier looks whether its files went away
# The tier's policy (pyx/clock.h, frequency mode): reference counts up to 3 and counts halved
# every 32 accesses per slot (bench/ram_tier_policy.py: 3 over 1 gained 0.1 point; aging at 8
# accesses per slot lost 0.7, at 32 nothing against never, and it follows a skew that drifts).
POLICY = {"policy": "freq", "max_count": 3}


def tier_table(num_slots: int, num_keys: int) -> _clock.Clock:
    """The RAM tier's table: what RamTier holds and policy_sim.replay_ram_tier replays."""
    return _clock.Clock(num_slots, num_keys, **POLICY)


def heat_order(clock: _clock.Clock) -> list[int]:
    """A table's resident keys hottest first: by access count, highest first (policy "freq"),
    ties in the reverse of CLOCK's eviction order from its hand (vram_cache.clock_heat_order)."""
    from glm53.tiers.vram_cache import clock_heat_order

    slots = range(clock.n_slots)
    keys = [clock.key_of(s) for s in slots]
    refs = [clock.ref_bit(s) if keys[s] >= 0 else 0 for s in slots]
    counts = clock.freq_counts() if clock.policy == "freq" else None
    return clock_heat_order(keys, refs, clock.hand, counts)


class TierError(RuntimeError, Glm53Error):
    """The RAM tier cannot serve a request; the message names the setting and the fix."""


class ReadFault(TierError):
    """Reading a missed expert from the source failed (a disk error or a short read): the
    request that needed it fails; the tier stays consistent and serves the others."""

    def __init__(self, message: str, layer: int, expert: int, rows: tuple[int, ...] = ()):
        super().__init__(message)
        self.layer = layer
        self.expert = expert
        self.rows = rows  # the rows of the forward whose picks needed the expert, where known

    def picked_by(self, rows, num_rows: int) -> ReadFault:
        """This fault with the rows (token rows of a forward of `num_rows`) that picked the
        expert, named in the message."""
        rows = tuple(int(r) for r in rows)
        which = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
        what = f"row {which}" if len(rows) == 1 else f"{len(rows)} rows ({which})"
        return ReadFault(
            f"{self}; picked by {what} of this forward's {num_rows}",
            self.layer,
            self.expert,
            rows,
        )


@dataclass(slots=True)
class Resident:
    """One wave of a layer's picks: the experts made resident and the slot of each."""

    experts: np.ndarray  # int32 expert ids
    slots: np.ndarray  # int32 slot (lane table index) per expert
    num_hits: int
    num_admitted: int  # misses read from the source in this wave
    bytes_read: int


@dataclass(slots=True)
class PendingWave:
    """A wave begun with RamTier.begin_resident: its experts ([hits | misses]), their slots
    (pinned), the source's queued batch (None once collected, or when all hit) and the loads."""

    layer: int
    experts: np.ndarray
    slots: np.ndarray
    num_hits: int
    batch: object
    loads: list


class RamTier:
    def __init__(
        self,
        source: SafetensorsSource,
        ram_cap_bytes: int | None,
        read_timeout_s: float | None = None,
    ):
        self.source = source
        self.read_timeout_s = read_timeout_s or None  # 0 or None: wait as long as a read takes
        self.num_experts = source.num_experts
        self.moe_index = {layer: i for i, layer in enumerate(source.moe_layers)}
        self.num_keys = len(source.moe_layers) * self.num_experts
        self.slot_bytes = source.record_bytes
        want = self.num_keys if ram_cap_bytes is None else ram_cap_bytes // self.slot_bytes
        self.num_slots = min(self.num_keys, want)
        if self.num_slots < 1:
            raise TierError(
                f"--ram-cap {ram_cap_bytes} bytes holds no expert record of {self.slot_bytes} "
                f"bytes; raise --ram-cap to at least {self.slot_bytes}"
            )
        self.ram_cap_bytes = self.num_slots * self.slot_bytes
        self.arena = _odirect.aligned_empty(self.ram_cap_bytes)
        self.clock = tier_table(self.num_slots, self.num_keys)
        first = next(iter(source.layouts.values())).arrays
        hidden = 16 * first[0][0][1].shape[0]
        inter = 16 * first[0][0][1].shape[1]
        k2 = first[0][0][1].shape[2] // 8
        self.table = _gemv.ExpertTable(self.num_slots, hidden, inter, k2)
        self._keys = np.empty(self.num_keys, dtype=np.int32)
        self._slots = np.empty(self.num_keys, dtype=np.int32)
        self._evicted = np.empty(self.num_keys, dtype=np.int32)
        self.faults = {"read_errors": 0, "short_reads": 0, "read_timeouts": 0}
        # reads given up on at the timeout, with the keys and slots they may still write: those
        # slots stay pinned (never reused) and those keys fail their requests until they finish
        self._stuck: list[tuple[object, np.ndarray, np.ndarray]] = []
        self._stuck_keys: set[int] = set()
        self._problem, self._watched = "", -WATCH_S

    def describe(self) -> str:
        return (
            f"RAM tier: {self.num_slots} of {self.num_keys} expert records "
            f"({self.ram_cap_bytes / 2**20:.1f} MiB) from {self.source.describe()}"
        )

    def record(self, slot: int) -> np.ndarray:
        """The record buffer of a slot (a view into the arena)."""
        return self.arena[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def _refuse_stuck_hits(self, layer: int, base: int, keys: np.ndarray, n_hits: int) -> None:
        """ReadFault when a hit of the wave (`keys[:n_hits]`) is a record whose read timed out
        and has not finished; the wave's misses, admitted and not read, are taken back first."""
        if not self._stuck_keys:
            return
        stuck = [int(k) for k in keys[:n_hits] if int(k) in self._stuck_keys]
        if not stuck:
            return
        for key in keys[n_hits:]:
            self.clock.remove(int(key))
        expert = stuck[0] - base
        raise ReadFault(
            f"layer {layer} expert {expert}: its read from {self.source.describe()} has "
            f"not finished since it timed out after {self.read_timeout_s:g} s (the disk "
            "or mount under it stopped answering)",
            layer,
            expert,
        )

    def make_resident(self, layer: int, experts: np.ndarray) -> Resident:
        """Make as many of `experts` (distinct ids, in first-seen order) resident as fit at once.

        Hits come first; misses are admitted (by frequency, pyx/clock.h; never into a slot used
        by this wave) and read from the source. Experts left out (more distinct experts than slots)
        are for the caller's next wave."""
        if self._stuck:
            self._reap()
        base = self.moe_index[layer] * self.num_experts
        picks = (experts.astype(np.int32) + base).astype(np.int32)
        _, n_hits, n_admitted = self.clock.batch_into(picks, self._keys, self._slots, self._evicted)
        count = n_hits + n_admitted
        if count == 0:
            raise TierError(
                f"the RAM tier ({self.num_slots} slots) admitted none of layer {layer}'s experts; "
                "raise --ram-cap"
            )
        keys = self._keys[:count].copy()
        slots = self._slots[:count].copy()
        self._refuse_stuck_hits(layer, base, keys, n_hits)
        loads = []
        for key, slot in zip(keys[n_hits:], slots[n_hits:], strict=True):
            loads.append((layer, int(key) - base, self.record(int(slot))))
        bytes_read = self._read(loads, keys[n_hits:], slots[n_hits:]) if loads else 0
        self._point(loads, slots[n_hits:])
        return Resident(keys - base, slots, n_hits, n_admitted, bytes_read)

    # --- waves read ahead (nvme-exact's prefill staging, glm53.tiers.prefill_ahead) -------
    def begin_resident(self, layer: int, experts: np.ndarray) -> PendingWave:
        """make_resident's first half, for a source that can queue reads (ExpertStore.submit):
        admit `experts` (distinct ids) through the same table and policy (frequency admission,
        never into a slot of this wave), pin every slot of the wave (hits and misses), queue
        the misses' reads on the source's reader threads and return at once. Until
        `finish_resident` the misses' slots are being written by those threads: the pins keep
        any later wave from evicting them. Experts that did not fit are left out (`experts`
        of the result). Raises ReadFault as make_resident does for a hit whose read is stuck."""
        if self._stuck:
            self._reap()
        base = self.moe_index[layer] * self.num_experts
        picks = (np.asarray(experts).astype(np.int32) + base).astype(np.int32)
        if len(picks) == 0:
            return PendingWave(layer, np.empty(0, np.int32), np.empty(0, np.int32), 0, None, [])
        _, n_hits, n_admitted = self.clock.batch_into(picks, self._keys, self._slots, self._evicted)
        count = n_hits + n_admitted
        keys = self._keys[:count].copy()
        slots = self._slots[:count].copy()
        self._refuse_stuck_hits(layer, base, keys, n_hits)
        for slot in slots:
            self.clock.pin(int(slot))
        loads = [(layer, int(k) - base, self.record(int(s)))
                 for k, s in zip(keys[n_hits:], slots[n_hits:], strict=True)]  # fmt: skip
        batch = None
        if loads:
            self._watch_source()
            batch = self.source.submit(loads)
        return PendingWave(layer, keys - base, slots, n_hits, batch, loads)

    def finish_resident(self, wave: PendingWave) -> Resident:
        """make_resident's second half: wait for the wave's reads (the one blocking point,
        on the tier's owner thread), point the lane's table at them and return what is
        resident. The wave's slots stay pinned (release_wave unpins them, once nothing reads
        them any more). A failed or timed-out read is handled as make_resident handles it (the
        wave's misses un-admitted, or pinned until the stuck reads finish) and raises ReadFault;
        the wave's own pins are dropped first, so after a fault it holds nothing."""
        n_hits = wave.num_hits
        if wave.batch is None:
            return Resident(wave.experts, wave.slots, n_hits, 0, 0)
        keys = (
            wave.experts[n_hits:].astype(np.int32) + self.moe_index[wave.layer] * self.num_experts
        )
        batch, wave.batch = wave.batch, None
        # the owner thread waits here, so nothing admits meanwhile: unpinning before the wait
        # lets a fault's handling remove or re-pin the misses as make_resident does
        for slot in wave.slots:
            self.clock.unpin(int(slot))
        try:
            bytes_read = self._collect(lambda: self.source.collect(batch, self.read_timeout_s),
                                       keys, wave.slots[n_hits:])  # fmt: skip
        except ReadFault:
            wave.slots = np.empty(0, np.int32)
            raise
        for slot in wave.slots:
            self.clock.pin(int(slot))
        self._point(wave.loads, wave.slots[n_hits:])
        return Resident(wave.experts, wave.slots, n_hits, len(wave.loads), bytes_read)

    def release_wave(self, wave: PendingWave) -> None:
        """Unpin a finished wave's slots (the device has finished reading them)."""
        if wave.batch is not None:
            raise TierError("internal error: a wave whose reads are out cannot be released")
        for slot in wave.slots:
            self.clock.unpin(int(slot))
        wave.slots = np.empty(0, np.int32)

    def _point(self, loads: list[tuple[int, int, np.ndarray]], slots: np.ndarray) -> None:
        """Point the CPU lane's table entry of each slot at the record just read into it."""
        for (layer, expert, record), slot in zip(loads, slots, strict=True):
            self.table.set(int(slot), *record_views(record, self.source.layouts[(layer, expert)]))

    def _read(
        self, loads: list[tuple[int, int, np.ndarray]], keys: np.ndarray, slots: np.ndarray
    ) -> int:
        """Read admitted misses into their slots. A failed read un-admits all of them (their
        slots hold partial bytes), counts the fault, logs it, and raises ReadFault. A read past
        the timeout does the same, except that the misses stay admitted with their slots pinned
        until the reads given up on finish (they may still write those slots; see _reap)."""
        self._watch_source()
        return self._collect(lambda: self.source.read(loads, timeout=self.read_timeout_s),
                             keys, slots)  # fmt: skip

    def _collect(self, wait, keys: np.ndarray, slots: np.ndarray) -> int:
        """Run `wait` (a blocking read of `keys` into `slots`) and handle its faults as _read
        says."""
        try:
            return wait()
        except ExpertReadTimeout as exc:
            # the reads still out may land in their slots later: those stay admitted and pinned;
            # the rest of the wave finished, but unread bytes sit in their slots: un-admitted
            out = {self.moe_index[layer] * self.num_experts + e for layer, e in exc.experts}
            held = np.array([k in out for k in keys.tolist()], dtype=bool)
            for key in keys[~held]:
                self.clock.remove(int(key))
            for slot in slots[held]:
                self.clock.pin(int(slot))
            self._stuck.append((exc.stuck, keys[held].copy(), slots[held].copy()))
            self._stuck_keys.update(int(k) for k in keys[held])
            self.faults["read_timeouts"] += 1
            log.error("expert read timed out: %s", exc.strerror)
            raise ReadFault(exc.strerror, exc.layer, exc.expert) from None
        except ExpertReadError as exc:
            for key in keys:
                self.clock.remove(int(key))
            short = exc.errno == errno.ENODATA
            self.faults["short_reads" if short else "read_errors"] += 1
            what = "a short read (the file ends early)" if short else "a read error"
            log.error("expert read failed (%s): %s", what, exc.strerror)
            raise ReadFault(
                f"{what} for layer {exc.layer} expert {exc.expert}: {exc.strerror}",
                exc.layer,
                exc.expert,
            ) from None

    def heat_list(self) -> list[int]:
        """The resident keys hottest first (heat_order: by access count, ties in the reverse of
        CLOCK's eviction order), leaving out experts whose reads timed out."""
        return [k for k in heat_order(self.clock) if k not in self._stuck_keys]

    def seed(self, keys, batch: int = 64) -> dict:
        """Warm start an empty tier from a heat list (hottest first): as many keys as there are
        slots are placed (Clock.seed: the coldest is evicted first) and read from the source
        in batches. A read fault stops it there: the batch that failed and the keys not read
        yet are taken back out, and what was read stays. Returns what it did."""
        if self.clock.n_used:
            raise TierError("the RAM tier can be seeded only while it is empty")
        wanted = [k for k in dict.fromkeys(int(k) for k in keys) if 0 <= k < self.num_keys]
        wanted = wanted[: self.num_slots]
        placed = self.clock.seed(np.array(wanted, dtype=np.int32)) if wanted else 0
        start, read, bytes_read, error = time.monotonic(), 0, 0, ""
        for i in range(0, placed, batch):
            part = np.array(wanted[i : i + batch], dtype=np.int32)
            slots = np.array([self.clock.slot_of(int(k)) for k in part], dtype=np.int32)
            loads = [
                (
                    self.source.moe_layers[int(k) // self.num_experts],
                    int(k) % self.num_experts,
                    self.record(int(slot)),
                )
                for k, slot in zip(part, slots, strict=True)
            ]
            try:
                bytes_read += self._read(loads, part, slots)
            except ReadFault as exc:
                error = str(exc)
                for key in wanted[i + batch : placed]:
                    self.clock.remove(key)
                break
            self._point(loads, slots)
            read += len(part)
        return {
            "wanted": len(wanted),
            "seeded": read,
            "bytes_read": bytes_read,
            "seconds": round(time.monotonic() - start, 3),
            "error": error,
        }

    def _reap(self) -> None:
        """Release what reads given up on held, once they finished: their slots are unpinned
        and their keys un-admitted (whatever the late reads wrote is not trusted; a later miss
        reads the expert again)."""
        left = []
        for stuck, keys, slots in self._stuck:
            if not stuck.finished():
                left.append((stuck, keys, slots))
                continue
            for key, slot in zip(keys, slots, strict=True):
                self.clock.unpin(int(slot))
                self.clock.remove(int(key))
                self._stuck_keys.discard(int(key))
            log.warning(
                "%d expert reads that had timed out finished; their slots are free", len(keys)
            )
        self._stuck = left

    def _watch_source(self) -> None:
        """Log once when the source's files went away (deleted, replaced, unreadable): reads
        go on through the open descriptors, but a restart would fail. Looked at on a read at
        most every WATCH_S: a look (stat and access) took 38 us on a busy 2-core VM, as much
        as reading a demo record."""
        now = time.monotonic()
        if now - self._watched < WATCH_S:
            return
        self._watched = now
        problem = self.source.problem()
        if problem and problem != self._problem:
            log.error(
                "the expert source changed under the server: %s; reads go on through the open "
                "file until it fails them, and a restart will not load it",
                problem,
            )
        self._problem = problem

    def stuck_keys(self) -> frozenset[int]:
        """Keys whose reads timed out and may still land (their slots' bytes are not trusted)."""
        return frozenset(self._stuck_keys)

    def counters(self) -> dict[str, int]:
        return self.clock.counters()

    def close(self) -> None:
        self.source.close()
