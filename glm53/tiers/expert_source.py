"""Where each routed expert's bytes live on disk, and reading them with O_DIRECT.

Source: the checkpoint's safetensors shards, by offset (a packed store, when one exists, is
another source with the same interface). O_DIRECT moves whole 4 KiB blocks between aligned
memory and aligned file offsets, so an expert is read as the aligned span that covers its
tensors, and its tensors are views at their offsets inside that span. A span that runs past
the end of its file is read up to the last whole block with O_DIRECT and the rest (< 4 KiB)
with a plain pread.

Spans that touch or overlap in a file (a layer's experts sit next to each other, and their
aligned spans share the block at each boundary) are read as one request into a bounce buffer
and copied into their records (`plan_runs`): a cold layer is a few large reads instead of one
small read per expert, which matters on disks whose latency, not bandwidth, bounds small reads.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm53 import _odirect
from glm53.models.checkpoint import Checkpoint, ExpertTensors, TensorInfo

ALIGN = 4096
MAX_RUN_BYTES = 16 << 20  # largest coalesced read


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


@dataclass(frozen=True, slots=True)
class Run:
    """One coalesced read: `length` bytes at file `offset`; pieces (offset in the run, length,
    destination buffer of that length)."""

    offset: int
    length: int
    pieces: tuple[tuple[int, int, np.ndarray], ...]

    def direct(self) -> np.ndarray | None:
        """The destination when the run is a single piece (read straight into it)."""
        if len(self.pieces) == 1 and self.pieces[0][1] == self.length:
            return self.pieces[0][2]
        return None


def plan_runs(pieces: list[tuple[int, int, np.ndarray]]) -> list[Run]:
    """Group aligned reads (file offset, length, destination) into runs of pieces that touch or
    overlap, in file order, each at most MAX_RUN_BYTES long (a single larger piece is its own
    run). Bytes between pieces are never read twice and no byte outside a piece is read."""
    runs: list[Run] = []
    start = end = 0
    group: list[tuple[int, int, np.ndarray]] = []
    for offset, length, dest in sorted(pieces, key=lambda piece: piece[0]):
        if group and offset <= end and max(end, offset + length) - start <= MAX_RUN_BYTES:
            group.append((offset, length, dest))
            end = max(end, offset + length)
            continue
        if group:
            runs.append(Run(start, end - start, tuple((o - start, n, d) for o, n, d in group)))
        group, start, end = [(offset, length, dest)], offset, offset + length
    if group:
        runs.append(Run(start, end - start, tuple((o - start, n, d) for o, n, d in group)))
    return runs


class BounceBuffer:
    """A grow-only aligned buffer that coalesced runs are read into before being copied out."""

    def __init__(self) -> None:
        self._buf = _odirect.aligned_empty(ALIGN)

    def views(self, runs: list[Run]) -> list[np.ndarray | None]:
        """Per run: None when it is read straight into its piece, else its slice of the buffer."""
        need = sum(run.length for run in runs if run.direct() is None)
        if need > len(self._buf):
            self._buf = _odirect.aligned_empty(_round_up(need))
        out, cursor = [], 0
        for run in runs:
            if run.direct() is not None:
                out.append(None)
                continue
            out.append(self._buf[cursor : cursor + run.length])
            cursor += run.length
        return out

    def abandon(self) -> np.ndarray:
        """Hand over the buffer to reads given up on (they may still land in it) and start a
        new one; the old one is returned so that its holder keeps it alive until they finish."""
        old, self._buf = self._buf, _odirect.aligned_empty(len(self._buf))
        return old


class ExpertReadError(OSError):
    """Reading an expert's record failed (a disk error, or a short read: the file ends early).
    `layer` and `expert` name the expert whose bytes the failed read covered; `errno` is the
    read's."""

    def __init__(self, errno_: int, message: str, layer: int, expert: int):
        super().__init__(errno_, message)
        self.layer = layer
        self.expert = expert


class ExpertReadTimeout(ExpertReadError):
    """A read of an expert's record did not finish within the read timeout (a hung disk, a dead
    network mount). `stuck` holds the reads given up on (they may still land in their buffers)
    and `experts` the (layer, expert) pairs those reads cover; `layer` and `expert` name the
    first."""

    def __init__(self, message: str, experts: list[tuple[int, int]], stuck: StuckReads):
        super().__init__(errno.ETIMEDOUT, message, *experts[0])
        self.experts, self.stuck = experts, stuck


