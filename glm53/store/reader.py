"""Open a packed store for serving and read expert records with O_DIRECT.

`ExpertStore` refuses a store packed from another checkpoint than the one it is served with
(StoreMismatchError), a truncated data file, and a filesystem without O_DIRECT. It reads whole
records (one aligned read each) into caller buffers and gives views of their arrays. It also
has the expert-source interface of `glm53.tiers.expert_source.SafetensorsSource` (moe_layers,
num_experts, layouts, record_bytes, read, record_sha256, describe, close), so a RAM tier can be filled from it.
Owned by one thread (the O_DIRECT reader is).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm53._odirect import ODirectError, Reader, probe
from glm53.models.checkpoint import Checkpoint
from glm53.store.direct_io import (
    BounceBuffer,
    ExpertReadError,
    ExpertReadTimeout,
    RunFailed,
    RunTimedOut,
    Submitted,
    file_problem,
    submit_coalesced,
    wait_coalesced,
    with_others,
)
from glm53.store.errors import EXIT_CHECK_FAILED, StoreError, reason
from glm53.store.format import PROJECTIONS, Field, RecordLayout, layout_of, read_manifest
from glm53.store.plan import check_matches, plan_store

_NUMPY = {"I16": np.int16, "F16": np.float16}


@dataclass(frozen=True, slots=True)
class StoreRecordLayout:
    """The expert-source layout of a store record: (gate, up, down) x (trellis, suh, svh) as
    (offset in the record, Field); a Field has nbytes, dtype and shape like a TensorInfo."""

    record_bytes: int
    arrays: tuple[tuple[tuple[int, Field], ...], ...]


class ExpertStore:
    def __init__(
        self,
        store_dir: str | Path,
        model: Checkpoint | str | Path | None = None,
        *,
        threads: int = 4,
    ):
        """model: the checkpoint the store is served with; its fingerprint must match the
        store's. None skips that check (tools that only read the store)."""
        self.store_dir = Path(store_dir)
        self.manifest = m = read_manifest(self.store_dir)
        if model is not None:
            directory = model.directory if isinstance(model, Checkpoint) else Path(model)
            has_mtp = any(layer.is_mtp for layer in m.layers)
            check_matches(m, self.store_dir, plan_store(directory, include_mtp=has_mtp))
        self.data_path = self.store_dir / m.data_file
        size = self.data_path.stat().st_size if self.data_path.is_file() else -1
        if size < m.total_bytes:
            raise StoreError(
                f"{self.data_path} has {max(size, 0)} bytes, the manifest {m.total_bytes}: the "
                f"store is truncated; check it with `glm53 store verify --store {self.store_dir}`"
                " and repair it with `glm53 store pack ... --resume`",
                EXIT_CHECK_FAILED,
            )
        try:
            probe(self.data_path)
            self.reader = Reader(self.data_path, threads=threads)
            self.opened = self.data_path.stat()
        except ODirectError as exc:
            raise StoreError(f"store {self.store_dir}: {reason(exc)}") from None
        self.layout: RecordLayout = layout_of(m)
        self.record_bytes = m.record_bytes
        self.num_experts = m.experts_per_layer
        self.moe_layers = [layer.model_layer for layer in m.layers if not layer.is_mtp]
        self._store_layer = {layer.model_layer: layer.store_layer for layer in m.layers}
        fields = {f.name: f for f in m.fields}
        arrays = tuple(
            tuple(
                (fields[f"{p}.{part}"].offset, fields[f"{p}.{part}"])
                for part in ("trellis", "suh", "svh")
            )
            for p in PROJECTIONS
        )
        shared = StoreRecordLayout(m.record_bytes, arrays)
        self.layouts = {
            (layer, e): shared for layer in self._store_layer for e in range(self.num_experts)
        }
        self.expert_bytes = sum(f.nbytes for f in m.fields)
        self._bounce = BounceBuffer()
        self._tags = itertools.count()

    def describe(self) -> str:
        return f"expert store {self.store_dir} ({self.manifest.num_records} records, O_DIRECT)"

    def record_index(self, model_layer: int, expert: int) -> int:
        if model_layer not in self._store_layer or not 0 <= expert < self.num_experts:
            raise KeyError(
                f"the store has no expert {expert} of model layer {model_layer} (layers "
                f"{sorted(self._store_layer)}, {self.num_experts} experts each)"
            )
        return self._store_layer[model_layer] * self.num_experts + expert

    def offset(self, model_layer: int, expert: int) -> int:
        return self.record_index(model_layer, expert) * self.record_bytes

    def record_sha256(self, model_layer: int, expert: int) -> str:
        """The manifest's sha256 (hex) of one record, as packed."""
        return self.manifest.sha256[self.record_index(model_layer, expert)]

    def read(
        self, requests: list[tuple[int, int, np.ndarray]], timeout: float | None = None
    ) -> int:
        """Read records into 4 KiB-aligned buffers of at least record_bytes: (model layer,
        expert, buffer) triples. Records next to each other in the data file are read as one
        request (direct_io.read_coalesced). Blocks until all are read; raises the first
        error, or ExpertReadTimeout when they take longer than `timeout` s. Returns the bytes
        read."""
        return self.collect(self._submit(requests, self._bounce), timeout)

    def submit(self, requests: list[tuple[int, int, np.ndarray]]) -> Submitted:
        """`read`'s requests queued on the reader's threads, returned at once (its own bounce
        buffer, so several batches may be out); `collect` waits for them, with read's errors.
        Submit and collect on the store's owner thread; the buffers are the caller's to keep
        out of use until collected."""
        return self._submit(requests, BounceBuffer())

    def _submit(self, requests, bounce: BounceBuffer) -> Submitted:
        pieces = [
            (self.offset(layer, expert), self.record_bytes, buf[: self.record_bytes])
            for layer, expert, buf in requests
        ]
        return submit_coalesced({0: self.reader}, {0: pieces}, bounce, self._tags)

    def collect(self, batch: Submitted, timeout: float | None = None) -> int:
        """Wait for a submitted batch (read's errors: ExpertReadError naming the expert of the
        first failed read, ExpertReadTimeout past `timeout` s); the bytes read."""
        try:
            return wait_coalesced(batch, timeout)
        except RunTimedOut as exc:
            covered = []
            for _, offset, length in exc.runs:
                first, end = offset // self.record_bytes, -(-(offset + length) // self.record_bytes)
                for record in range(first, end):
                    layer, expert = self.manifest.locate(record)
                    covered.append((layer.model_layer, expert))
            layer, expert = covered[0]
            raise ExpertReadTimeout(
                f"reading layer {layer} expert {expert}{with_others(len(covered) - 1)} from the "
                f"store {self.data_path}: no answer within {exc.timeout:g} s (the disk or mount "
                "under it stopped answering)",
                covered,
                exc.stuck,
            ) from None
        except RunFailed as exc:
            layer, expert = self.manifest.locate(exc.offset // self.record_bytes)
            problem = self.problem()
            raise ExpertReadError(
                exc.errno,
                f"reading layer {layer.model_layer} expert {expert} from the store failed at "
                f"offset {exc.offset} of {self.data_path}: {exc.strerror}"
                + (f" ({problem})" if problem else ""),
                layer.model_layer,
                expert,
            ) from None

    def problem(self) -> str:
        """What happened to the data file since it was opened (file_problem), or ""."""
        return file_problem(self.data_path, self.opened, self.manifest.total_bytes)

    def views(self, record: np.ndarray) -> dict[str, np.ndarray]:
        """Field name (e.g. "up.suh") -> typed view into a record buffer."""
        out = {}
        for f in self.layout.fields:
            raw = record[f.offset : f.offset + f.nbytes]
            out[f.name] = raw.view(_NUMPY[f.dtype]).reshape(f.shape)
        return out

    def slot_bytes_of(self, record: np.ndarray) -> np.ndarray:
        """The leading trellis part of a record: the bytes of one VRAM cache slot."""
        return record[: self.layout.slot_bytes]

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
