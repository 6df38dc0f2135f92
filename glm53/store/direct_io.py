"""Coalesced O_DIRECT reads of expert records, shared by both expert sources: a packed store
(glm53.store.reader.ExpertStore) and a checkpoint's safetensors shards
(glm53.tiers.expert_source.SafetensorsSource).

Aligned pieces that touch or overlap in a file (a layer's experts sit next to each other, and
their aligned spans share the block at each boundary) are read as one request into a bounce
buffer and copied into their records (`plan_runs`): a cold layer is a few large reads instead of
one small read per expert, which matters on disks whose latency, not bandwidth, bounds small
reads. A read that fails names the file offset where (RunFailed), one that does not finish in
time hands its buffers over to StuckReads (RunTimedOut); each source turns them into
ExpertReadError and ExpertReadTimeout naming its experts.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glm53 import _odirect
from glm53.errors import Glm53Error

ALIGN = 4096
MAX_RUN_BYTES = 16 << 20  # largest coalesced read


def align_down(x: int) -> int:
    return x - x % ALIGN


def align_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


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
            self._buf = _odirect.aligned_empty(align_up(need))
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


class ExpertReadError(OSError, Glm53Error):
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


class RunTimedOut(Glm53Error):
    """A coalesced read's wait ran past its deadline: `runs` are the (reader key, file offset,
    length) of the runs not known to have finished, `stuck` the reads given up on."""

    def __init__(self, runs: list, timeout: float, stuck: StuckReads):
        super().__init__(f"no answer within {timeout:g} s")
        self.runs = [(key, run.offset, run.length) for key, run in runs]
        self.timeout, self.stuck = timeout, stuck


class RunFailed(_odirect.ODirectError, Glm53Error):
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


@dataclass
class Submitted:
    """A batch of coalesced runs queued on readers and not yet collected (submit_coalesced):
    `wait_coalesced` collects it, on the thread that submitted it (a source has one owner)."""

    readers: dict
    planned: list
    buffers: list
    bounce: BounceBuffer
    tags_by_reader: dict
    run_of: dict
    total: int


def submit_coalesced(
    readers: dict, pieces: dict, bounce: BounceBuffer, tags: Iterator[int]
) -> Submitted:
    """Queue aligned pieces (file offset, length, destination), keyed by reader, as coalesced
    runs (plan_runs) and return at once; the readers' threads do the reads. `bounce` must not
    be used by another batch until this one is collected."""
    planned = [(key, run) for key, items in pieces.items() for run in plan_runs(items)]
    buffers = bounce.views([run for _, run in planned])
    total, tags_by_reader, run_of = 0, {}, {}
    for (key, run), buf in zip(planned, buffers, strict=True):
        tag = next(tags)
        run_of[tag] = (key, run)
        readers[key].submit(run.offset, run.length, run.direct() if buf is None else buf, tag)
        tags_by_reader.setdefault(key, []).append(tag)
        total += run.length
    return Submitted(readers, planned, buffers, bounce, tags_by_reader, run_of, total)


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
    return wait_coalesced(submit_coalesced(readers, pieces, bounce, tags), timeout)


def wait_coalesced(batch: Submitted, timeout: float | None = None) -> int:
    """Collect a submitted batch: read_coalesced's wait, errors and timeout (counted from now)."""
    readers, planned, buffers, bounce = batch.readers, batch.planned, batch.buffers, batch.bounce
    run_of, total = batch.run_of, batch.total
    deadline = None if timeout is None else time.monotonic() + timeout
    completions = []
    waiting = list(batch.tags_by_reader.items())
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
