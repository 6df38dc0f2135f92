"""Fill record buffers from the checkpoint: each tensor is read by its safetensors offset
straight into its field of the record (preadv scatter; adjacent tensors in one call), so no
shard is ever loaded whole. Safe to call from several threads at once (positioned reads on
shared descriptors); preadv releases the GIL.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from glm53.store.errors import StoreError
from glm53.store.format import PROJECTIONS
from glm53.store.plan import FETCH_HINT, StorePlan


class SourceReader:
    def __init__(self, plan: StorePlan):
        self.plan = plan
        self.offsets = {f.name: f.offset for f in plan.layout.fields}
        paths = sorted(
            {
                info.path
                for layer in plan.experts
                for e in layer
                for lin in e.linears
                for info in (lin.trellis, lin.suh, lin.svh, lin.marker)
                if info is not None
            }
        )
        self.fds: dict[Path, int] = {}
        try:
            for path in paths:
                self.fds[path] = os.open(path, os.O_RDONLY)
        except OSError as exc:
            self.close()
            raise StoreError(f"cannot open shard {exc.filename}: {exc.strerror}") from None

    def fill(self, record: int, buf: np.ndarray) -> None:
        """Write the record's fields into buf (record_bytes, its gaps already zero)."""
        expert = self.plan.expert(record)
        items = []  # (path, file offset, nbytes, destination view, marker key or None)
        markers = []
        for proj, lin in zip(PROJECTIONS, expert.linears, strict=True):
            for part, info in (("trellis", lin.trellis), ("suh", lin.suh), ("svh", lin.svh)):
                start = self.offsets[f"{proj}.{part}"]
                items.append((info, memoryview(buf[start : start + info.nbytes])))
            if lin.marker is not None:
                scratch = np.zeros(1, dtype="<i4")
                markers.append((lin.marker.key, scratch))
                items.append((lin.marker, memoryview(scratch.view(np.uint8))))
        items.sort(key=lambda item: (item[0].path, item[0].offset_bytes))
        run: list = []
        for item in items:
            if run and (
                item[0].path != run[-1][0].path
                or item[0].offset_bytes != run[-1][0].offset_bytes + run[-1][0].nbytes
            ):
                self._read_run(run)
                run = []
            run.append(item)
        self._read_run(run)
        want = self.plan.codebook_marker
        for key, value in markers:
            if int(value[0]) != want:
                raise StoreError(
                    f"{key} holds codebook marker {int(value[0]) & 0xFFFFFFFF:#010x}, the first "
                    f"routed expert {want & 0xFFFFFFFF:#010x}; a store holds one codebook: the "
                    f"checkpoint is inconsistent ({FETCH_HINT} again)"
                )

    def _read_run(self, run: list) -> None:
        first = run[0][0]
        views = [view for _, view in run]
        want = sum(info.nbytes for info, _ in run)
        got = os.preadv(self.fds[first.path], views, first.offset_bytes)
        if got != want:
            size = os.fstat(self.fds[first.path]).st_size
            raise StoreError(
                f"shard {first.path} ends at byte {size}, but tensor {first.key} and its "
                f"neighbours need bytes [{first.offset_bytes}, {first.offset_bytes + want}): "
                f"the shard is truncated; {FETCH_HINT} again"
            )

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
