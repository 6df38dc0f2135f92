"""Where each routed expert's bytes live on disk, and reading them with O_DIRECT.

Source: the checkpoint's safetensors shards, by offset (a packed store, when one exists, is
another source with the same interface). O_DIRECT moves whole 4 KiB blocks between aligned
memory and aligned file offsets, so an expert is read as the aligned span that covers its
tensors, and its tensors are views at their offsets inside that span. A span that runs past
the end of its file is read up to the last whole block with O_DIRECT and the rest (< 4 KiB)
with a plain pread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm53 import _odirect
from glm53.models.checkpoint import Checkpoint, ExpertTensors, TensorInfo

ALIGN = 4096


def _round_down(x: int) -> int:
    return x - x % ALIGN


def _round_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Span:
    """One aligned read: `length` bytes of `path` at `offset` into the record at `record_offset`."""

    path: Path
    offset: int
    length: int
    record_offset: int


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How one expert's record is read and where its 9 arrays sit in it (byte offsets)."""

    spans: tuple[Span, ...]
    record_bytes: int
    # (gate, up, down) x (trellis, suh, svh): (offset in the record, TensorInfo)
    arrays: tuple[tuple[tuple[int, TensorInfo], ...], ...]


def expert_layout(expert: ExpertTensors) -> ExpertLayout:
    """Group the expert's tensors by file; each file's tensors are read as one aligned span."""
    by_file: dict[Path, list[TensorInfo]] = {}
    infos = [(lin.trellis, lin.suh, lin.svh) for lin in expert.linears]
    for info in (i for triple in infos for i in triple):
        by_file.setdefault(info.path, []).append(info)
    spans, where, cursor = [], {}, 0
    for path, tensors in sorted(by_file.items()):
        start = _round_down(min(t.offset_bytes for t in tensors))
        end = _round_up(max(t.offset_bytes + t.nbytes for t in tensors))
        spans.append(Span(path, start, end - start, cursor))
        for t in tensors:
            where[t.key] = cursor + t.offset_bytes - start
        cursor += end - start
    arrays = tuple(tuple((where[i.key], i) for i in triple) for triple in infos)
    return ExpertLayout(tuple(spans), cursor, arrays)


def record_views(record: np.ndarray, layout: ExpertLayout) -> tuple[tuple[np.ndarray, ...], ...]:
    """(gate, up, down) x (trellis int16, suh fp16, svh fp16) views into a record buffer."""
    dtypes = {"I16": np.int16, "F16": np.float16}
    out = []
    for triple in layout.arrays:
        views = []
        for offset, info in triple:
            raw = record[offset : offset + info.nbytes]
            views.append(raw.view(dtypes[info.dtype]).reshape(info.shape))
        out.append(tuple(views))
    return tuple(out)


class SafetensorsSource:
    """Routed experts of a checkpoint, read straight from its shards with O_DIRECT."""

    def __init__(self, ckpt: Checkpoint, threads: int = 2):
        self.ckpt = ckpt
        self.moe_layers = ckpt.moe_layers
        self.num_experts = int(ckpt.text_config["n_routed_experts"])
        self.layouts: dict[tuple[int, int], ExpertLayout] = {}
        for layer in self.moe_layers:
            for expert in ckpt.experts(layer):
                self.layouts[(layer, expert.expert)] = expert_layout(expert)
        self.record_bytes = max(lay.record_bytes for lay in self.layouts.values())
        self.expert_bytes = max(
            sum(i.nbytes for triple in lay.arrays for _, i in triple)
            for lay in self.layouts.values()
        )
        paths = sorted({s.path for lay in self.layouts.values() for s in lay.spans})
        self.file_bytes = {p: p.stat().st_size for p in paths}
        self.readers = {p: _odirect.Reader(p, threads=threads) for p in paths}
        self._serial = 0

    def describe(self) -> str:
        return f"safetensors shards of {self.ckpt.directory} (O_DIRECT)"

    def read(self, requests: list[tuple[int, int, np.ndarray]]) -> int:
        """Read experts into record buffers: (layer, expert, buffer) triples. Returns the bytes read
        from disk. Blocks until every read finished; raises the first read error."""
        tags_by_reader: dict[Path, list[int]] = {}
        total = 0
        for layer, expert, buf in requests:
            for span in self.layouts[(layer, expert)].spans:
                total += span.length
                direct = min(span.length, _round_down(self.file_bytes[span.path]) - span.offset)
                if direct > 0:
                    self._serial += 1
                    view = buf[span.record_offset : span.record_offset + direct]
                    self.readers[span.path].submit(span.offset, direct, view, self._serial)
                    tags_by_reader.setdefault(span.path, []).append(self._serial)
                if direct < span.length:
                    self._read_tail(span, max(direct, 0), buf)
        for path, tags in tags_by_reader.items():
            for completion in self.readers[path].wait(tags):
                completion.check()
        return total

    def _read_tail(self, span: Span, done: int, buf: np.ndarray) -> None:
        """The last partial block of a file, which O_DIRECT cannot read."""
        fd = os.open(span.path, os.O_RDONLY)
        try:
            want = self.file_bytes[span.path] - (span.offset + done)
            data = os.pread(fd, want, span.offset + done)
        finally:
            os.close(fd)
        start = span.record_offset + done
        buf[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
