"""`glm53 store compare`: byte-compare sampled records against fresh reads of the checkpoint.

The sample is N random records plus the first and last record of every layer. Each record is
read from the store with O_DIRECT; each field is compared with the tensor read from its shard
by offset (numpy, a code path independent of pack's scatter reads), every byte outside the
fields must be zero, and each expert's codebook marker must equal the manifest's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm53._odirect import ODirectError, Reader, aligned_empty
from glm53.store.errors import EXIT_CHECK_FAILED, StoreError, reason
from glm53.store.format import PROJECTIONS, Manifest, layout_of, read_manifest
from glm53.store.plan import StorePlan, check_matches, plan_store

BATCH_RECORDS = 8


@dataclass(slots=True)
class Mismatch:
    record: int
    model_layer: int
    expert: int
    field: str
    detail: str

    def line(self) -> str:
        return (
            f"layer {self.model_layer}, expert {self.expert} (record {self.record}): "
            f"{self.field} {self.detail}"
        )


@dataclass(slots=True)
class CompareResult:
    store_dir: Path
    records: list[int]
    bytes_compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def sample_records(manifest: Manifest, sample: int, seed: int | None) -> list[int]:
    """`sample` distinct random records plus the first and last of every layer, sorted."""
    n, per = manifest.num_records, manifest.experts_per_layer
    chosen = {
        r for layer in range(manifest.num_layers) for r in (layer * per, layer * per + per - 1)
    }
    rng = random.Random(seed)
    chosen.update(rng.sample(range(n), min(max(sample, 0), n)))
    return sorted(chosen)


def compare(
    store_dir: str | Path,
    model_dir: str | Path,
    *,
    sample: int = 200,
    seed: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CompareResult:
    store = Path(store_dir)
    manifest = read_manifest(store)
    has_mtp = any(layer.is_mtp for layer in manifest.layers)
    plan = plan_store(model_dir, include_mtp=has_mtp)
    check_matches(manifest, store, plan)
    data = store / manifest.data_file
    if not data.is_file():
        raise StoreError(f"{data} is missing; repack the store", EXIT_CHECK_FAILED)
    records = sample_records(manifest, sample, seed)
    result = CompareResult(store, records)
    rb = manifest.record_bytes
    buffers = [aligned_empty(rb) for _ in range(min(BATCH_RECORDS, len(records)))]
    try:
        reader = Reader(data, threads=4)
    except ODirectError as exc:
        raise StoreError(f"cannot read {data} with O_DIRECT: {reason(exc)}") from None
    with reader:
        for first in range(0, len(records), BATCH_RECORDS):
            batch = records[first : first + BATCH_RECORDS]
            reader.submit_many((r * rb, rb, buffers[i], r) for i, r in enumerate(batch))
            for i, c in enumerate(reader.wait(batch)):
                if c.ok:
                    result.mismatches += _compare_record(manifest, plan, c.tag, buffers[i])
                    result.bytes_compared += rb
                else:
                    result.mismatches.append(_mismatch(manifest, c.tag, "record", f"{c.error}"))
            if progress:
                progress(first + len(batch), len(records))
    return result


def _mismatch(manifest: Manifest, record: int, name: str, detail: str) -> Mismatch:
    layer, expert = manifest.locate(record)
    return Mismatch(record, layer.model_layer, expert, name, detail)


def _compare_record(manifest: Manifest, plan: StorePlan, record: int, buf) -> list[Mismatch]:
    ckpt = plan.checkpoint
    expert = plan.expert(record)
    layout = layout_of(manifest)
    out = []
    for proj, lin in zip(PROJECTIONS, expert.linears, strict=True):
        for part, info in (("trellis", lin.trellis), ("suh", lin.suh), ("svh", lin.svh)):
            f = layout.field(f"{proj}.{part}")
            want = np.ascontiguousarray(ckpt.read(info.key)).view(np.uint8).reshape(-1)
            got = buf[f.offset : f.offset + f.nbytes]
            if want.size != f.nbytes:
                out.append(_mismatch(manifest, record, f.name, f"source has {want.size} bytes"))
            elif not np.array_equal(got, want):
                at = int(np.flatnonzero(got != want)[0])
                out.append(
                    _mismatch(
                        manifest,
                        record,
                        f.name,
                        f"differs from {info.key} from byte {at} of the field "
                        f"(record byte {f.offset + at})",
                    )
                )
        if lin.marker is not None:
            value = int(np.asarray(ckpt.read(lin.marker.key)).reshape(-1)[0])
            if value != manifest.codebook_marker:
                out.append(
                    _mismatch(
                        manifest,
                        record,
                        f"{proj}.codebook",
                        f"{lin.marker.key} is {value}, the manifest says "
                        f"{manifest.codebook_marker}",
                    )
                )
    for start, end in layout.gaps():
        nonzero = np.flatnonzero(buf[start:end])
        if nonzero.size:
            out.append(
                _mismatch(
                    manifest, record, "padding", f"byte {start + int(nonzero[0])} is not zero"
                )
            )
    return out
