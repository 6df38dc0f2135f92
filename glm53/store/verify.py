"""`glm53 store verify`: re-read every record with O_DIRECT and check its sha256.

Reads run on the native O_DIRECT reader's threads, queued ahead as deep as the buffers allow;
records that have arrived are hashed in batches (16 at a time with the x16 engine) on a thread
pool that releases the GIL, so reading and hashing overlap (glm53/store/hashing.py).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm53._odirect import ODirectError, Reader
from glm53.store.errors import EXIT_CHECK_FAILED, StoreError, reason
from glm53.store.format import Manifest, read_manifest
from glm53.store.hashing import RecordHasher, resolve_engine
from glm53.store.plan import check_matches, plan_store

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
PIECE_BYTES = 2 << 20
BUFFER_BUDGET_BYTES = 640 << 20
POLL_S = 0.005  # how often the loop looks at the reader while batches are hashing


def num_buffers(record_bytes: int, batch: int, hash_threads: int, queued_bytes: int) -> int:
    """Record buffers for a read (or fill) + hash pipeline: a batch hashing on every thread,
    the next batch gathering, and queued_bytes of I/O in flight; within the budget, >= 2."""
    want = (hash_threads + 1) * batch + -(-queued_bytes // record_bytes) + 1
    return max(2, min(want, BUFFER_BUDGET_BYTES // record_bytes))


def record_buffers(count: int, record_bytes: int) -> list[np.ndarray]:
    """count record buffers, zero-filled and page-aligned, cut from one anonymous mapping that
    asks for transparent huge pages: far fewer page faults on first touch, and fewer TLB misses
    when the hash and O_DIRECT's page pinning walk them (a hint; the kernel may decline)."""
    arena = mmap.mmap(-1, count * record_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    return [np.frombuffer(arena, np.uint8, record_bytes, i * record_bytes) for i in range(count)]


def hash_records(
    path: Path,
    record_bytes: int,
    records: Sequence[int],
    *,
    threads: int | None = None,
    io_threads: int = 8,
    engine: str = "auto",
    progress: Progress | None = None,
) -> Iterator[tuple[int, str | None, str]]:
    """Reads each record (O_DIRECT) and yields (record, sha256 hex, "") or, when the read
    failed, (record, None, why), in completion order."""
    with RecordHasher(engine, threads) as hasher:
        count = num_buffers(record_bytes, hasher.lanes, hasher.threads, io_threads * PIECE_BYTES)
        # a batch never needs more than half the buffers: the rest keep the reads going
        batch = max(1, min(hasher.lanes, count // 2))
        buffers = record_buffers(count, record_bytes)
        free = list(range(count))
        reading: dict[int, int] = {}  # record -> buffer, in submission order
        ready: list[tuple[int, int]] = []  # (record, buffer) read, waiting for a batch
        hashing: list[tuple[list[tuple[int, int]], Future]] = []  # batches on the pool
        todo = iter(records)
        total, done = len(records) * record_bytes, 0
        exhausted = False
        with Reader(path, threads=io_threads, piece_bytes=PIECE_BYTES) as reader:
            while True:
                while free and not exhausted:
                    record = next(todo, None)
                    if record is None:
                        exhausted = True
                        break
                    b = free.pop()
                    reader.submit(record * record_bytes, record_bytes, buffers[b], record)
                    reading[record] = b
                if not reading and not ready and not hashing:
                    return
                finished = reader.poll()
                if not finished and not any(f.done() for _, f in hashing):
                    if hashing:  # until a batch is hashed, looking at the reader every POLL_S
                        wait_futures(
                            [f for _, f in hashing],
                            timeout=POLL_S if reading else None,
                            return_when=FIRST_COMPLETED,
                        )
                        finished = reader.poll()
                    elif reading:
                        finished = reader.wait([next(iter(reading))])
                for c in finished:
                    b = reading.pop(c.tag)
                    if c.ok:
                        ready.append((c.tag, b))
                        continue
                    free.append(b)
                    done += record_bytes
                    yield c.tag, None, _read_failure(c.error, path)
                # a batch goes when it is full, or part-full when nothing else can bring more
                # records: no read in flight and no buffer coming free from a hashing batch
                starved = not reading and (exhausted or (not free and not hashing))
                while len(ready) >= batch or (ready and starved):
                    group, ready = ready[:batch], ready[batch:]
                    hashing.append((group, hasher.submit([buffers[b] for _, b in group])))
                still = []
                for group, future in hashing:
                    if not future.done():
                        still.append((group, future))
                        continue
                    for (record, b), digest in zip(group, future.result(), strict=True):
                        free.append(b)
                        done += record_bytes
                        if progress:
                            progress(done, total)
                        yield record, digest, ""
                hashing = still


def _read_failure(error: ODirectError | None, path: Path) -> str:
    if error is not None and error.errno == errno.ENODATA:  # the read ran into the end of the file
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        return f"missing: {path.name} ends at byte {size} (truncated)"
    return f"unreadable: {reason(error) if error else 'read failed'}"


@dataclass(slots=True)
class BadRecord:
    record: int
    model_layer: int
    expert: int
    is_mtp: bool
    reason: str

    def line(self) -> str:
        mtp = " (MTP)" if self.is_mtp else ""
        where = f"layer {self.model_layer}{mtp}, expert {self.expert}"
        return f"{where}: record {self.record} {self.reason}"


@dataclass(slots=True)
class VerifyResult:
    store_dir: Path
    num_records: int
    bytes_read: int
    seconds: float
    size_problem: str = ""
    bad: list[BadRecord] = field(default_factory=list)
    sha256_engine: str = ""

    @property
    def ok(self) -> bool:
        return not self.bad and not self.size_problem

    @property
    def gbps(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9


def bad_record(manifest: Manifest, record: int, why: str) -> BadRecord:
    layer, expert = manifest.locate(record)
    return BadRecord(record, layer.model_layer, expert, layer.is_mtp, why)


def verify(
    store_dir: str | Path,
    model_dir: str | Path | None = None,
    *,
    threads: int | None = None,
    io_threads: int = 8,
    sha256: str = "auto",
    progress: Progress | None = None,
) -> VerifyResult:
    """Check every record's sha256 against the manifest (and, given model_dir, that the store
    was packed from that checkpoint: StoreMismatchError otherwise). sha256: the hashing
    engine, "auto", "x16" or "openssl" (glm53/store/hashing.py)."""
    engine = resolve_engine(sha256)
    store = Path(store_dir)
    manifest = read_manifest(store)
    if model_dir is not None:
        has_mtp = any(layer.is_mtp for layer in manifest.layers)
        check_matches(manifest, store, plan_store(model_dir, include_mtp=has_mtp))
    data = store / manifest.data_file
    if not data.is_file():
        raise StoreError(
            f"{data} is missing; the store is incomplete: repack it with "
            f"`glm53 store pack --model CHECKPOINT --out {store} --resume`",
            EXIT_CHECK_FAILED,
        )
    size = data.stat().st_size
    size_problem = ""
    if size != manifest.total_bytes:
        size_problem = (
            f"{data.name} has {size} bytes, the manifest says {manifest.total_bytes} "
            f"({'truncated' if size < manifest.total_bytes else 'extra bytes at the end'})"
        )
    start = time.perf_counter()
    result = VerifyResult(store, manifest.num_records, 0, 0.0, size_problem, sha256_engine=engine)
    try:
        for record, digest, why in hash_records(
            data,
            manifest.record_bytes,
            range(manifest.num_records),
            threads=threads,
            io_threads=io_threads,
            engine=engine,
            progress=progress,
        ):
            if digest is None:
                result.bad.append(bad_record(manifest, record, why))
                continue
            result.bytes_read += manifest.record_bytes
            if digest != manifest.sha256[record]:
                result.bad.append(bad_record(manifest, record, "sha256 mismatch"))
    except ODirectError as exc:
        raise StoreError(f"cannot read {data} with O_DIRECT: {reason(exc)}") from None
    result.seconds = time.perf_counter() - start
    result.bad.sort(key=lambda b: b.record)
    return result
