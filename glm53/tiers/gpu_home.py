"""nvme-exact on the GPU engine, host side: the RAM tier is the experts' pinned home.

In exact mode every routed expert has a home record in pinned host memory and the device-side
VRAM cache (cuda/ec.cu) points exllamav3's pointer tables at a VRAM slot or at that home. In
nvme-exact the home is the RAM tier (glm53.tiers.ram_tier, the CPU engine's own tier: one arena
of --ram-cap records, CLOCK with admission by frequency (glm53.tiers.policy_sim measures it
against plain CLOCK and Belady), O_DIRECT reads from the packed store, its faults and counters), whose arena
the GPU engine registers with CUDA as one pinned, mapped buffer. The device cache's `home[key]`
table becomes a table the host rewrites: the UVA address of the RAM slot holding the key, or
`absent` (a poison record in VRAM) when the key is in no RAM slot.

Per MoE layer the routing hook brings the router's picks (and which of them the VRAM cache
holds) to the host: one sync per layer, inherent in reading from the store, since the read
needs the picks. `RamHome.resolve` makes every pick that is not in VRAM resident in the RAM
tier (one O_DIRECT batch per layer, issued at once), and returns the home-table writes: the
new homes, and `absent` for every key the tier evicted to make room. The device then rewrites
the picks' table entries as exact mode does, from the same bytes, so the output is exact
mode's bit for bit (a store record's leading `slot_bytes` are gate|up|down trellis at
`part_off`, the VRAM slot layout, glm53.store.format).

No RAM slot is evicted while the device may read it: the tier never evicts a slot of the wave
it is filling (this layer's picks), and the eviction itself happens after the host synced on
this layer's router output, which on exllamav3's one stream comes after every earlier layer's
slot copies and MoE kernels. Prefill staging (side-stream copies from home, which that order
does not cover) reads each layer ahead into pinned RAM slots instead: glm53.tiers.prefill_ahead
has its design and its eviction contract.

Torch-free and CUDA-free, so CI runs it with the real RamTier, store and O_DIRECT reads; the
device side (glm53.exl3.nvme_device, cuda/ec.cu) passed tests/gpu/test_nvme_exact_gpu.py on an
H200 (2026-12-02).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm53.tiers.ram_tier import RamTier, ReadFault, TierError


class HomeCapError(TierError):
    """The RAM tier cannot hold one MoE layer's working set; says why and the fix."""


@dataclass(slots=True)
class HomeUpdate:
    """Home-table writes for the device (`keys[i]` -> `addresses[i]`) and what one resolve did."""

    keys: np.ndarray  # int64
    addresses: np.ndarray  # int64 UVA addresses, or RamHome.absent
    vram_hits: int = 0  # distinct picks the VRAM cache held (no RAM home needed)
    ram_hits: int = 0
    ram_reads: int = 0  # records read from the store for this layer, in one batch
    bytes_read: int = 0

    @classmethod
    def empty(cls) -> HomeUpdate:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.keys)


def layer_working_set(top_k: int, rows: int, experts_per_layer: int) -> int:
    """Distinct experts one MoE layer may need resident at once: top-k of every row of the
    largest forward (a prefill chunk on the GPU engine), at most the layer's experts."""
    return min(experts_per_layer, top_k * rows)


def check_home_cap(
    cap_bytes: int, record_bytes: int, working_set: int, top_k: int, rows: int
) -> None:
    """HomeCapError when cap_bytes holds fewer records than one layer's working set: exllamav3's
    MoE kernel reads all of a layer's picks in one launch, so the GPU engine cannot run a layer
    in waves as the CPU engine does."""
    need = working_set * record_bytes
    if cap_bytes >= need:
        return
    raise HomeCapError(
        f"--ram-cap {cap_bytes} bytes ({cap_bytes / 2**20:.1f} MiB) holds "
        f"{cap_bytes // record_bytes} expert records of {record_bytes} bytes, but nvme-exact "
        f"on the GPU needs one MoE layer's picks resident at once: {working_set} records "
        f"(top-k {top_k} x {rows} rows of the largest forward, at most the layer's experts), "
        f"{need} bytes ({need / 2**20:.1f} MiB); raise --ram-cap to at least that"
    )


def rows_picking(picks, num_rows: int, expert: int) -> np.ndarray:
    """The rows of a forward (`picks`: its [num_rows, top-k] picks, any shape of that size)
    that picked `expert`: the requests a failed read of that expert must fail."""
    picks = np.asarray(picks).reshape(num_rows, -1)
    return np.flatnonzero((picks == expert).any(axis=1))


