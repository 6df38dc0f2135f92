"""`glm53 store verify`: re-read every record with O_DIRECT and check its sha256.

Reads run on the native O_DIRECT reader's threads; hashing runs on a small thread pool
(hashlib releases the GIL), so reading and hashing overlap.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm53._odirect import ODirectError, Reader, aligned_empty
from glm53.store.errors import EXIT_CHECK_FAILED, StoreError, reason
from glm53.store.format import Manifest, read_manifest
from glm53.store.plan import check_matches, plan_store

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
PIECE_BYTES = 2 << 20
BUFFER_BUDGET_BYTES = 512 << 20


def default_threads() -> int:
    """Hash threads: one per CPU, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


def hash_records(
    path: Path,
    record_bytes: int,
    records: Sequence[int],
    *,
    threads: int | None = None,
    io_threads: int = 8,
    progress: Progress | None = None,
) -> Iterator[tuple[int, str | None, str]]:
    """Reads each record (O_DIRECT) and yields (record, sha256 hex, "") or, when the read
    failed, (record, None, why), in completion order."""
    threads = threads or default_threads()
    num_buffers = max(2, min(io_threads + 2 * threads, BUFFER_BUDGET_BYTES // record_bytes))
    buffers = [aligned_empty(record_bytes) for _ in range(num_buffers)]
    free = list(range(num_buffers))
    reading: dict[int, int] = {}  # record -> buffer, in submission order
    hashing: deque[tuple[int, int, Future]] = deque()
    todo = iter(records)
    total, done = len(records) * record_bytes, 0
    exhausted = False
    with Reader(path, threads=io_threads, piece_bytes=PIECE_BYTES) as reader:
        pool = ThreadPoolExecutor(threads, thread_name_prefix="glm53-hash")
        try:
            while True:
                while free and not exhausted:
                    record = next(todo, None)
                    if record is None:
                        exhausted = True
                        break
                    b = free.pop()
                    reader.submit(record * record_bytes, record_bytes, buffers[b], record)
                    reading[record] = b
                if not reading and not hashing:
                    return
                finished = reader.poll()
                if not finished and reading and not hashing:
                    finished = reader.wait([next(iter(reading))])
                for c in finished:
                    b = reading.pop(c.tag)
                    if c.ok:
                        hashing.append((c.tag, b, pool.submit(_sha256, buffers[b])))
                    else:
                        free.append(b)
                        done += record_bytes
                        yield c.tag, None, _read_failure(c.error, path)
                if hashing and not finished and not hashing[0][2].done():
                    wait_futures([hashing[0][2]], timeout=0.005)
                while hashing and hashing[0][2].done():
                    record, b, future = hashing.popleft()
                    free.append(b)
                    done += record_bytes
                    if progress:
                        progress(done, total)
                    yield record, future.result(), ""
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _sha256(buf: np.ndarray) -> str:
    return hashlib.sha256(buf).hexdigest()


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
    progress: Progress | None = None,
) -> VerifyResult:
    """Check every record's sha256 against the manifest (and, given model_dir, that the store
    was packed from that checkpoint: StoreMismatchError otherwise)."""
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
    result = VerifyResult(store, manifest.num_records, 0, 0.0, size_problem)
    try:
        for record, digest, why in hash_records(
            data,
            manifest.record_bytes,
            range(manifest.num_records),
            threads=threads,
            io_threads=io_threads,
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
