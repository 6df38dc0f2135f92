"""The tier check: are the expert records the tiers serve the ones the store holds?

Run at start (a non-zero count refuses to serve) and on demand (GET /admin/verify). Three
counts, each with the layer and expert of every bad record:

- `ram_bad`: sampled RAM-tier records whose bytes differ from a fresh O_DIRECT read of the
  same record, or whose sha256 (or the fresh read's) differs from the store manifest's. Where
  fewer records are resident than sampled (at start the tier is empty), the sample is topped
  up with records not in RAM: their fresh reads are checked against the manifest, which is
  what the tier would load next. Each bad record says which copy is wrong (RAM, store, both).
- `vram_bad`: the same for sampled VRAM-cache slots (the GPU engine passes its cache as a
  `VramRecords`; the CPU engine has none). A slot holds the leading `slot_bytes` of a record.
- `table_bad`: inconsistencies of the RAM tier's tables: a CLOCK slot and key that do not
  point at each other, or a CPU-lane table entry whose arrays are not at its slot's record.

sha256 is hashlib's (OpenSSL), not the store's own x16 hasher, so the check does not share
code with what packed the store. Records are read in batches of READ_BATCH, so the check
holds at most that many extra records in memory (75 MB at the full model's 9.4 MB).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import msgspec
import numpy as np

from glm53 import _odirect

READ_BATCH = 8


class BadRecord(msgspec.Struct, frozen=True):
    """One record that failed the check: `tier` is ram, vram or table; `slot` is its slot in
    that tier (-1 for a record not resident)."""

    tier: str
    layer: int
    expert: int
    slot: int
    problem: str


class TierCheck(msgspec.Struct):
    ram_bad: int = 0
    vram_bad: int = 0
    table_bad: int = 0
    ram_checked: int = 0  # records: resident ones plus the store-only top-up
    ram_resident_checked: int = 0
    vram_checked: int = 0
    table_checked: int = 0  # slots
    has_manifest: bool = False  # whether sha256 was compared (a store has a manifest)
    bad: list[BadRecord] = msgspec.field(default_factory=list)

    @property
    def is_ok(self) -> bool:
        return self.ram_bad == self.vram_bad == self.table_bad == 0

    def summary(self) -> str:
        """One line: the counts, what was checked, and the first bad records."""
        what = "sha256 against the manifest and bytes" if self.has_manifest else "bytes"
        line = (
            f"ram_bad={self.ram_bad} vram_bad={self.vram_bad} table_bad={self.table_bad} "
            f"({self.ram_checked} RAM-tier records, {self.ram_resident_checked} of them "
            f"resident, {self.vram_checked} VRAM slots and {self.table_checked} table slots "
            f"checked; {what} against fresh store reads)"
        )
        if self.bad:
            shown = "; ".join(
                f"{b.tier} layer {b.layer} expert {b.expert}: {b.problem}" for b in self.bad[:4]
            )
            more = f"; and {len(self.bad) - 4} more" if len(self.bad) > 4 else ""
            line += f": {shown}{more}"
        return line

    def counts(self) -> dict[str, int]:
        return {"ram_bad": self.ram_bad, "vram_bad": self.vram_bad, "table_bad": self.table_bad}


class VramRecords(Protocol):
    """What the check needs from a VRAM expert cache (the GPU engine's seam): its resident
    (layer, expert, slot) triples and a host copy of one slot's `slot_bytes` bytes."""

    slot_bytes: int

    def resident(self) -> list[tuple[int, int, int]]: ...

    def slot_copy(self, slot: int) -> np.ndarray: ...


def _sha256(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


def _fresh(source, records: list[tuple[int, int]], record_bytes: int):
    """Yield ((layer, expert), fresh copy or None, why the read failed) for each record, read
    READ_BATCH at a time; a batch whose read fails is read again one record at a time, so a
    failed read names its own record."""
    buf = _odirect.aligned_empty(READ_BATCH * record_bytes)
    for start in range(0, len(records), READ_BATCH):
        batch = records[start : start + READ_BATCH]
        views = [buf[i * record_bytes : (i + 1) * record_bytes] for i in range(len(batch))]
        try:
            source.read(
                [(layer, expert, v) for (layer, expert), v in zip(batch, views, strict=True)]
            )
        except OSError:
            for record, view in zip(batch, views, strict=True):
                try:
                    source.read([(*record, view)])
                except OSError as exc:
                    yield record, None, exc.strerror or str(exc)
                else:
                    yield record, view, ""
            continue
        for record, view in zip(batch, views, strict=True):
            yield record, view, ""


def _problem(copy_ok: bool, store_ok: bool, copy: str) -> str:
    if not store_ok and not copy_ok:
        return f"the {copy} copy and the store record both differ from the manifest's sha256"
    if not store_ok:
        return (
            f"the store record's sha256 no longer matches the manifest (the {copy} copy "
            "still does): the store file changed"
        )
    return f"the {copy} copy differs from the store record (which matches the manifest)"


def check_ram(tier, num_samples: int, rng: np.random.Generator, result: TierCheck) -> None:
    """Sample up to num_samples RAM-tier records (resident first) into `result`."""
    source, experts = tier.source, tier.num_experts
    moe_layers = source.moe_layers
    used = [s for s in range(tier.num_slots) if tier.clock.key_of(s) >= 0]
    picked = rng.permutation(len(used))[:num_samples]
    resident = {}
    for i in picked:
        key = tier.clock.key_of(used[i])
        resident[(moe_layers[key // experts], key % experts)] = used[i]
    records = list(resident)
    result.has_manifest = source.record_sha256(moe_layers[0], 0) is not None
    if len(records) < num_samples and result.has_manifest:
        cold = [k for k in range(tier.num_keys) if not tier.clock.contains(k)]
        for k in rng.permutation(cold)[: num_samples - len(records)]:
            records.append((moe_layers[int(k) // experts], int(k) % experts))
    for (layer, expert), fresh, failed in _fresh(source, records, tier.slot_bytes):
        want = source.record_sha256(layer, expert)
        slot = resident.get((layer, expert), -1)
        result.ram_checked += 1
        if fresh is None:
            result.ram_bad += 1
            result.bad.append(
                BadRecord("ram", layer, expert, slot, f"the store read failed: {failed}")
            )
            continue
        store_ok = want is None or _sha256(fresh) == want
        copy_ok = True
        if slot >= 0:
            ram = tier.record(slot)
            if want is None:  # shards: only the arrays' bytes are defined in a record
                layout = source.layouts[(layer, expert)]
                copy_ok = all(
                    np.array_equal(ram[o : o + info.nbytes], fresh[o : o + info.nbytes])
                    for triple in layout.arrays
                    for o, info in triple
                )
            else:  # the manifest says which copy is wrong; bytes back it where both match it
                copy_ok = _sha256(ram) == want and (not store_ok or np.array_equal(ram, fresh))
            result.ram_resident_checked += 1
        if not (copy_ok and store_ok):
            problem = (
                _problem(copy_ok, store_ok, "RAM")
                if want is not None
                else "the RAM copy differs from a fresh read of the record"
            )
            result.ram_bad += 1
            result.bad.append(BadRecord("ram", layer, expert, slot, problem))


def check_vram(
    cache: VramRecords, source, num_samples: int, rng: np.random.Generator, result: TierCheck
) -> None:
    """Sample up to num_samples VRAM slots into `result`: each slot's bytes against the
    leading slot_bytes of a fresh store read, whose sha256 is checked against the manifest."""
    resident = cache.resident()
    picked = [resident[i] for i in rng.permutation(len(resident))[:num_samples]]
    slots = {(layer, expert): slot for layer, expert, slot in picked}
    for (layer, expert), fresh, failed in _fresh(source, list(slots), source.record_bytes):
        want, slot = source.record_sha256(layer, expert), slots[(layer, expert)]
        result.vram_checked += 1
        if fresh is None:
            result.vram_bad += 1
            result.bad.append(
                BadRecord("vram", layer, expert, slot, f"the store read failed: {failed}")
            )
            continue
        store_ok = want is None or _sha256(fresh) == want
        copy_ok = bool(np.array_equal(cache.slot_copy(slot), fresh[: cache.slot_bytes]))
        if not (copy_ok and store_ok):
            result.vram_bad += 1
            result.bad.append(
                BadRecord("vram", layer, expert, slot, _problem(copy_ok, store_ok, "VRAM"))
            )


def check_table(tier, result: TierCheck) -> None:
    """Every RAM-tier slot and key: CLOCK's slot -> key -> slot round trip, and the CPU lane's
    table entry of each used slot pointing at that slot's record."""
    clock, experts, layers = tier.clock, tier.num_experts, tier.source.moe_layers
    base = tier.arena.ctypes.data
    seen: dict[int, int] = {}

    def bad(key: int, slot: int, problem: str) -> None:
        layer = layers[key // experts] if 0 <= key < tier.num_keys else -1
        expert = key % experts if 0 <= key < tier.num_keys else -1
        result.table_bad += 1
        result.bad.append(BadRecord("table", layer, expert, slot, problem))

    for slot in range(tier.num_slots):
        key = clock.key_of(slot)
        result.table_checked += 1
        if key < 0:
            continue
        if not 0 <= key < tier.num_keys:
            bad(key, slot, f"slot {slot} holds key {key}, outside 0..{tier.num_keys - 1}")
            continue
        if clock.slot_of(key) != slot:
            bad(key, slot, f"slot {slot} holds key {key}, whose slot is {clock.slot_of(key)}")
        if key in seen:
            bad(key, slot, f"key {key} is in slots {seen[key]} and {slot}")
        seen[key] = slot
        layout = tier.source.layouts[(layers[key // experts], key % experts)]
        record = base + slot * tier.slot_bytes
        want = tuple(record + offset for triple in layout.arrays for offset, _ in triple)
        if tier.table.addresses(slot) != want:
            bad(key, slot, f"the CPU lane's entry for slot {slot} does not point at its record")
    for key in range(tier.num_keys):
        slot = clock.slot_of(key)
        if slot >= 0 and seen.get(key) != slot:
            bad(key, slot, f"key {key} names slot {slot}, which holds key {clock.key_of(slot)}")


def check_tiers(
    tier,
    num_samples: int,
    *,
    vram: VramRecords | None = None,
    source=None,
    seed: int | None = None,
) -> TierCheck:
    """The whole check: the RAM tier's tables and sampled records (when there is a tier), and
    sampled VRAM slots (when given) against `source` (default: the tier's). Call it on the
    thread that owns the tiers (or under the lock that stands for it)."""
    rng = np.random.default_rng(seed)
    result = TierCheck()
    if tier is not None:
        check_table(tier, result)
        check_ram(tier, num_samples, rng, result)
    if vram is not None:
        check_vram(vram, source if source is not None else tier.source, num_samples, rng, result)
    return result