class StuckReads:
    """Reads a wait gave up on, with the buffers they may still write (record slots are the
    caller's to keep out of use; the abandoned bounce buffer is kept alive here)."""

    def __init__(self, waits: list, keep_alive: list):
        self.waits = waits  # [(reader, [tags])] not yet collected
        self.keep_alive = keep_alive

    def finished(self) -> bool:
        """Collect what finished since; True once every read has (whether it failed or not)."""
        while self.waits:
            reader, tags = self.waits[0]
            try:
                reader.wait(tags, timeout=1e-3)
            except TimeoutError:
                return False
            self.waits.pop(0)
        self.keep_alive.clear()
        return True


class RunTimedOut(Exception):
    """A coalesced read's wait ran past its deadline: `runs` are the (reader key, file offset,
    length) of the runs not known to have finished, `stuck` the reads given up on."""

    def __init__(self, runs: list, timeout: float, stuck: StuckReads):
        super().__init__(f"no answer within {timeout:g} s")
        self.runs = [(key, run.offset, run.length) for key, run in runs]
        self.timeout, self.stuck = timeout, stuck


class RunFailed(_odirect.ODirectError):
    """A coalesced run failed: `key` is its reader's key, `offset` the file offset where."""

    def __init__(self, key, offset: int, cause: OSError):
        super().__init__(cause.errno, cause.strerror, offset)
        self.key = key


def with_others(n: int) -> str:
    """How a read-fault message mentions the other experts one coalesced read covered."""
    return "" if n <= 0 else f" (and {n} more expert{'s' if n > 1 else ''} in the same read)"


def file_problem(path: Path, opened: os.stat_result, want_bytes: int) -> str:
    """What happened to a file since it was opened (`opened`: its stat then), or "": deleted,
    replaced by another file, cut below `want_bytes`, or no longer readable. An open
    descriptor still reads a deleted or unreadable file; a truncated one reads short."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return f"{path} was deleted while serving"
    except OSError as exc:
        return f"{path} cannot be looked at any more ({exc.strerror})"
    if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
        return f"{path} was replaced by another file while serving"
    if now.st_size < want_bytes:
        return f"{path} was truncated to {now.st_size} bytes while serving (it needs {want_bytes})"
    if not os.access(path, os.R_OK):
        return f"{path} was made unreadable while serving"
    return ""


def read_coalesced(
    readers: dict,
    pieces: dict,
    bounce: BounceBuffer,
    tags: Iterator[int],
    timeout: float | None = None,
) -> int:
    """Read aligned pieces (file offset, length, destination), keyed by reader, as coalesced
    runs (plan_runs). Waits for every request, then raises RunFailed for the first read that
    failed (the file offset where it failed, so a caller can name the expert); returns the
    bytes read. With `timeout` (seconds for the whole batch), a batch still unfinished then
    raises RunTimedOut, and the bounce buffer is abandoned to the reads still in flight."""
    planned = [(key, run) for key, items in pieces.items() for run in plan_runs(items)]
    buffers = bounce.views([run for _, run in planned])
    total, tags_by_reader, run_of = 0, {}, {}
    for (key, run), buf in zip(planned, buffers, strict=True):
        tag = next(tags)
        run_of[tag] = (key, run)
        readers[key].submit(run.offset, run.length, run.direct() if buf is None else buf, tag)
        tags_by_reader.setdefault(key, []).append(tag)
        total += run.length
    deadline = None if timeout is None else time.monotonic() + timeout
    completions = []
    waiting = list(tags_by_reader.items())
    for i, (key, reader_tags) in enumerate(waiting):
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        try:
            completions += readers[key].wait(reader_tags, timeout=left)
        except TimeoutError:
            # which of this reader's runs are still out (the others are collected here)
            pending = []
            for t in reader_tags:
                try:
                    completions += readers[key].wait([t], timeout=1e-3)
                except TimeoutError:
                    pending.append(t)
            rest = [(readers[k], t) for k, t in waiting[i + 1 :]]
            stuck = StuckReads([(readers[key], pending), *rest], [bounce.abandon()])
            out = [(key, run_of[t][1]) for t in pending]
            out += [(k, run_of[t][1]) for k, tags_k in waiting[i + 1 :] for t in tags_k]
            raise RunTimedOut(out, timeout, stuck) from None
    for completion in completions:
        if not completion.ok:
            key, run = run_of[completion.tag]
            error = completion.error
            raise RunFailed(key, run.offset if error.offset is None else error.offset, error)
    for (_, run), buf in zip(planned, buffers, strict=True):
        if buf is not None:
            for offset, length, dest in run.pieces:
                dest[:length] = buf[offset : offset + length]
    return total


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
                direct = min(span.length, _round_down(self.file_bytes[span.path]) - span.offset)
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
