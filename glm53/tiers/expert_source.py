"""Where each routed expert's bytes live on disk, and reading them with O_DIRECT.

Source: the checkpoint's safetensors shards, by offset (a packed store, when one exists, is
another source with the same interface: glm53.store.reader.ExpertStore). O_DIRECT moves whole
4 KiB blocks between aligned memory and aligned file offsets, so an expert is read as the
aligned span that covers its tensors, and its tensors are views at their offsets inside that
span. A span that runs past the end of its file is read up to the last whole block with O_DIRECT
and the rest (< 4 KiB) with a plain pread. The spans are read as coalesced runs
(glm53.store.direct_io).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm53 import _odirect
from glm53.models.checkpoint import Checkpoint, ExpertTensors, TensorInfo
from glm53.store.direct_io import (
    BounceBuffer,
    ExpertReadError,
    ExpertReadTimeout,
    RunFailed,
    RunTimedOut,
    align_down,
    align_up,
    file_problem,
    read_coalesced,
    with_others,
)


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
        start = align_down(min(t.offset_bytes for t in tensors))
        end = align_up(max(t.offset_bytes + t.nbytes for t in tensors))
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
        self.opened = {p: p.stat() for p in paths}
        self.file_bytes = {p: st.st_size for p, st in self.opened.items()}
        self.readers = {p: _odirect.Reader(p, threads=threads) for p in paths}
        self._bounce = BounceBuffer()
        self._tags = itertools.count()

    def describe(self) -> str:
        return f"safetensors shards of {self.ckpt.directory} (O_DIRECT)"

    def record_sha256(self, layer: int, expert: int) -> None:
        """The shards carry no per-expert hash (a packed store's manifest does)."""
        return None

    def read(
        self, requests: list[tuple[int, int, np.ndarray]], timeout: float | None = None
    ) -> int:
        """Read experts into record buffers: (layer, expert, buffer) triples. Returns the bytes read
        from disk. Blocks until every read finished; raises the first read error, or
        ExpertReadTimeout when they take longer than `timeout` s."""
        pieces: dict[Path, list[tuple[int, int, np.ndarray]]] = {}
        total = 0
        for layer, expert, buf in requests:
            for span in self.layouts[(layer, expert)].spans:
                direct = min(span.length, align_down(self.file_bytes[span.path]) - span.offset)
                if direct > 0:
                    view = buf[span.record_offset : span.record_offset + direct]
                    pieces.setdefault(span.path, []).append((span.offset, direct, view))
                if direct < span.length:
                    total += self._read_tail(span, max(direct, 0), buf)
        try:
            return total + read_coalesced(self.readers, pieces, self._bounce, self._tags, timeout)
        except RunTimedOut as exc:
            covered = self._experts_in(requests, exc.runs)
            layer, expert = covered[0]
            raise ExpertReadTimeout(
                f"reading layer {layer} expert {expert}{with_others(len(covered) - 1)} from "
                f"{exc.runs[0][0]}: no answer within {exc.timeout:g} s (the disk or mount under "
                "it stopped answering)",
                covered,
                exc.stuck,
            ) from None
        except RunFailed as exc:
            layer, expert = self._experts_in(requests, [(exc.key, exc.offset, 1)])[0]
            problem = file_problem(exc.key, self.opened[exc.key], self.file_bytes[exc.key])
            raise ExpertReadError(
                exc.errno,
                f"reading layer {layer} expert {expert} from {exc.key} failed: {exc.strerror}"
                + (f" ({problem})" if problem else ""),
                layer,
                expert,
            ) from None

    def _experts_in(self, requests, ranges) -> list[tuple[int, int]]:
        """The (layer, expert) pairs of `requests`, in their order, whose bytes overlap one of
        the (path, file offset, length) `ranges`."""
        return [
            (layer, expert)
            for layer, expert, _ in requests
            if any(
                s.path == path and s.offset < offset + length and offset < s.offset + s.length
                for path, offset, length in ranges
                for s in self.layouts[(layer, expert)].spans
            )
        ]

    def problem(self) -> str:
        """What happened to the shards since they were opened (file_problem), or ""."""
        for path, opened in self.opened.items():
            if found := file_problem(path, opened, self.file_bytes[path]):
                return found
        return ""

    def _read_tail(self, span: Span, done: int, buf: np.ndarray) -> int:
        """The last partial block of a file, which O_DIRECT cannot read; returns its bytes."""
        fd = os.open(span.path, os.O_RDONLY)
        try:
            want = self.file_bytes[span.path] - (span.offset + done)
            data = os.pread(fd, want, span.offset + done)
        finally:
            os.close(fd)
        start = span.record_offset + done
        buf[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return span.length - done

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
