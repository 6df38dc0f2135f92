"""The store's O_DIRECT read rate, measured through the reader the engine serves from.

`read_rate` opens the store as nvme-exact does (glm53.store.reader.ExpertStore with the same
reader threads: its queue depth) and reads distinct records in a random order, `batch_records`
at a time, as one layer's misses are read (ExpertStore.read: one O_DIRECT request per record,
neighbours in the file coalesced, all of a batch in flight at once). The rate is the bytes read
over the seconds the reads took; the bench compares it with the bytes each nvme row reads per
token (bench/gpu_slice.py, figures.disk_bound_tok_s).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np

from glm53._odirect import aligned_empty
from glm53.store.reader import ExpertStore

ENGINE_READER_THREADS = 4  # glm53.tiers.gpu_home.open_home_source's default, as nvme-exact runs


class ReadRate(msgspec.Struct, frozen=True):
    """What one measurement read: `bytes_read` over `seconds` is `bytes_per_s`."""

    records_read: int
    bytes_read: int
    seconds: float
    bytes_per_s: float
    threads: int  # reader threads: O_DIRECT reads in flight at once
    batch_records: int  # records per read batch (one ExpertStore.read call)
    record_bytes: int


def read_rate(
    store_dir: str | Path,
    *,
    threads: int = ENGINE_READER_THREADS,
    batch_records: int = 8,
    max_records: int | None = None,
    max_seconds: float | None = None,
    seed: int = 0,
) -> ReadRate:
    """Read up to `max_records` distinct records (default: all of them), stopping early once
    `max_seconds` have passed, and return the rate. Every record is read at most once, so a
    cache under the disk (the host's, on a virtual disk) gives no repeat hits."""
    if batch_records < 1:
        raise ValueError(f"batch_records {batch_records} must be at least 1")
    with ExpertStore(store_dir, threads=threads) as store:
        m = store.manifest
        order = np.random.default_rng(seed).permutation(m.num_records)
        if max_records is not None:
            order = order[:max_records]
        bufs = [aligned_empty(store.record_bytes) for _ in range(batch_records)]
        records = total = 0
        start = time.perf_counter()
        for i in range(0, len(order), batch_records):
            part = order[i : i + batch_records]
            requests = []
            for record, buf in zip(part.tolist(), bufs, strict=False):
                layer, expert = m.locate(record)
                requests.append((layer.model_layer, expert, buf))
            total += store.read(requests)
            records += len(requests)
            if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                break
        seconds = time.perf_counter() - start
    return ReadRate(
        records_read=records,
        bytes_read=total,
        seconds=seconds,
        bytes_per_s=total / seconds if seconds > 0 else 0.0,
        threads=threads,
        batch_records=batch_records,
        record_bytes=m.record_bytes,
    )
