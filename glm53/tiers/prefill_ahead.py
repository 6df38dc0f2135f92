"""nvme-exact's prefill staging, host side: each MoE layer's experts read from the store into the
RAM tier ahead of the layer, so that the device can stage them into VRAM while the layer before
computes (glm53.exl3.nvme_device drives it; exact mode stages from its pinned home the same way,
glm53.tiers.vram_cache.PrefillStager).

What is staged. A prefill chunk of a few hundred rows or more picks nearly every expert of a
layer, and a layer's picks are known only after its router runs, so, as exact mode does, the
experts staged for a layer are the first `buf_slots` (in expert order) that the VRAM cache does
not hold: exactly those the device's stage kernel (cuda/ec.cu, stage_kernel) copies into a
staging buffer. Only fewer when the RAM tier cannot spare the slots (`budget`). The wave is
admitted through the RAM tier's own policy (frequency admission: a key seen once goes on
probation and evicts another such key, not a frequent one), and counts one access per expert
per chunk, as an unstaged chunk's resolve does: the layer's own resolve then skips the wave's
experts (RamHome.resolve's `read_ahead`). The one difference: an expert of the wave that no row
of the chunk picks is counted too (a chunk of hundreds of rows picks nearly every expert).

The pipeline, per staged hook of MoE layer L (glm53.exl3.nvme_device.NvmeHome.route):

1. L's picks are resolved as today (RamHome.resolve: hits for what the wave of L brought in;
   anything else read synchronously, its faults raised with the rows named, as today), and
   the RAM homes of those the wave of L did not bring are pinned at once (`hold_picks`).
2. `finish(L+1)`: the wave of L+1, begun at hook L-1 (at a forward's first staged hook: begun
   here, after the pins of step 1), is collected (the engine thread waits for the reads the
   reader's threads did meanwhile) and its home-table writes handed back.
3. The device stages L+1 on the side stream while L computes; the picks of L that the stage of L
   did not cover (`staged(L)`) are pointed at their VRAM slot or RAM home as today.
4. `release(L)` once the host has seen the stage of L complete; `begin(L+2)` queues the next
   wave's reads and returns at once.

Ownership and ordering across threads. The RAM tier (its CLOCK table, the RamHome mirror, this
object) has one owner, the engine thread, which runs the routing hook: it admits a wave's
experts (RamTier.begin_resident: the same frequency admission as every other miss), pins their
slots and queues the misses' reads on the store's O_DIRECT reader threads; those threads only
write the bytes of the slots they were given. Completion comes back on the engine thread
(finish: Reader.wait), which only then writes the wave's homes into the device table, so no
device read of a slot precedes the bytes' arrival. The event loop never waits on any of it.

Eviction contract: a slot is never evicted while it is written or read.
- While a wave's reads are out, its slots are pinned (a pinned slot is never a CLOCK victim).
- A finished wave stays pinned until the host has synchronized on the device event of the stage
  that copied it (`release`, after that event): the side stream's copy reads the slots.
- The RAM homes of layer L's picks that the MoE kernel reads zero-copy (picks not staged) are
  pinned from hook L (`hold_picks`) until hook L+1 (`release_picks`), where the host has synced
  on L+1's router output, which exllamav3's one stream orders after the MoE kernel of L. They
  are pinned right after L's resolve, before the hook begins any wave: a wave's misses go on
  probation in the slots of the newest probation members first, the very misses L's resolve
  has just read (a forward's first staged hook once began L+1's wave before the pins, which
  took those slots in a full tier: table_bad and stale entries; tests/test_prefill_ahead.py).
- Within one wave no slot of the wave is evicted by the wave (pyx/clock.h's batch contract).
- Pins never leave the resolve of a layer without room: a wave is cut to `budget()` records,
  which leaves at least one layer's working set of unpinned slots, and hook L+1 releases L's
  picks right after its sync, before its own resolve (held past it, they took that room in a
  tier near one working set: HomeCapError; tests/test_prefill_ahead.py).
A forward that does not follow the previous staged hook (a new chunk, a decode step, a fault)
starts with `drain`: outstanding waves are collected, the side stream synchronized, every pin
dropped. A wave's read fault is logged and counted and the layer is simply not staged: its picks
are then resolved synchronously at its own hook, where a fault fails the request with the layer
and expert named, exactly as without staging.

Why the output is unchanged: staging changes only where a pick's bytes are read from (a staging
buffer holding a copy of the RAM record, itself the store's record) and never the bytes, the
selection, the weights or the kernels; the device points a pick into a buffer only when the host
knows the record the stage copied was resident and pinned (`staged`). Prefill admits nothing into
the VRAM cache, so the cache (and the stage kernel's choice) does not move within a forward.

Torch-free: CI runs it with the real RamTier over a real store with O_DIRECT reads and a mock of
the device (tests/test_prefill_ahead.py). On a GPU (H200, 2026-12-05) it FAILED:
tests/gpu/test_nvme_exact_gpu.py's in-process staging-on cases. The cause was the first-hook
ordering above (a forward's first staged hook began the next layer's wave before pinning its own
zero-copy picks), fixed in f70a928 and proven by CPU tests. On an H100 later that day the
in-process cases passed at RAM 40 % and 70 %, and in the whole GPU suite run there that day
every case passed: in-process and served at RAM 40 % and 70 %, the store's verify, a read fault
named, and a read fault failing only the request that picked the record (which a fully staged
layer had failed before a768dc3). So staging from the store is served without
--allow-unrun-modes, at exact mode's default size (--ec-stage-gb).
"""

