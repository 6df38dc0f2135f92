"""Decode prefetch in the nvme modes, host side (`--nvme-prefetch next-layer`): the next MoE
layer's likely picks read from the store into the RAM tier while this layer computes.

On a GPU (H200, 2026-12-05) both in-process cases of tests/gpu/test_nvme_exact_gpu.py FAILED.
They ran with prefill staging on, so prefill staging's first-hook bug (glm53.tiers.prefill_ahead,
fixed since) is the likely cause, not proven. After that fix both passed on an H100 the same day,
and again in the whole GPU suite run there (torch.equal to stock exllamav3 at RAM 40 % and 70 %,
alone and with the batch admitted together): `--nvme-prefetch next-layer` is served without
--allow-unrun-modes, off by default (not benchmarked). CI runs it with the real RAM tier, store
and O_DIRECT reads and a mock of the device (tests/test_decode_prefetch.py).

The prediction. In a decode forward, MoE layer L's routing hook also runs layer L+1's own
router (its routing function and config) on L's MoE input (glm53.exl3.hooks): the seed project
measured this look-ahead to halve a token's store misses (40.2 -> 21.9) and gain 13 % at c1;
router-free predictors (past routes) recalled 7-20 % and were dropped. The predicted picks and
the VRAM slot of each reach the host in the layer's one copy (glm53.exl3.nvme_device), so the
prediction adds no sync.

The pipeline, per decode hook of MoE layer L (glm53.exl3.nvme_device.NvmeHome.route):

1. `take(L)`: the host has synced on L's router output, so the MoE kernel of L-1 is done: the
   pins of L-1's picks are dropped; the wave predicted for L (begun at hook L-1) is finished
   (RamTier.finish_resident: the engine thread waits for what the reader threads did not finish
   yet) and its home-table writes deferred into the RamHome (the resolve writes them). Its
   experts are returned: the resolve of L counts those L picked as RAM hits, without a second
   lookup or read (RamHome.resolve's `read_ahead`).
2. L's picks are resolved as without prefetch (a pick the wave did not bring is read then).
3. `settle(L, picks)`: the wave's experts are counted as hits (L picked them) or wasted (read,
   not picked), and its pins dropped.
4. `begin(L+1, ...)`: the predicted experts of L+1 that neither VRAM nor the RAM tier holds
   are admitted through the tier's own policy (RamTier.begin_resident: frequency admission,
   slots pinned) and their reads queued on the store's reader threads; the hook returns at once.

Ownership and ordering: as glm53.tiers.prefill_ahead, whose machinery (RamTier.begin_resident /
finish_resident / release_wave, RamHome.begin and collect) this reuses. The engine
thread owns the tier; reader threads write only the bytes of the slots a wave gave them.

Eviction contract: a slot is never evicted while the device may read it, nor while it is read
into. Without prefetch a decode hook evicts only after its sync, when every earlier kernel is
done. A wave begun at hook L evicts before L's own MoE kernel and VRAM admissions run, so the
RAM slots of L's picks are pinned first (`hold`) and stay pinned until hook L+1 (or the end of
the forward); the slots a wave's misses take get `absent` homes at once, and their own homes
only once their bytes are in (`take`). The wave's admissions count one access each in the
tier's frequency counts, as a demand miss does (a wasted prediction's too); L+1's resolve then
counts the experts it picks from the wave as RAM hits without a second access. A wave is cut to the RAM tier's room: at most top-k x
rows experts, and never more than leaves one layer's decode working set unpinned beside every
slot pinned now (L's picks included), so it evicts none of them and L+1's resolve always has
room.

A prefetch is only a hint. A read fault of a wave is logged and counted (`faults`) and fails
no job: its keys stay absent (a timed-out read's keys stay pinned as RamTier handles it), and
if L+1 picks one, its demand read reports the fault as today, with the rows that picked it.
A wave left over (a forward that ended after its hook, a fault, a prefill next) is finished and
released by `drain`, which NvmeHome calls at the next hook that is not its layer, at the end of
each Generator iteration, and before a tier check or close.
"""

from __future__ import annotations

import logging

import numpy as np

from glm53.modes import NVME_PREFETCH
from glm53.tiers.gpu_home import RamHome
from glm53.tiers.ram_tier import PendingWave, ReadFault

log = logging.getLogger("glm53.tiers")

MODES = NVME_PREFETCH  # --nvme-prefetch