def open_home_source(model_dir, store_dir, ram_cap: int | None, rows: int, threads: int = 4):
    """The packed store nvme-exact serves `model_dir` from, opened and checked before anything
    loads: a missing --store, a store of another checkpoint (its fingerprint, with the store's
    own message: glm53.store.errors.StoreMismatchError) and a --ram-cap below one layer's
    working set (`rows`: the most rows one forward routes, the prefill chunk) are refused here
    with a clear error. A --ram-cap of None is planned after the model loads (the caller checks
    it then with check_home_cap). Returns (store, working set in records, top-k)."""
    from glm53.models.checkpoint import Checkpoint
    from glm53.store.reader import ExpertStore

    if not store_dir:
        raise TierError(
            "--mode nvme-exact reads the routed experts from a packed store: pass --store DIR "
            f"(make one with `glm53 store pack --model {model_dir} --out DIR`)"
        )
    ckpt = Checkpoint(model_dir)
    store = ExpertStore(store_dir, ckpt, threads=threads)  # refuses another checkpoint's store
    top_k = int(ckpt.text_config["num_experts_per_tok"])
    working_set = layer_working_set(top_k, rows, store.num_experts)
    if ram_cap is not None:
        try:
            check_home_cap(ram_cap, store.record_bytes, working_set, top_k, rows)
        except HomeCapError:
            store.close()
            raise
    return store, working_set, top_k


