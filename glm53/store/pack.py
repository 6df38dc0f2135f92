"""`glm53 store pack`: write a checkpoint's routed experts into a store.

Order of work: refuse an out dir inside the model dir -> O_DIRECT probe -> plan (headers
only) -> resume state -> free-space floor -> preallocate -> fill records (source reads + sha256 on a
thread pool) and write them with the native O_DIRECT writer as soon as they are filled, hashing
them (sha256, in batches on their own threads) while they are written -> fdatasync -> manifest,
atomically, last. Every few seconds the writes so far are made durable and listed in the journal, which is
what `--resume` continues from.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

from glm53._odirect import ODirectError, Writer, filesystem_of, probe
from glm53.errors import Glm53Error
from glm53.store.errors import EXIT_INTERRUPTED, StoreError, StoreMismatchError, reason
from glm53.store.format import (
    DATA_FILE,
    MANIFEST_FILE,
    encode_json,
    read_manifest,
    sync_dir,
    write_atomically,
)
from glm53.store.hashing import RecordHasher, resolve_engine
from glm53.store.journal import JOURNAL_FILE, read_journal, write_journal
from glm53.store.plan import StorePlan, check_matches, plan_store
from glm53.store.source import SourceReader
from glm53.store.verify import POLL_S, Progress, hash_records, num_buffers, record_buffers

MIN_FREE_FRACTION = 0.10  # pack refuses to leave less of the filesystem free
JOURNAL_INTERVAL_S = 2.0
PIECE_BYTES = 1 << 20  # 8 writers x 1 MiB kept the dev VM's virtio disk busier than 4 x 2 MiB


@dataclass(slots=True)
class PackResult:
    store_dir: Path
    num_records: int
    records_written: int
    records_kept: int  # verified and kept by --resume
    total_bytes: int
    seconds: float
    sha256_engine: str = ""

    @property
    def gbps(self) -> float:
        """Bytes written per second (GB/s)."""
        return self.records_written * self.total_bytes / self.num_records / self.seconds / 1e9


def default_threads() -> int:
    """Fill (source read) threads: two per CPU (a fill waits on its source reads), 4 to 16."""
    return max(4, min(16, 2 * (os.cpu_count() or 2)))


def disk_space(path: Path) -> tuple[int, int]:
    """(free bytes for this user, filesystem bytes) of the filesystem holding path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def pack(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    resume: bool = False,
    include_mtp: bool = True,
    threads: int | None = None,
    io_threads: int = 8,
    hash_threads: int | None = None,
    sha256: str = "auto",
    progress: Progress | None = None,
    verify_progress: Progress | None = None,
) -> PackResult:
    """threads: source read threads (default 4-16); io_threads: O_DIRECT writer threads;
    hash_threads: sha256 threads (default one per CPU, 2-8); sha256: the hashing engine,
    "auto", "x16" or "openssl" (glm53/store/hashing.py); --resume re-verifies the records it
    keeps with the same engine."""
    engine = resolve_engine(sha256)
    out = Path(out_dir)
    _refuse_inside(out, Path(model_dir))
    created = _make_and_probe(out)
    try:
        plan = plan_store(model_dir, include_mtp=include_mtp)
        if not resume:
            _refuse_existing(out)
    except StoreError:
        if created:
            _remove_if_empty(out)
        raise

    start = time.perf_counter()
    sha = [""] * plan.num_records
    if resume:
        sha = _resume_state(out, plan, hash_threads, engine, verify_progress)
        if all(sha) and (out / MANIFEST_FILE).is_file():
            return PackResult(
                out, plan.num_records, 0, plan.num_records, plan.total_bytes, 0.0, engine
            )
    kept = sum(1 for s in sha if s)
    _check_space(out, plan.total_bytes - _allocated(out / DATA_FILE) if kept else plan.total_bytes)
    with RecordHasher(engine, hash_threads) as hasher:
        packer = _Packer(plan, out, sha, threads or default_threads(), io_threads, hasher, progress)
        packer.run(truncate=kept == 0)
    return PackResult(
        out,
        plan.num_records,
        plan.num_records - kept,
        kept,
        plan.total_bytes,
        time.perf_counter() - start,
        engine,
    )


# --- checks before writing -----------------------------------------------------------------