from __future__ import annotations

import logging

import numpy as np

from glm53.tiers.gpu_home import HomeUpdate, RamHome
from glm53.tiers.ram_tier import PendingWave, ReadFault

log = logging.getLogger("glm53.tiers")


class AheadReads:
    """The waves read ahead for one RamHome (layers are MoE indices)."""

    def __init__(self, home: RamHome, buf_slots: int, working_set: int):
        if buf_slots < 1:
            raise ValueError(f"staging needs at least 1 record per buffer, got {buf_slots}")
        self.home, self.tier = home, home.tier
        self.buf_slots, self.working_set = int(buf_slots), int(working_set)
        self.out: dict[int, PendingWave] = {}  # begun, reads out
        self.ready: dict[int, PendingWave] = {}  # finished, pinned until release
        self.picks: dict[int, list[int]] = {}  # slots pinned for a layer's zero-copy picks
        self.counters = {"waves": 0, "reads": 0, "bytes_read": 0, "faults": 0, "cut": 0}

    def pinned(self) -> int:
        """Slots this object holds pinned (a slot held twice counts twice: conservative)."""
        waves = [*self.out.values(), *self.ready.values()]
        return sum(len(w.slots) for w in waves) + sum(len(p) for p in self.picks.values())

    def budget(self) -> int:
        """Records a new wave may pin: the tier keeps one layer's working set unpinned."""
        return max(0, self.tier.num_slots - self.working_set - self.pinned())

    def choose(self, key_slot_row) -> np.ndarray:
        """The experts the device's stage kernel copies for a layer whose VRAM slots (one per
        expert, -1: not cached) are `key_slot_row`: the first buf_slots not cached."""
        uncached = np.flatnonzero(np.asarray(key_slot_row) < 0)
        return uncached[: self.buf_slots].astype(np.int32)

    def begin(self, layer: int, key_slot_row) -> bool:
        """Queue the wave of MoE `layer` (its reads run on the reader's threads); False when
        nothing is begun (nothing to stage, no room, or a hit whose read is stuck)."""
        if layer in self.out or layer in self.ready:
            return True
        want = self.choose(key_slot_row)
        room = self.budget()
        if len(want) > room:
            self.counters["cut"] += 1
            want = want[:room]
        if len(want) == 0:
            return False
        try:
            wave = self.home.begin(self.tier.source.moe_layers[layer], want)
        except ReadFault as exc:  # the home deferred the writes the fault made necessary
            self.counters["faults"] += 1
            log.warning("prefill staging skips MoE layer %d: %s", layer, exc)
            return False
        self.out[layer] = wave
        self.counters["waves"] += 1
        return True

    def finish(self, layer: int) -> HomeUpdate | None:
        """Collect the wave of `layer` and return the home-table writes that make it visible
        (pending writes of earlier resolves included); None when there is no wave or its read
        failed (then the writes the fault made necessary are left pending in the RamHome, the
        fault is logged and counted, and the layer is not staged)."""
        wave = self.out.pop(layer, None)
        if wave is None:
            return None
        model_layer = wave.layer
        try:
            done = self.home.collect(wave)
        except ReadFault as exc:
            self.counters["faults"] += 1
            log.warning(
                "prefill staging: a read ahead of MoE layer %d failed (%s); the layer is read at "
                "its own turn instead", layer, exc,
            )  # fmt: skip
            return None
        self.ready[layer] = wave
        self.counters["reads"] += done.num_admitted
        self.counters["bytes_read"] += done.bytes_read
        update = self.home.admitted(done.experts, done.slots, model_layer)
        return RamHome._merge(self.home.take_pending(), update)

    def staged(self, layer: int) -> np.ndarray:
        """Experts of `layer` whose staged copy is trusted: its finished wave's (int64)."""
        wave = self.ready.get(layer)
        return np.empty(0, np.int64) if wave is None else wave.experts.astype(np.int64)

    def release(self, layer: int) -> None:
        """The stage of `layer` is complete on the device: unpin its wave."""
        wave = self.ready.pop(layer, None)
        if wave is not None:
            self.tier.release_wave(wave)

    def hold_picks(self, layer: int, experts) -> None:
        """Pin the RAM slots of `layer`'s picks the MoE kernel reads zero-copy (experts the
        RAM tier holds; others are in VRAM slots)."""
        base = self.tier.moe_index[self.tier.source.moe_layers[layer]] * self.tier.num_experts
        slots = []
        for e in np.asarray(experts).tolist():
            slot = self.tier.clock.slot_of(base + int(e))
            if slot >= 0:
                self.tier.clock.pin(slot)
                slots.append(slot)
        self.picks.setdefault(layer, []).extend(slots)

    def release_picks(self, layer: int) -> None:
        for slot in self.picks.pop(layer, []):
            self.tier.clock.unpin(slot)

    def drain(self) -> HomeUpdate:
        """End the pipeline: collect every wave still out (its writes returned), then drop every
        pin. The caller has synchronized whatever the device may still read (the side stream)."""
        update = HomeUpdate.empty()
        for layer in list(self.out):
            got = self.finish(layer)
            if got is not None:
                update = RamHome._merge(update, got)
        update = RamHome._merge(update, self.home.take_pending())
        for layer in list(self.ready):
            self.release(layer)
        for layer in list(self.picks):
            self.release_picks(layer)
        return update

    def idle(self) -> bool:
        return not (self.out or self.ready or self.picks)
