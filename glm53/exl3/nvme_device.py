"""nvme-exact, device side: the RAM tier's arena as the pinned home of exllamav3's experts.

Its load and route ran on an H200 on 2026-12-02: tests/gpu/test_nvme_exact_gpu.py passed 6 of 6
with prefill staging off (in-process and served, RAM caps 40 % and 70 %, torch.equal to stock
exllamav3). Prefill staging and decode prefetch below passed theirs on an H100 on 2026-12-05
(below). The host logic it drives (glm53.tiers.gpu_home.RamHome) is tested in CI with the real
RAM tier, store and O_DIRECT reads.

Per MoE layer, in exllamav3's routing hook (glm53.exl3.hooks):

1. The picks and, gathered on the device, the VRAM slot of each reach the host in one copy: the
   one sync per layer that nvme modes cannot avoid, since the store read needs the picks.
2. RamHome.resolve makes every pick the VRAM cache does not hold resident in the RAM tier (one
   O_DIRECT batch) and returns home-table writes, scattered into the device cache's `home`.
3. On the stream, in order: `check_homes` (counts picks with neither a VRAM slot nor a home:
   table_bad), exact mode's own `route` + `copy` (lookup, admission, slot copy from the RAM
   home), and `point_picks` (each pick's table entries at its slot or its RAM home).

Exact and nvme-exact share the admission path (DeviceExpertCache.route); only the home moves.
After each Generator iteration the engine reads the table_bad counter: a non-zero rise fails
that iteration's requests and flushes the VRAM cache (a slot may hold the poison record).

A read fault in a decode forward of the Generator (the engine sets `row_keys` around
Generator.iterate; prefill is marked NO_LANE) fails only the jobs whose rows picked the expert
(glm53.tiers.read_faults): the expert is masked (id -1, weight 0) for the step, the step runs
without it, and `take_faults` hands the engine the jobs to fail. Elsewhere (prefill, scoring,
warm-up) the ReadFault is raised with the rows that picked the expert, as before.

Prefill staging (a prefill chunk of at least the stager's min_rows, when --ec-stage-gb left staging
on; glm53.tiers.prefill_ahead has the design and the ordering argument; it FAILED its first GPU run
on 2026-12-05, a first-hook ordering bug fixed in f70a928, after which its GPU tests passed on an
H100 that day, in-process and served at RAM 40 % and 70 % and with the store's read faults; on
by default in the store modes, as in exact mode): each layer's experts are read into the RAM
tier ahead of it on the store's reader threads (AheadReads waves), the stager
(glm53.tiers.vram_cache.PrefillStager, gather mode) copies layer L+1 into a staging buffer on its
side stream while L computes, and only the picks that L's stage did not cover are pointed as
above. Staging moves where a pick's bytes are read from, never the bytes, the picks or the
kernels: the output is unchanged, bit for bit.

Decode prefetch (--nvme-prefetch next-layer; glm53.tiers.decode_prefetch has the design and the
eviction contract; both its cases FAILED their first GPU run on 2026-12-05, with prefill staging on;
after that fix they passed on an H100 the same day, alone and with the batch, at RAM 40 % and
70 %; served without a flag, off by default): in a decode forward the hook hands `route` layer
L+1's picks as L+1's router predicts them from L's MoE input (glm53.exl3.hooks.predict_next);
they and their VRAM slots join L's one copy. After L's resolve the predicted store misses of L+1
are queued on the store's reader threads (L's RAM picks pinned meanwhile), and at L+1's hook
that wave is collected before the resolve, so its experts are hits.
`end_forward` (after each Generator iteration) collects a wave a forward left over.

nvme mode (glm53.tiers.nvme_lane has the design and the ordering argument): the layer's
glm53.exl3.fast_hooks.FastLayer publishes first, then `route(..., lane=layer)` resolves and
points the selection as routed (the publish's saved copy, lane picks included) and admits into
VRAM only what the lane did not take. `key_lane` (key -> RAM slot, -1) is written with the home
table, for the publish's eligibility.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from glm53.exl3.hooks import DECODE_MAX_ROWS, NO_LANE
from glm53.tiers.decode_prefetch import MODES as PREFETCH_MODES
from glm53.tiers.decode_prefetch import DecodePrefetch
from glm53.tiers.gpu_home import HomeUpdate, RamHome, rows_picking, verify_home
from glm53.tiers.nvme_lane import lane_slots
from glm53.tiers.prefill_ahead import AheadReads
from glm53.tiers.ram_tier import RamTier, ReadFault, TierError
from glm53.tiers.read_faults import FaultRecord, fault_record, resolve_isolating

log = logging.getLogger("glm53.tiers")


class NvmeHome:
    """Owns the RAM tier's CUDA registration, the RamHome and the table_bad counter."""

    def __init__(self, ec, tier: RamTier, absent_address: int, device, stager=None,
                 working_set: int = 0, prefetch: str = "off"):  # fmt: skip
        import torch

        from glm53 import _cuda

        self.ec, self.tier, self.device = ec, tier, torch.device(device)
        self._cuda = _cuda
        self.lock = threading.Lock()  # the tiers' owner: iterate, and /admin/verify between
        self.arena_host = tier.arena.ctypes.data
        _cuda.host_register(self.arena_host, tier.ram_cap_bytes)
        self.registered = True
        arena_dev = _cuda.host_device_pointer(self.arena_host)
        self.home = RamHome(tier, arena_dev, absent_address)
        self.absent = int(absent_address)
        self.bad = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.table_bad = 0  # as last read from the device
        self.moe_layers = tier.source.moe_layers
        self._home_t = ec._t["home"]
        self._key_slot = ec._t["key_slot"]
        # nvme mode's lane eligibility: each key's RAM slot, -1 where the tier does not hold it
        self.key_lane = torch.full((ec.geo.n_keys,), -1, dtype=torch.int32, device=self.device)
        # decode fault isolation: set by the engine around Generator.iterate (the key of each
        # row of the running decode forward); the faults of the step, for take_faults
        self.row_keys = None
        self.faults: list[FaultRecord] = []
        self.faults_isolated = 0
        # prefill staging (glm53.tiers.prefill_ahead): the stager's buffers and side stream,
        # the waves read ahead, and the MoE layer the next staged hook must be to continue
        self.stager = stager
        self.ahead = None
        if stager is not None:
            self.ahead = AheadReads(self.home, stager.buf_slots, working_set)
        self._next_staged = -1
        self.staged_layers = 0
        # a layer-major pass (glm53.exl3.layer_major; the stager held): the RAM slots of the
        # layer its chunks are going through, pinned from the chunk that read them until the
        # pass moves to another layer or ends, so that the store is read once per layer per
        # prompt (frequency admission alone would let a chunk's misses evict the records an
        # earlier chunk of the same layer read); dropped at the first hook after the pass
        self._pass_layer: int | None = None
        self._pass_pins: dict[int, int] = {}  # key -> its pinned slot
        # the pass stages each layer once, at its first chunk (PrefillStager.stage_held, on the
        # main stream): (layer, the experts whose staged copies the host trusts: those of the
        # stage that were resident in the RAM tier then), and how many layers it staged
        self._pass_staged: tuple[int, np.ndarray] | None = None
        self.pass_stages = 0
        # whether the pass stages at all (the GPU engine sets it from --allow-unrun-modes:
        # glm53.modes.UNRUN["store-pass-staging"]); off: each chunk reads its picks zero-copy
        self.pass_staging = False
        # decode prefetch (--nvme-prefetch next-layer, glm53.tiers.decode_prefetch)
        if prefetch not in PREFETCH_MODES:
            raise TierError(f"--nvme-prefetch {prefetch!r}: one of {', '.join(PREFETCH_MODES)}")
        self.prefetch = DecodePrefetch(self.home) if prefetch == "next-layer" else None

    # --- per layer, from the routing hook --------------------------------------------------
    def route(
        self, layer: int, selected, decode: bool, params: dict, weights=None, lane=None,
        predicted=None,
    ) -> None:  # fmt: skip
        """Make every pick of MoE `layer` resident (VRAM slot or RAM home) and point exllamav3's
        tables at it. `lane` (nvme mode, decode): the layer's FastLayer after its publish; its
        `orig_sel` holds the selection as routed, `selected` the rest (lane picks are -1).
        `predicted` (decode prefetch): layer + 1's picks as its router makes them from this
        layer's MoE input (a device int64 tensor), brought to the host in the same copy."""
        import torch

        n_exp = self.ec.geo.n_experts
        all_experts = bool(params.get("activate_all_experts"))
        if all_experts:  # every expert of the layer is read
            sel = torch.arange(n_exp, dtype=torch.int64, device=self.device)
        else:
            sel = selected.reshape(-1)
        if not sel.is_contiguous() or sel.dtype != torch.int64:
            raise TierError("exllamav3's selected experts are not a contiguous int64 tensor")
        n = sel.numel()
        routed = sel if lane is None or all_experts else lane.orig_sel[:n]
        valid = (routed >= 0) & (routed < n_exp)
        keys = torch.where(valid, routed + layer * n_exp, torch.zeros_like(routed))
        slots = torch.where(valid, self._key_slot[keys].long(), torch.full_like(routed, -1))
        num_rows = selected.numel() // selected.shape[-1]
        staged = self._staging(layer, decode, all_experts, num_rows, params, lane)
        passing = self.stager is not None and self.stager.hold
        in_pass = passing and not decode and not all_experts  # a layer-major pass's chunk
        pass_stage = in_pass and self.pass_staging
        stage_now = pass_stage and not self._pass_holds(layer)  # the pass's first chunk of layer
        parts = [routed, slots]
        if staged:  # the VRAM slots of the next two layers' experts, for their waves
            hi = min(layer + 3, self.ec.geo.n_layers)
            parts.append(self._key_slot[(layer + 1) * n_exp : hi * n_exp].long())
        pf, plain_decode = self.prefetch, (
            decode and not all_experts and not params.get(NO_LANE) and num_rows <= DECODE_MAX_ROWS
        )  # fmt: skip
        m = 0
        if pf is not None and plain_decode and predicted is not None:
            if layer + 1 < self.ec.geo.n_layers:  # layer + 1's picks and their VRAM slots
                m = self._predicted_parts(layer + 1, predicted, parts)
        if stage_now:  # this layer's VRAM slots: what the stage kernel will copy
            parts.append(self._key_slot[layer * n_exp : (layer + 1) * n_exp].long())
        host = torch.cat(parts).cpu().numpy()  # the one sync of this layer
        picks, in_vram = host[:n], host[n : 2 * n] >= 0
        pred, pred_vram = host[2 * n : 2 * n + m], host[2 * n + m : 2 * n + 2 * m] >= 0
        tail = host[2 * n + 2 * m :]
        layer_slots = None
        if stage_now:
            layer_slots, tail = tail[len(tail) - n_exp :], tail[: len(tail) - n_exp]
        ahead_slots = tail.reshape(-1, n_exp)
        if self.ahead is not None and not self.ahead.idle() and not staged:
            self._drain()
        elif staged and layer != self._next_staged:
            self._drain()  # a new forward (or one after a fault): start the pipeline afresh
        elif staged:  # the host synced on this router: MoE layer-1 is done with its picks,
            self.ahead.release_picks(layer - 1)  # whose slots this resolve may need
        if self._pass_pins and (not passing or (not decode and layer != self._pass_layer)):
            self._end_pass_layer()  # the pass moved to another layer, or ended
        if not passing:
            self._pass_staged = None
        # a chunk of the pass after its layer's first: the experts its stage holds are read
        # from the staging buffer, neither looked up in the tier again nor pinned
        covered = self._pass_staged[1] if pass_stage and not stage_now else np.empty(0, np.int64)
        reads = self.home.counters["ram_reads"]
        prefetched = ()  # the experts of this layer a prefetch wave made resident (pinned)
        if pf is not None and plain_decode:
            prefetched = pf.take(layer)  # may wait for the wave's reads
        elif pf is not None and not pf.idle():
            pf.drain()  # a prefill or an all-experts call: nothing of a wave left pinned
        isolate = (
            decode and self.row_keys is not None and weights is not None
            and not all_experts and not params.get(NO_LANE)
        )  # fmt: skip
        try:
            if isolate:
                update, faults, kept = resolve_isolating(
                    self.home, self.moe_layers[layer], picks, in_vram, num_rows, prefetched
                )
            else:
                # a staged hook: the experts L's wave made resident (pinned) are not looked up
                # again, so a prefill chunk counts each access once, as without staging (and a
                # decode prefetch wave's experts the same way)
                ahead = self.ahead.staged(layer) if staged else (covered if in_pass else prefetched)
                update, faults, kept = (
                    self.home.resolve(self.moe_layers[layer], picks, in_vram, ahead),
                    [],
                    picks,
                )
        except ReadFault as exc:  # name the rows whose picks needed the record
            self._write(self.home.take_pending())  # evictions a failed wave made
            if all_experts:  # every row reads every expert
                rows = np.arange(num_rows)
            else:
                rows = rows_picking(picks, num_rows, exc.expert)
            raise exc.picked_by(rows, num_rows) from None
        except Exception:
            self._write(self.home.take_pending())
            raise
        self._write(update)
        if stage_now:  # after the resolve: this chunk's misses are resident, so staged too
            covered = self._stage_pass_layer(layer, layer_slots)
        if in_pass:
            self._pin_pass_layer(layer, kept, in_vram, covered)
        if pf is not None and plain_decode:
            pf.settle(layer, kept)
            if m:  # layer + 1's predicted misses queued; the slots they take go absent now
                ram = kept[(kept >= 0) & (kept < n_exp) & ~in_vram]
                pf.begin(layer + 1, pred, pred_vram, ram, selected.shape[-1] * num_rows)
                self._write(self.home.take_pending())
        if lane is not None and self.home.counters["ram_reads"] != reads:
            lane.skip_timing()  # the host's wait for the store is not the GPU's time
        if faults:
            self._isolate(faults, kept != picks, selected, weights, lane)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if decode:
            run = routed
        else:  # prefill: the distinct picks only (exact mode's prefill admits nothing)
            distinct = np.unique(picks[(picks >= 0) & (picks < n_exp)])
            if in_pass:  # what the pass's stage of this layer holds stays pointed there
                distinct = np.setdiff1d(distinct, covered)
            run = torch.from_numpy(distinct.astype(np.int64)).to(self.device)
        ptr = self.ec._ptr
        if staged:  # L's zero-copy picks pinned first: the wave _ahead_of may begin admits
            vram = {int(e) for e in picks[in_vram]}  # picks in VRAM slots: nothing to pin
            held = self._hold_picks(layer, distinct, vram)
            self._write(self._ahead_of(layer, ahead_slots))
        # no launch for no picks: an empty tensor's data_ptr() is null, which the launchers
        # refuse (a staged layer whose stage covered every pick leaves none to point)
        if run.numel():
            self._cuda.ec_check_homes(
                ptr, run.data_ptr(), run.numel(), layer, self.absent, self.bad.data_ptr(), stream
            )
        if decode:  # the lane's picks (-1 in sel) are not admitted
            self.ec.route(layer, sel, admit=True)
        if staged:
            run = self._staged_step(layer, distinct, vram, held)
        if run.numel():
            self._cuda.ec_point_picks(ptr, run.data_ptr(), run.numel(), layer, self.absent, stream)
        if staged:
            self._after_point(layer, ahead_slots)

    def _pass_holds(self, layer: int) -> bool:
        """Whether the running pass has staged `layer` and its buffer still holds it."""
        mine = self._pass_staged is not None and self._pass_staged[0] == layer
        return mine and self.stager.is_held(layer)

    def _stage_pass_layer(self, layer: int, layer_slots) -> np.ndarray:
        """The pass's first chunk of `layer`, resolved: stage the layer once for all its
        chunks (on the main stream, before this chunk's MoE kernel). The stage kernel copies the
        first buf_slots experts (in expert order) that no VRAM slot holds, from their homes; the
        host trusts the copies of those resident in the RAM tier now (their homes are written,
        their reads done; the copy runs before the next chunk's sync, so before any later
        resolve can evict them) and returns them. Those absent (a copy of the absent record)
        are pointed at their homes whenever a chunk picks them, as unstaged picks are."""
        tier = self.tier
        base = tier.moe_index[self.moe_layers[layer]] * tier.num_experts
        uncached = np.flatnonzero(layer_slots < 0)[: self.stager.buf_slots].astype(np.int64)
        covered = uncached[self.home.home_of[base + uncached] != self.absent]
        self.stager.stage_held(layer)
        self._pass_staged = (layer, covered)
        self.pass_stages += 1
        return covered

    def _pin_pass_layer(self, layer: int, picks, in_vram, covered=()) -> None:
        """A layer-major pass's chunk of `layer` resolved: pin the RAM slots of its picks not
        pinned yet (but those its stage holds: `covered`), while at least half the tier stays
        unpinned (room for the decode steps that run between the pass's steps, and for the next
        layer's first chunk: the pins of this one go before it resolves)."""
        tier = self.tier
        base = tier.moe_index[self.moe_layers[layer]] * tier.num_experts
        self._pass_layer = layer
        valid = (picks >= 0) & (picks < tier.num_experts) & ~in_vram
        valid &= ~np.isin(picks, np.asarray(covered, dtype=np.int64))
        for e in np.unique(picks[valid]).tolist():
            key = base + int(e)
            if key in self._pass_pins or tier.clock.n_pinned >= tier.num_slots // 2:
                continue
            slot = tier.clock.slot_of(key)
            if slot >= 0:
                tier.clock.pin(slot)
                self._pass_pins[key] = slot

    def _end_pass_layer(self) -> None:
        for slot in self._pass_pins.values():
            self.tier.clock.unpin(slot)
        self._pass_pins, self._pass_layer = {}, None

    def pass_stats(self) -> dict:
        """The layer-major pass's pins now (0 outside a pass), and the layers passes staged."""
        return {"pass_layer": self._pass_layer, "pass_pinned": len(self._pass_pins),
                "pass_stages": self.pass_stages}  # fmt: skip

    def _predicted_parts(self, nxt: int, predicted, parts: list) -> int:
        """Append MoE layer `nxt`'s predicted picks and the VRAM slot of each to the layer's
        one copy; returns how many there are."""
        import torch

        n_exp = self.ec.geo.n_experts
        pred = predicted.reshape(-1).to(torch.int64)
        ok = (pred >= 0) & (pred < n_exp)
        keys = torch.where(ok, pred + nxt * n_exp, torch.zeros_like(pred))
        parts += [pred, torch.where(ok, self._key_slot[keys].long(), torch.full_like(pred, -1))]
        return pred.numel()

    def end_forward(self) -> None:
        """After a forward (each Generator iteration, a scoring forward): a decode prefetch wave
        left over (the forward ended or failed after the hook that began it) is collected and
        every pin it held dropped, its home writes made (glm53.tiers.decode_prefetch)."""
        if self.prefetch is not None and not self.prefetch.idle():
            self.prefetch.drain()
            self._write(self.home.take_pending())

    # --- prefill staging (glm53.tiers.prefill_ahead has the design and the ordering) ---------
    def _staging(self, layer, decode, all_experts, num_rows, params, lane) -> bool:
        """Whether this call is a staged prefill hook: a prefill forward of at least the
        stager's min_rows, not reading every expert, outside a layer-major pass's hold."""
        st = self.stager
        return (
            st is not None and not decode and not all_experts and lane is None
            and num_rows >= st.min_rows and not st.hold
        )  # fmt: skip

    def _drain(self) -> None:
        """End the staging pipeline: the side stream's copies finished (they read RAM slots),
        every wave collected, every pin dropped, their writes made."""
        self.stager.side.synchronize()
        self.stager.pending.clear()
        self._write(self.ahead.drain())
        self._next_staged = -1

    def _ahead_of(self, layer: int, ahead_slots):
        """The wave of layer + 1 collected (begun at the hook before; begun and collected now
        at a forward's first staged hook): its home-table writes."""

        ahead, nxt = self.ahead, layer + 1
        if nxt >= self.stager.prefill_layers:  # the last MoE layer never runs in prefill
            return self.home.take_pending()
        if layer != self._next_staged:
            ahead.begin(nxt, ahead_slots[0])
        got = ahead.finish(nxt)
        return self.home.take_pending() if got is None else got

    def _hold_picks(self, layer, distinct, vram: set) -> set:
        """Pin the RAM homes of this layer's picks that its wave does not cover (the MoE kernel
        reads them zero-copy) before anything else of the hook admits into the tier: at a
        forward's first staged hook `_ahead_of` begins the next layer's wave, whose admissions
        would otherwise be free to evict them (frequency admission takes the newest probation
        member first: the misses this layer's resolve has just read). Returns the experts held."""
        rest = np.setdiff1d(distinct, self.ahead.staged(layer))
        held = [e for e in rest.tolist() if e not in vram]
        self.ahead.hold_picks(layer, held)
        return set(held)

    def _staged_step(self, layer, distinct, vram: set, held: set):
        """Main waits for this layer's stage, the side stream stages the next one, and the
        picks the stage of this layer did not cover are returned to be pointed as today
        (`held`: those already pinned by _hold_picks)."""
        import torch

        st, ahead = self.stager, self.ahead
        self._stage_event = st.wait_staged(layer)
        if layer + 1 in ahead.ready:
            st.stage_ahead(layer + 1)
        covered = ahead.staged(layer) if self._stage_event is not None else np.empty(0, np.int64)
        rest = np.setdiff1d(distinct, covered)
        # a wave of this layer with no stage (not expected: finish and stage_ahead go together)
        # leaves its experts read zero-copy: pinned here too
        ahead.hold_picks(layer, [e for e in rest.tolist() if e not in vram and e not in held])
        if len(covered):
            self.staged_layers += 1
        return torch.from_numpy(rest.astype(np.int64)).to(self.device)

    def _after_point(self, layer: int, ahead_slots) -> None:
        """The stage of this layer seen complete (its wave unpinned); the wave of layer + 2
        begun (its reads run while this layer and the next one compute), if a prefill runs that
        layer (PrefillStager.prefill_layers: not the last MoE layer, whose MLP only decode runs,
        so its experts are not read from the store ahead for nothing)."""
        if self._stage_event is not None:
            self._stage_event.synchronize()
        self.ahead.release(layer)
        if layer + 2 < self.stager.prefill_layers and len(ahead_slots) > 1:
            self.ahead.begin(layer + 2, ahead_slots[1])
            self._write(self.home.take_pending())  # the slots it took: absent from now on
        self._next_staged = layer + 1

    def _isolate(self, faults, masked, selected, weights, lane) -> None:
        """A decode step goes on without each faulted expert: its picks become id -1 / weight 0
        in the live selection (and in the lane's saved copy, which a fallback runs), and the
        step's fault records name the jobs of the rows that picked it."""
        import torch

        keys = self.row_keys()
        for fault in faults:
            self.faults.append(fault_record(fault, keys))
            log.error("read fault isolated to its rows' requests: %s", fault)
        self.faults_isolated += len(faults)
        bad = torch.from_numpy(masked).to(self.device)
        selected.masked_fill_(bad.view(selected.shape), -1)
        weights.masked_fill_(bad.view(weights.shape), 0)
        if lane is not None:
            n = bad.numel()
            lane.orig_sel[:n].masked_fill_(bad, -1)
            lane.orig_w[:n].masked_fill_(bad, 0)

    def take_faults(self) -> list[FaultRecord]:
        """The decode faults isolated since the last call (the engine fails their jobs)."""
        out, self.faults = self.faults, []
        return out

    def _write(self, update: HomeUpdate) -> None:
        """Home-table writes, and the same keys' RAM slots into key_lane (on the stream)."""
        import torch

        if len(update) == 0:
            return
        keys = torch.from_numpy(update.keys).to(self.device)
        self._home_t[keys] = torch.from_numpy(update.addresses).to(self.device)
        slots = lane_slots(update.addresses, self.absent, self.home.arena_address,
                           self.tier.slot_bytes)  # fmt: skip
        self.key_lane[keys] = torch.from_numpy(slots).to(self.device)

    # --- per iteration, from the engine ------------------------------------------------------
    def check_table_bad(self) -> None:
        """After an iteration: a pick read the poison record (host and device disagreed on a
        home). Fail the iteration and flush the VRAM cache, whose slots may hold poison."""
        now = int(self.bad.item())
        if now == self.table_bad:
            return
        grew, self.table_bad = now - self.table_bad, now
        self.flush_vram()
        log.error("table_bad rose by %d: picks found no home; the VRAM cache was flushed", grew)
        raise TierError(
            f"{grew} expert picks of this step found neither a VRAM slot nor a RAM-tier home "
            "(table_bad); the step's output is not trusted and its requests fail; the VRAM "
            "cache was flushed. Please report this with the server log."
        )

    def flush_vram(self) -> None:
        self.ec.empty()

    # --- start and checks --------------------------------------------------------------------
    def warm_start(self, ram_keys, vram_keys) -> dict:
        """Seed the RAM tier from its heat list, write the homes, then seed the VRAM cache with
        those of its heat list whose homes are now present (a seed copies from the home)."""
        out = self.tier.seed(ram_keys) if ram_keys else {"seeded": 0, "error": ""}
        self._write(self.home.sync_all())
        present = self.home.home_of != self.absent
        keys = [int(k) for k in vram_keys if 0 <= int(k) < len(present) and present[int(k)]]
        out["vram_seeded"] = self.ec.seed(keys) if keys else 0
        return out

    def verify(self, num_samples: int, seed=None):
        """The tier check (glm53.tiers.gpu_home.verify_home) with the VRAM slots and the device
        home table; call it under `lock`."""
        if self.ahead is not None and not self.ahead.idle():
            self._drain()  # a forward cut short by a fault may have left a wave out
        self.end_forward()  # and a decode prefetch wave
        table = self._home_t.cpu().numpy()
        return verify_home(
            self.home, num_samples, table, vram=VramSlots(self.ec, self.moe_layers), seed=seed
        )

    def stats(self) -> dict:
        return {
            "slots": self.tier.num_slots,
            "cap_bytes": self.tier.ram_cap_bytes,
            "resident": self.tier.clock.n_used,
            **self.tier.faults,
            **self.home.counters,
            "table_bad": self.table_bad,
            "faults_isolated": self.faults_isolated,
            **self.staging_stats(),
            **self.prefetch_stats(),
        }

    def prefetch_stats(self) -> dict:
        """Decode prefetch's counters (glm53.tiers.decode_prefetch), `prefetch_` prefixed;
        zeros when it is off."""
        if self.prefetch is None:
            return dict.fromkeys(DecodePrefetch.COUNTERS, 0)
        return dict(self.prefetch.counters)

    def staging_stats(self) -> dict:
        """Prefill staging's counters (glm53.tiers.prefill_ahead), `stage_` prefixed."""
        if self.ahead is None:
            return {"stage_slots": 0}
        out = {f"stage_{k}": v for k, v in self.ahead.counters.items()}
        out.update(stage_slots=self.stager.buf_slots, stage_layers=self.staged_layers)
        return out

    def close(self) -> None:
        if self.ahead is not None and not self.ahead.idle():
            self._drain()  # no read may still be landing in the arena
        if self.prefetch is not None and not self.prefetch.idle():
            self.prefetch.drain()
        if self.registered:
            self._cuda.host_unregister(self.arena_host)
            self.registered = False
        self.tier.close()


class VramSlots:
    """The device cache as glm53.tiers.check.VramRecords: its resident (layer, expert, slot)
    triples and a host copy of a slot (one small device-to-host copy each)."""

    def __init__(self, ec, moe_layers):
        self.ec, self.moe_layers = ec, moe_layers
        self.slot_bytes = ec.geo.record_bytes

    def resident(self) -> list[tuple[int, int, int]]:
        n_exp = self.ec.geo.n_experts
        keys = self.ec.slot_keys()
        return [
            (self.moe_layers[int(k) // n_exp], int(k) % n_exp, s)
            for s, k in enumerate(keys.tolist())
            if k >= 0
        ]

    def slot_copy(self, slot: int) -> np.ndarray:
        rb = self.slot_bytes
        return self.ec._t["slots"][slot * rb : (slot + 1) * rb].cpu().numpy()
