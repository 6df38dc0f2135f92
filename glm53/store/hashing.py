"""sha256 of store records on a thread pool, in batches. Two engines give the same digests (the
format's plain sha256 of each record, docs/store-format.md):

- "x16": glm53._odirect.sha256_many hashes 16 records side by side in the lanes of AVX-512
  registers: about twice the bytes per CPU-second of OpenSSL with the SHA extensions
  (bench/micro_sha256.py). A batch is up to 16 records; needs AVX-512F and AVX-512BW.
- "openssl": hashlib (OpenSSL), one record per batch.

"auto" is x16 where the CPU runs it, else openssl. Both release the GIL, so batches hash on
several threads at once and overlap with the native O_DIRECT threads.

x16 costs the same per call whether 1 or 16 lanes are busy, so it pays only with full batches:
pack and verify send part-full ones only when nothing else can bring more records.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from glm53._odirect import SHA256_LANES, sha256_many
from glm53.store.errors import StoreError

ENGINES = ("auto", "x16", "openssl")


def resolve_engine(engine: str) -> str:
    """The engine that `engine` names here: "x16" or "openssl"."""
    if engine not in ENGINES:
        raise StoreError(f"sha256 engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "x16" if SHA256_LANES else "openssl"
    if engine == "x16" and not SHA256_LANES:
        raise StoreError(
            "the x16 sha256 engine needs AVX-512F and AVX-512BW, which this CPU lacks; "
            "use --sha256 openssl (or auto)"
        )
    return engine


def default_threads() -> int:
    """Hash threads: one per CPU, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


class RecordHasher:
    """Hashes batches of buffers on `threads` threads; submit() returns a Future of their hex
    digests in order. `lanes` is the batch size that uses the engine fully."""

    def __init__(self, engine: str = "auto", threads: int | None = None):
        self.engine = resolve_engine(engine)
        self.lanes = SHA256_LANES if self.engine == "x16" else 1
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="glm53-sha256")

    def submit(self, buffers: Sequence) -> Future[list[str]]:
        fn = _x16 if self.engine == "x16" else _openssl
        return self._pool.submit(fn, list(buffers))

    def close(self) -> None:
        """Waits for the batches already hashing; drops the ones not started."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RecordHasher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _x16(buffers: list) -> list[str]:
    return [digest.hex() for digest in sha256_many(buffers)]


def _openssl(buffers: list) -> list[str]:
    return [hashlib.sha256(buf).hexdigest() for buf in buffers]