def _refuse_inside(out: Path, model: Path) -> None:
    real_out, real_model = os.path.realpath(out), os.path.realpath(model)
    if real_out == real_model or real_out.startswith(real_model.rstrip("/") + "/"):
        raise StoreError(
            f"--out {out} is inside the model directory {model}; the store must live outside the "
            "checkpoint (ideally on its own NVMe drive): choose another --out"
        )


def _make_and_probe(out: Path) -> bool:
    """Create out (if missing) and check O_DIRECT there; True when this call created it."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create --out {out}: {exc.strerror}") from None
    try:
        probe(out)
    except (ODirectError, OSError) as exc:
        if created:
            _remove_if_empty(out)
        raise StoreError(f"--out {out}: {reason(exc)}") from None
    return created


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass  # not empty: leave it


def _refuse_existing(out: Path) -> None:
    if (out / MANIFEST_FILE).exists():
        raise StoreError(
            f"{out} already holds a packed store ({MANIFEST_FILE}); check it with `glm53 store "
            f"verify --store {out}`, repair it with --resume, or pack into an empty directory"
        )
    if (out / DATA_FILE).exists() or (out / JOURNAL_FILE).exists():
        raise StoreError(
            f"{out} holds an interrupted pack ({DATA_FILE} without {MANIFEST_FILE}); continue "
            f"it with --resume, or delete {out / DATA_FILE} and {out / JOURNAL_FILE}"
        )


def _allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _check_space(out: Path, need_bytes: int) -> None:
    free, size = disk_space(out)
    left = free - max(need_bytes, 0)
    if left < MIN_FREE_FRACTION * size:
        fstype, mount = filesystem_of(out)
        raise StoreError(
            f"packing needs {need_bytes / 1e9:.2f} GB more in {out} ({fstype} at {mount}), which "
            f"has {free / 1e9:.2f} GB free of {size / 1e9:.2f} GB; that would leave "
            f"{max(left, 0) / size:.1%} free, under the {MIN_FREE_FRACTION:.0%} floor: free "
            "space there or choose --out on a larger filesystem"
        )


def _resume_state(out: Path, plan: StorePlan, threads, engine, progress) -> list[str]:
    """The hashes of the records already on disk that verify, "" for the rest. A finished
    store being repaired loses its manifest here, once it is known to need a rewrite."""
    manifest_path = out / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = read_manifest(out)
        try:
            check_matches(manifest, out, plan)
        except StoreMismatchError as exc:
            raise StoreError(f"--resume: {exc}") from None
        listed = list(manifest.sha256)
    elif (out / JOURNAL_FILE).is_file():
        listed = read_journal(out, plan)
    else:
        return [""] * plan.num_records  # nothing is known to be durable: start over
    data = out / DATA_FILE
    good = [""] * plan.num_records
    if data.is_file():
        want = [r for r, s in enumerate(listed) if s]
        for record, digest, _ in hash_records(
            data, plan.record_bytes, want, threads=threads, engine=engine, progress=progress
        ):
            if digest == listed[record]:
                good[record] = digest
    if manifest_path.is_file() and not all(good):
        write_journal(out, plan, good)
        manifest_path.unlink()
        sync_dir(out)
    return good


# --- the pipeline --------------------------------------------------------------------------


class _Packer:
    """Owns the writer (one thread: this one); fills run on a pool of `threads`, hashing on the
    RecordHasher's pool.

    A record's buffer goes: free -> filling (source reads on the fill pool) -> filled: its
    O_DIRECT write is queued at once, and it waits for a hash batch (16 records with the x16
    engine; hashing and the write read the same buffer) -> free again once both are done."""

    def __init__(self, plan, out, sha, threads, io_threads, hasher, progress):
        self.plan, self.out, self.sha = plan, out, sha
        self.threads, self.io_threads, self.progress = threads, io_threads, progress
        self.hasher = hasher
        self.data = out / DATA_FILE
        self.durable = list(sha)  # what the journal may claim
        self.unsynced: list[int] = []
        self.bytes_done = sum(1 for s in sha if s) * plan.record_bytes
        rb = plan.record_bytes
        count = num_buffers(
            rb, hasher.lanes, hasher.threads, threads * rb + io_threads * PIECE_BYTES
        )
        self.batch = max(1, min(hasher.lanes, count // 2))
        # zero-filled, and the gaps between fields stay zero: fills only write fields
        self.buffers = record_buffers(count, rb)
        self.free = list(range(count))
        self.parts: dict[int, int] = {}  # record -> its write and hash, those not done yet
        self.buffer_of: dict[int, int] = {}  # record -> buffer, while filled
        self.written: set[int] = set()  # records written whose hash is not collected yet
        self.hashing: dict[Future, list[tuple[int, int]]] = {}  # batch -> its (record, buffer)s

    def run(self, truncate: bool) -> None:
        total = self.plan.total_bytes
        source = SourceReader(self.plan)
        try:
            writer = self._open_writer(truncate)
        except BaseException:
            source.close()
            raise
        write_journal(self.out, self.plan, self.durable)
        todo = [r for r, s in enumerate(self.sha) if not s]
        try:
            self._pipeline(todo, writer, source)
            writer.sync()
        except BaseException as exc:
            self._stop(writer, exc)
        finally:
            source.close()
        writer.close()
        if self.progress:
            self.progress(total, total)
        manifest = self.plan.manifest(self.sha)
        write_atomically(self.out / MANIFEST_FILE, encode_json(manifest))
        (self.out / JOURNAL_FILE).unlink(missing_ok=True)
        sync_dir(self.out)

    def _open_writer(self, truncate: bool) -> Writer:
        """The data file, opened for O_DIRECT writes and preallocated to its full size."""
        total = self.plan.total_bytes
        try:
            writer = Writer(
                self.data, threads=self.io_threads, piece_bytes=PIECE_BYTES, truncate=truncate
            )
        except ODirectError as exc:
            raise StoreError(
                f"cannot open {self.data} for O_DIRECT writes: {reason(exc)}"
            ) from None
        try:
            writer.preallocate(0, total)
        except ODirectError as exc:
            writer.close()
            fstype, mount = filesystem_of(self.out)
            fix = "free space there or choose another --out"
            if exc.errno == errno.EFBIG:
                fix = "raise the file size limit (ulimit -f) or choose another --out"
            raise StoreError(
                f"cannot reserve {total / 1e9:.2f} GB for {self.data} ({fstype} at {mount}): "
                f"{os.strerror(exc.errno)}; {fix}"
            ) from None
        return writer

    def _part_done(self, record: int) -> None:
        """One of the record's write and hash finished; with both, its buffer is free."""
        self.parts[record] -= 1
        if self.parts[record]:
            return
        del self.parts[record]
        self.written.discard(record)
        self.free.append(self.buffer_of.pop(record))
        self.unsynced.append(record)
        self.bytes_done += self.plan.record_bytes
        if self.progress:
            self.progress(self.bytes_done, self.plan.total_bytes)

    def _write_will_free(self) -> bool:
        """Some record is hashed and only waits for its write (which frees its buffer)."""
        return any(n == 1 and r not in self.written for r, n in self.parts.items())

    def _pipeline(self, todo: list[int], writer, source: SourceReader) -> None:
        rb = self.plan.record_bytes
        free, buffers = self.free, self.buffers
        filling: deque[tuple[Future, int, int]] = deque()  # (fill, record, buffer), in order
        ready: list[tuple[int, int]] = []  # filled (and writing), waiting for a hash batch
        hashing = self.hashing
        writing: dict[int, None] = {}  # records whose write is queued, in submission order
        pending = iter(todo)
        exhausted = False
        last_journal = time.monotonic()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="glm53-pack") as pool:
            try:
                while True:
                    while free and not exhausted:
                        record = next(pending, None)
                        if record is None:
                            exhausted = True
                            break
                        b = free.pop()
                        filling.append((pool.submit(source.fill, record, buffers[b]), record, b))
                    if not filling and not ready and not hashing and not writing:
                        return
                    finished = writer.poll()
                    # records are written in order: only the oldest fill can move things on
                    waits = [filling[0][0]] if filling else []
                    if not finished and not any(f.done() for f in (*waits, *hashing)):
                        if waits or hashing:  # looking at the writer every POLL_S
                            wait_futures(
                                [*waits, *hashing],
                                timeout=POLL_S if writing else None,
                                return_when=FIRST_COMPLETED,
                            )
                            finished = writer.poll()
                        elif writing:
                            finished = writer.wait([next(iter(writing))])
                    # the writes first: completions taken from the writer must be recorded
                    # before anything below can raise, or a stopped pack forgets them
                    failed = None
                    for c in finished:
                        del writing[c.tag]
                        if not c.ok:
                            failed = failed or c
                            continue
                        self.written.add(c.tag)
                        self._part_done(c.tag)
                    if failed is not None:
                        raise _WriteFailed(failed.tag, failed.error)
                    while filling and filling[0][0].done():
                        fut, record, b = filling.popleft()
                        fut.result()  # a source error stops the pack here
                        writer.submit(record * rb, rb, buffers[b], record)
                        writing[record] = None
                        self.parts[record] = 2
                        self.buffer_of[record] = b
                        ready.append((record, b))
                    # A batch goes when it is full, or part-full when nothing else can bring
                    # more records: no fill in flight and no buffer coming free by other means
                    # (a batch hashing, or a hashed record whose write is finishing). Flushing
                    # whenever the fills pause instead traps the pack in batches of one record
                    # once the writes hold the free buffers (x16 then costs 16x per byte).
                    starved = not filling and (
                        exhausted or (not free and not hashing and not self._write_will_free())
                    )
                    while len(ready) >= self.batch or (ready and starved):
                        group, ready = ready[: self.batch], ready[self.batch :]
                        hashing[self.hasher.submit([buffers[b] for _, b in group])] = group
                    for fut in [f for f in hashing if f.done()]:
                        group = hashing.pop(fut)
                        for (record, _), digest in zip(group, fut.result(), strict=True):
                            self.sha[record] = digest
                            self._part_done(record)
                    if time.monotonic() - last_journal > JOURNAL_INTERVAL_S:
                        writer.sync()
                        self._journal()
                        last_journal = time.monotonic()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise

    def _journal(self) -> None:
        for record in self.unsynced:
            self.durable[record] = self.sha[record]
        self.unsynced.clear()
        write_journal(self.out, self.plan, self.durable)

    def _hash_written(self) -> None:
        """The sha256 of every record written but not yet hashed: from its batch if that is
        hashing, else from its buffer (which stays untouched until both are done)."""
        for future, group in self.hashing.items():
            try:
                digests = future.result()
            except Exception:
                continue  # hashed again below
            for (record, _), digest in zip(group, digests, strict=True):
                self.sha[record] = digest
        need = [r for r in self.written if not self.sha[r]]
        if not need:
            return
        try:
            digests = self.hasher.submit([self.buffers[self.buffer_of[r]] for r in need]).result()
        except Exception:
            return  # those records are packed again by --resume
        for record, digest in zip(need, digests, strict=True):
            self.sha[record] = digest

    def _stop(self, writer, exc: BaseException) -> None:
        """Keep what is durably written for --resume, then raise the StoreError for exc."""
        # writes already queued finish (they hold filled records) unless the user interrupted
        writer.close(cancel=isinstance(exc, KeyboardInterrupt))
        self.written.update(c.tag for c in writer.poll() if c.ok)
        self._hash_written()
        self.unsynced.extend(r for r in self.written if self.sha[r])
        try:
            fd = os.open(self.data, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self._journal()
        except OSError:
            pass  # the journal keeps its last durable state; --resume re-verifies it anyway
        kept = sum(1 for s in self.durable if s)
        again = (
            f"{kept} of {self.plan.num_records} records are safe on disk; continue with "
            f"`glm53 store pack --model {self.plan.checkpoint.directory} --out {self.out} --resume`"
        )
        if isinstance(exc, KeyboardInterrupt):
            raise StoreError(f"pack interrupted; {again}", EXIT_INTERRUPTED) from None
        if isinstance(exc, _WriteFailed):
            where = self.plan.describe_record(exc.record)
            cause = exc.error
            fix = "check the drive (dmesg)"
            if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                fstype, mount = filesystem_of(self.out)
                fix = f"free space on {mount} ({fstype})"
            elif cause is not None and cause.errno == errno.EFBIG:
                fix = "raise the file size limit (ulimit -f)"
            why = reason(cause) if cause else "write failed"
            raise StoreError(f"pack stopped writing {where} to {self.data}: {why}; {fix}; {again}")
        if isinstance(exc, StoreError):
            raise StoreError(f"{exc}; {again}", exc.exit_code) from None
        if isinstance(exc, OSError):
            raise StoreError(f"pack stopped: {reason(exc)}; {again}") from None
        raise exc


class _WriteFailed(Glm53Error):
    def __init__(self, record: int, error: ODirectError | None):
        super().__init__(f"record {record}: {error}")
        self.record, self.error = record, error