class RamHome:
    """The host's half of the device home table: which RAM slot holds each key.

    `arena_address` is the device (UVA) address of the tier's arena (its host address where
    host and device share addresses); `absent` is what a key in no RAM slot maps to. `home_of`
    mirrors what the host has written into the device table; `slot_owner` which key each slot
    held when last written. Owned by the thread that owns the tier (the engine thread)."""

    def __init__(self, tier: RamTier, arena_address: int, absent: int):
        slot_bytes = getattr(getattr(tier.source, "layout", None), "slot_bytes", None)
        if slot_bytes is None:
            raise TierError(
                f"nvme-exact reads experts from a packed store (its records start with the VRAM "
                f"slot's bytes); {tier.source.describe()} is not one: pass --store DIR "
                "(made by `glm53 store pack`)"
            )
        if arena_address % 256 or tier.slot_bytes % 256:
            raise TierError("the RAM tier's records must be 256-byte aligned for the GPU")
        self.tier = tier
        self.slot_bytes = int(slot_bytes)  # the leading trellis part a VRAM slot copies
        self.arena_address = int(arena_address)
        self.absent = int(absent)
        self.home_of = np.full(tier.num_keys, self.absent, dtype=np.int64)
        self.slot_owner = np.full(tier.num_slots, -1, dtype=np.int64)
        self.counters = {"resolves": 0, "vram_hits": 0, "ram_hits": 0, "ram_reads": 0}
        self.counters["bytes_read"] = 0
        self._pending = HomeUpdate.empty()

    def address(self, slot: int) -> int:
        return self.arena_address + int(slot) * self.tier.slot_bytes

    def resolve(self, layer: int, picks, in_vram, read_ahead=()) -> HomeUpdate:
        """Make every pick of MoE `layer` (expert ids, any shape; ids outside the layer are
        masked picks and skipped, as the route kernel skips them) that `in_vram` (bool, same
        shape) does not mark as VRAM-resident resident in the RAM tier, in one read batch, and
        return the home-table writes. A read fault (glm53.tiers.ram_tier.ReadFault, naming the
        layer and expert) propagates after the writes it made necessary (keys the tier evicted
        or took back) are kept for `take_pending`. `read_ahead`: experts of the layer a wave
        (glm53.tiers.prefill_ahead) made resident and still pins, their homes written: counted
        as RAM hits without a second lookup (the wave's admission already counted their access
        once, as one resolve would)."""
        ahead = {int(e) for e in np.asarray(read_ahead).reshape(-1).tolist()}
        picks = np.asarray(picks, dtype=np.int64).reshape(-1)
        in_vram = np.asarray(in_vram, dtype=bool).reshape(-1)
        if picks.shape != in_vram.shape:
            raise ValueError(f"{picks.shape[0]} picks but {in_vram.shape[0]} VRAM flags")
        valid = (picks >= 0) & (picks < self.tier.num_experts)
        _, first = np.unique(picks[valid], return_index=True)
        distinct = picks[valid][np.sort(first)]
        vram = {int(e) for e in picks[valid & in_vram]}
        left = [e for e in distinct.tolist() if e not in vram]
        need = np.array([e for e in left if e not in ahead], dtype=np.int32)
        n_ahead = len(left) - len(need)
        self.counters["resolves"] += 1
        self.counters["vram_hits"] += len(vram)
        self.counters["ram_hits"] += n_ahead
        if len(need) == 0:
            update = self.take_pending()
            update.vram_hits, update.ram_hits = len(vram), n_ahead
            return update
        try:
            wave = self.tier.make_resident(layer, need)
        except TierError:
            self._pending = self._merge(self._pending, self._reconcile())
            raise
        update = self._merge(self.take_pending(), self._admitted(wave.experts, wave.slots, layer))
        if len(wave.experts) < len(need):  # a cap below the working set (refused at start)
            missing = [int(e) for e in need if int(e) not in set(wave.experts.tolist())]
            self._pending = update
            raise HomeCapError(
                f"the RAM tier ({self.tier.num_slots} slots) could not hold layer {layer}'s "
                f"{len(need)} picks at once ({len(missing)} left out, expert {missing[0]} "
                "first); raise --ram-cap"
            )
        update.vram_hits, update.ram_hits = len(vram), wave.num_hits + n_ahead
        update.ram_reads, update.bytes_read = wave.num_admitted, wave.bytes_read
        for name, n in (("ram_hits", wave.num_hits), ("ram_reads", wave.num_admitted)):
            self.counters[name] += n
        self.counters["bytes_read"] += wave.bytes_read
        return update

    def sync_all(self) -> HomeUpdate:
        """Every write that brings the table in line with the tier (after a warm start, or
        anything else that changed the tier outside resolve), pending ones included."""
        return self._merge(self.take_pending(), self._reconcile())

    def take_pending(self) -> HomeUpdate:
        update, self._pending = self._pending, HomeUpdate.empty()
        return update

    def defer(self, update: HomeUpdate) -> None:
        """Writes for the next take_pending (after those already pending)."""
        self._pending = self._merge(self._pending, update)

    def defer_reconcile(self) -> None:
        """After the tier changed outside resolve (a wave read ahead failed): the writes that
        bring the table in line with it, for the next take_pending."""
        self.defer(self._reconcile())

    def begin(self, layer: int, experts: np.ndarray):
        """A wave read ahead (prefill staging's, decode prefetch's) begun on this home's tier
        (RamTier.begin_resident, `layer` the model's layer): the keys whose slots its misses
        took go `absent` now (pending writes, written by the caller before the device runs on),
        so that no table entry points at a slot being read into; the misses get their homes
        when the wave is collected, once their bytes are there. A read fault (a hit whose read
        is stuck) is raised again once the writes it made necessary are deferred: the misses it
        had admitted were taken back and their victims are gone (defer_reconcile)."""
        try:
            wave = self.tier.begin_resident(layer, experts)
        except ReadFault:
            self.defer_reconcile()
            raise
        keys = []
        for slot in wave.slots[wave.num_hits :].tolist():
            old = int(self.slot_owner[slot])
            if old >= 0 and self.home_of[old] == self.address(slot):
                self.home_of[old] = self.absent
                keys.append(old)
            self.slot_owner[slot] = -1
        if keys:
            addrs = np.full(len(keys), self.absent, np.int64)
            self.defer(HomeUpdate(np.array(keys, np.int64), addrs))
        return wave

    def collect(self, wave):
        """A wave read ahead (prefill staging's, decode prefetch's) collected from this home's
        tier: its store reads counted in this home's totals (ahead or not: the bench's bytes a
        token) and the FinishedWave returned. A read fault is raised again once the writes it
        made necessary are deferred (defer_reconcile); the caller counts and logs it."""
        try:
            done = self.tier.finish_resident(wave)
        except ReadFault:
            self.defer_reconcile()
            raise
        self.counters["ram_reads"] += done.num_admitted
        self.counters["bytes_read"] += done.bytes_read
        return done

    def admitted(self, experts: np.ndarray, slots: np.ndarray, layer: int) -> HomeUpdate:
        """The writes for a wave made resident outside resolve (glm53.tiers.prefill_ahead)."""
        return self._admitted(experts, slots, layer)

    def expected(self) -> np.ndarray:
        """What the home table must hold for the tier as it is now: each key's slot address
        when CLOCK holds it (and its read did not time out), else `absent`."""
        want = np.full(self.tier.num_keys, self.absent, dtype=np.int64)
        stuck = self.tier.stuck_keys()
        for slot in range(self.tier.num_slots):
            key = self.tier.clock.key_of(slot)
            if key >= 0 and key not in stuck:
                want[key] = self.address(slot)
        return want

    def _admitted(self, experts: np.ndarray, slots: np.ndarray, layer: int) -> HomeUpdate:
        """Writes for a wave: each wave key at its slot (hits too: cheap, and idempotent), and
        absent for each key whose slot a miss took."""
        base = self.tier.moe_index[layer] * self.tier.num_experts
        keys_out, addrs_out = [], []
        for expert, slot in zip(experts.tolist(), slots.tolist(), strict=True):
            key, addr = base + expert, self.address(slot)
            old = int(self.slot_owner[slot])
            if old >= 0 and old != key and self.home_of[old] == self.address(slot):
                keys_out.append(old)
                addrs_out.append(self.absent)
                self.home_of[old] = self.absent
            self.slot_owner[slot] = key
            if self.home_of[key] != addr:
                keys_out.append(key)
                addrs_out.append(addr)
                self.home_of[key] = addr
        return HomeUpdate(np.array(keys_out, np.int64), np.array(addrs_out, np.int64))

    def _reconcile(self) -> HomeUpdate:
        """The writes that make home_of equal expected() (a fault left the tier in a state
        resolve did not see: misses taken back, slots pinned for reads that timed out)."""
        want = self.expected()
        changed = np.flatnonzero(want != self.home_of)
        self.home_of[changed] = want[changed]
        self.slot_owner.fill(-1)
        present = np.flatnonzero(want != self.absent)
        self.slot_owner[(want[present] - self.arena_address) // self.tier.slot_bytes] = present
        return HomeUpdate(changed.astype(np.int64), want[changed].copy())

    @staticmethod
    def _merge(a: HomeUpdate, b: HomeUpdate) -> HomeUpdate:
        """a then b, the later write of a key winning (the device applies them as a scatter,
        which does not order duplicates)."""
        if len(a) == 0:
            return b
        if len(b) == 0:
            return a
        keys = np.concatenate([a.keys, b.keys])
        addrs = np.concatenate([a.addresses, b.addresses])
        _, last = np.unique(keys[::-1], return_index=True)
        keep = np.sort(len(keys) - 1 - last)
        return HomeUpdate(keys[keep], addrs[keep])


def check_home_table(home: RamHome, device_table: np.ndarray, result) -> None:
    """Add table faults to a glm53.tiers.check.TierCheck: every key whose home in the host's
    mirror or in `device_table` (a host copy of the device's home table) differs from where the
    RAM tier holds it. A wrong entry there would send a VRAM admission or a zero-copy read to
    another expert's bytes, so each is reported by layer and expert."""
    from glm53.tiers.check import BadRecord

    want = home.expected()
    experts, layers = home.tier.num_experts, home.tier.source.moe_layers
    device_table = np.asarray(device_table, dtype=np.int64)
    if device_table.shape != want.shape:
        raise ValueError(f"the device home table has {device_table.shape[0]} keys, not {len(want)}")
    result.table_checked += len(want)

    def where(addr: int) -> str:
        if addr == home.absent:
            return "absent"
        return f"RAM slot {(addr - home.arena_address) / home.tier.slot_bytes:g}"

    for name, table in (("host mirror", home.home_of), ("device table", device_table)):
        for key in np.flatnonzero(table != want).tolist():
            slot = -1 if want[key] == home.absent else home.tier.clock.slot_of(key)
            result.table_bad += 1
            result.bad.append(
                BadRecord(
                    "table",
                    layers[key // experts],
                    key % experts,
                    slot,
                    f"the home {name} says {where(int(table[key]))}, the RAM tier holds it "
                    f"{where(int(want[key]))}",
                )
            )


def verify_home(home: RamHome, num_samples: int, device_table, vram=None, seed=None):
    """The tier check of nvme-exact (GET /admin/verify and the check at start): the RAM tier's
    tables and sampled records against fresh store reads and the manifest, sampled VRAM slots
    (`vram`, a glm53.tiers.check.VramRecords) the same way, and every home-table entry (host
    mirror and `device_table`) against where the tier holds its key (check_home_table)."""
    from glm53.tiers.check import check_tiers

    result = check_tiers(home.tier, num_samples, vram=vram, seed=seed)
    check_home_table(home, device_table, result)
    return result