class DecodePrefetch:
    """The next-layer waves of one RamHome (layers are MoE indices)."""

    # waves begun; keys submitted (store reads queued); hits (read, then picked by their
    # layer); wasted (read, not picked); faults (a wave's read failed: no job fails); cut
    # (waves cut to the tier's room); bytes read
    COUNTERS = (
        "prefetch_waves", "prefetch_keys", "prefetch_hits", "prefetch_wasted",
        "prefetch_faults", "prefetch_cut", "prefetch_bytes",
    )  # fmt: skip

    def __init__(self, home: RamHome):
        self.home, self.tier = home, home.tier
        self.layer = -1  # the MoE layer of the wave below (begun at hook layer - 1)
        self.wave: PendingWave | None = None
        self.ready = False  # the wave was finished (its reads collected, its slots pinned)
        self.held: list[int] = []  # slots pinned for the picks of the hook that began the wave
        self.counters = dict.fromkeys(self.COUNTERS, 0)

    def idle(self) -> bool:
        return self.wave is None and not self.held

    def pending(self, layer: int) -> bool:
        """Whether a wave was begun for MoE `layer` (the hook before predicted it)."""
        return self.wave is not None and self.layer == layer

    # --- hook L ------------------------------------------------------------------------------
    def take(self, layer: int) -> np.ndarray:
        """At hook `layer`, after its sync: drop the previous hook's pins, finish the wave of
        `layer` and defer its home writes. Returns the experts it made resident (pinned until
        `settle`); empty when there was none or its read failed (logged and counted)."""
        if self.wave is not None and not self.pending(layer):
            self.drain()  # not this forward's next hook: left over
        self._release_held()
        if self.wave is None or not self._finish():
            self._drop()
            return np.empty(0, np.int64)
        return self.wave.experts.astype(np.int64)

    def settle(self, layer: int, picks) -> None:
        """After the resolve of `layer`: count the wave's experts as hits (picked) or wasted
        (read, not picked), and unpin them."""
        if self.pending(layer) and self.ready:
            picked = set(np.asarray(picks, dtype=np.int64).reshape(-1).tolist())
            read = self.wave.experts[self.wave.num_hits :].tolist()
            hits = sum(1 for e in read if e in picked)
            self.counters["prefetch_hits"] += hits
            self.counters["prefetch_wasted"] += len(read) - hits
        self._drop()

    def begin(self, layer: int, predicted, in_vram, picks_resident, working_set: int) -> None:
        """At hook `layer - 1`, after its resolve: queue the reads of the experts of MoE
        `layer` in `predicted` (any shape; ids outside the layer skipped) that `in_vram` (same
        shape) does not mark and the RAM tier does not hold. `picks_resident`: the experts of
        layer - 1 whose RAM homes its MoE kernel and VRAM admissions read (pinned until the next
        hook). `working_set`: the records one decode resolve may need at once (top-k x rows)."""
        if not self.idle():
            raise RuntimeError("internal error: a prefetch wave begun over another")
        n_exp = self.tier.num_experts
        predicted = np.asarray(predicted, dtype=np.int64).reshape(-1)
        in_vram = np.asarray(in_vram, dtype=bool).reshape(-1)
        ok = (predicted >= 0) & (predicted < n_exp) & ~in_vram
        want = list(dict.fromkeys(predicted[ok].tolist()))[: max(0, working_set)]
        model_layer = self.tier.source.moe_layers[layer]
        base = self.tier.moe_index[model_layer] * n_exp
        want = [e for e in want if not self.tier.clock.contains(base + e)]
        if not want:
            return
        self._hold(layer - 1, picks_resident)
        room = max(0, self.tier.num_slots - self.tier.clock.n_pinned - working_set)
        if len(want) > room:
            self.counters["prefetch_cut"] += 1
            want = want[:room]
        if not want:
            self._release_held()
            return
        try:
            wave = self.home.begin(model_layer, np.array(want, dtype=np.int32))
        except ReadFault as exc:  # a hit whose read is stuck: not expected (misses only)
            self.counters["prefetch_faults"] += 1
            log.warning("decode prefetch skips MoE layer %d: %s", layer, exc)
            self._release_held()
            return
        if len(wave.experts) == 0:
            self._release_held()
            return
        self.wave, self.layer, self.ready = wave, layer, False
        self.counters["prefetch_waves"] += 1
        self.counters["prefetch_keys"] += len(wave.loads)

    # --- the end of a forward, a fault, a check ----------------------------------------------
    def drain(self) -> None:
        """Finish a wave left over (its reads collected; its homes deferred into the RamHome,
        for its next take_pending: they were read) and drop every pin. Its experts count as
        wasted (no hook picked them)."""
        self._release_held()
        if self.wave is not None and (self.ready or self._finish()):
            self.counters["prefetch_wasted"] += len(self.wave.loads)
        self._drop()

    # --- internals ---------------------------------------------------------------------------
    def _finish(self) -> bool:
        """Collect the wave's reads; its homes are deferred into the RamHome. False when a read
        failed: logged and counted, the writes the fault made necessary left pending."""
        wave = self.wave
        try:
            done = self.home.collect(wave)
        except ReadFault as exc:
            self.counters["prefetch_faults"] += 1
            log.warning(
                "decode prefetch: a read of MoE layer %d failed (%s); no job fails for it, the "
                "layer reads its picks at its own turn", self.layer, exc,
            )  # fmt: skip
            return False
        self.ready = True
        self.counters["prefetch_bytes"] += done.bytes_read
        self.home.defer(self.home.admitted(done.experts, done.slots, wave.layer))
        return True

    def _drop(self) -> None:
        """Forget the wave, unpinning its slots (a failed one holds none); reads still out are
        collected first, so none is left writing into a slot nobody pins."""
        if self.wave is not None:
            if self.wave.batch is not None:
                self._finish()
            self.tier.release_wave(self.wave)
        self.wave, self.layer, self.ready = None, -1, False

    def _hold(self, layer: int, experts) -> None:
        base = self.tier.moe_index[self.tier.source.moe_layers[layer]] * self.tier.num_experts
        for e in np.asarray(experts, dtype=np.int64).reshape(-1).tolist():
            slot = self.tier.clock.slot_of(base + int(e))
            if slot >= 0:
                self.tier.clock.pin(slot)
                self.held.append(slot)

    def _release_held(self) -> None:
        for slot in self.held:
            self.tier.clock.unpin(slot)
        self.held = []
