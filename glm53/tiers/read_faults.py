"""Read faults in the nvme modes, isolated to the requests that needed the record.

A store read can fail (a disk error, a short read, a read past the timeout or one still out
since it timed out): glm53.tiers.ram_tier raises ReadFault naming the layer and the expert. In a batched
decode step every row is another request, and only the rows whose picks named that expert need
its record. So, in a decode forward of the Generator:

1. `resolve_isolating` resolves the layer's picks through glm53.tiers.gpu_home.RamHome; on a
   ReadFault it records which rows picked the expert, masks every pick of it (id -1: skipped by
   the resolve, and on the device weight 0 / id -1, which exllamav3's decode kernel skips as it
   skips a lane pick) and resolves again, until the rest is resident. The step then completes
   without that expert: a row that did not pick it computes exactly what it would have (its
   picks and their records are unchanged), a row that did gets a wrong token, which no one sees.
2. The routing hook (glm53.exl3.nvme_device) turns each fault into a `FaultRecord` naming the
   job of each row (the Generator's decode rows, read while the forward runs).
3. After the step the engine fails exactly those jobs (`jobs_to_fail`, with `fault_message`:
   the layer, the expert, the cause and `glm53 store verify` as the fix) and drops their tokens
   of that step; every other job goes on.

Prefill forwards and prompt scoring are one request each: a fault there is raised, and the
Generator fails that job alone (exllamav3 reaps a job whose prefill raised); the engine's
scoring fails its own request. Torch-free: CI runs it with the real RAM tier and store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm53.tiers.gpu_home import HomeUpdate, RamHome, rows_picking
from glm53.tiers.ram_tier import ReadFault


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One failed read of a decode step: the model layer, the expert, the rows of the forward
    that picked it, their jobs (the engine's keys; empty where no job map was given) and the
    tier's own message (the cause)."""

    layer: int
    expert: int
    rows: tuple[int, ...]
    keys: tuple = ()
    reason: str = ""


def resolve_isolating(
    home: RamHome, layer: int, picks, in_vram, num_rows: int, read_ahead=()
) -> tuple[HomeUpdate, list[ReadFault], np.ndarray]:
    """RamHome.resolve of MoE `layer`'s picks ([num_rows, top-k] expert ids, any shape of that
    size), failing no row that does not need a faulted record. Returns (every home-table write
    the resolves made, one ReadFault per faulted expert with the rows that picked it, the picks
    with every faulted expert's picks set to -1). A fault whose expert is not among the picks
    (nothing to mask) is raised as it is. `read_ahead`: as RamHome.resolve's (a decode
    prefetch wave's experts, glm53.tiers.decode_prefetch)."""
    picks = np.array(picks, dtype=np.int64).reshape(-1)
    in_vram = np.asarray(in_vram, dtype=bool).reshape(-1)
    update, faults = HomeUpdate.empty(), []
    while True:
        try:
            got = home.resolve(layer, picks, in_vram, read_ahead)
        except ReadFault as exc:
            hit = picks == exc.expert
            if not hit.any():
                raise
            update = RamHome._merge(update, home.take_pending())
            faults.append(exc.picked_by(rows_picking(picks, num_rows, exc.expert), num_rows))
            picks[hit] = -1
            continue
        return RamHome._merge(update, got), faults, picks


def fault_record(fault: ReadFault, row_keys: Sequence | None) -> FaultRecord:
    """A ReadFault with its rows' jobs: `row_keys[r]` is the key of row r's job (None: unknown)."""
    keys: tuple = ()
    if row_keys is not None:
        keys = tuple(dict.fromkeys(row_keys[r] for r in fault.rows if 0 <= r < len(row_keys)))
    return FaultRecord(fault.layer, fault.expert, tuple(fault.rows), keys, str(fault))


def fault_message(record: FaultRecord, store: str | None) -> str:
    """The error a failed job gets: which record, why, and how to check the store."""
    where = f" --store {store}" if store else ""
    return (
        f"reading layer {record.layer} expert {record.expert} from the expert store failed, "
        f"and this request's tokens needed it ({record.reason}); the other requests go on. "
        f"Check the store with `glm53 store verify{where}` and repack it if it reports damage"
    )


def jobs_to_fail(records: Sequence[FaultRecord], store: str | None) -> dict:
    """key -> the error of each job a fault of the step fails (the first fault that named it)."""
    out: dict = {}
    for record in records:
        for key in record.keys:
            out.setdefault(key, fault_message(record, store))
    return out
