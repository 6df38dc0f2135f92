"""Micro-probes that measure this host for the cost model: DRAM copy bandwidth, the CPU lane's
calibration and the store's O_DIRECT read rate (the PCIe probe is pcie_probe.py, run as a child). Each returns
a value or raises Unavailable with the reason; the doctor bounds each with a timeout."""

from __future__ import annotations

import importlib
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from glm53.doctor.host import LaneCalibration, StoreRead
from glm53.doctor.source import Unavailable

RECORD_BYTES = 9_437_184  # one 3-bit expert's trellis: the unit the NVMe tier reads
STORE_PROBE_BYTES = 1 << 30
STORE_READERS = 16


def dram_gbps(threads: int, total_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Copy bandwidth of `threads` threads each copying its own block with numpy (the copy
    releases the GIL), counted as bytes read + bytes written, best of `repeats`."""
    import numpy as np

    threads = max(1, threads)
    per = max(1 << 20, total_bytes // threads)
    src = [np.ones(per, dtype=np.uint8) for _ in range(threads)]
    dst = [np.zeros(per, dtype=np.uint8) for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda i: np.copyto(dst[i], src[i]), range(threads)))
            best = min(best, time.perf_counter() - start)
    return 2 * per * threads / best / 1e9


def lane_calibration(cpus: list[int]) -> LaneCalibration:
    """The CPU lane's own calibration (glm53.tiers.cpu_lane.calibrate) on the lane's CPUs, one
    row per expert (decode at concurrency 1): the fit a + b x experts, in ms."""
    try:
        cpu_lane = importlib.import_module("glm53.tiers.cpu_lane")
    except ImportError as e:
        raise Unavailable(f"not calibrated: glm53.tiers.cpu_lane is not importable ({e})") from e
    calibrate = getattr(cpu_lane, "calibrate", None)
    if calibrate is None:
        raise Unavailable("not calibrated: glm53.tiers.cpu_lane has no calibrate()")
    threads = len(cpus)
    cost = calibrate(thread_counts=[threads], rows=(1,), layout=cpu_lane.LaneLayout(tuple(cpus)))
    fit = cost.fits.get((threads, 1))
    if fit is None:
        raise Unavailable(f"not calibrated: cpu_lane.calibrate() gave no fit for {threads} threads")
    a_ms, b_ms = fit
    if b_ms <= 0:
        raise Unavailable(f"not calibrated: the fit's b is {b_ms:.4f} ms per expert (noise)")
    return LaneCalibration(
        threads=threads, a_ms=round(max(0.0, a_ms), 4), b_ms=round(b_ms, 4), variant=cost.variant
    )


def odirect_probe(path: str) -> None:
    """glm53._odirect.probe: raises OSError (naming the filesystem) where O_DIRECT is refused."""
    try:
        from glm53._odirect import probe
    except ImportError as e:
        raise Unavailable(f"glm53._odirect not built ({e})") from e
    probe(path)


def _write_probe_file(path: str, nbytes: int) -> None:
    block = mmap.mmap(-1, RECORD_BYTES)
    block.write(os.urandom(RECORD_BYTES))  # random: some drives compress zeros
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for offset in range(0, nbytes, RECORD_BYTES):
            os.pwritev(fd, [block], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def store_read(
    path: str, nbytes: int = STORE_PROBE_BYTES, readers: int = STORE_READERS
) -> StoreRead:
    """O_DIRECT read rate of the store location: `readers` threads reading record-sized pieces.
    A directory gets a temporary probe file (written with O_DIRECT, deleted after); a file (an
    existing store) is read from its start and never written."""
    probe_file = None
    if os.path.isdir(path):
        probe_file = os.path.join(path, f".glm53-read-probe-{os.getpid()}")
        _write_probe_file(probe_file, nbytes)
        target = probe_file
    elif os.path.isfile(path):
        target = path
    else:
        raise Unavailable(f"store read: {path} does not exist")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.fstat(fd).st_size
            count = min(nbytes, size) // RECORD_BYTES
            if count < readers:
                raise Unavailable(f"store read: {target} is too small to measure ({size} B)")
            offsets = [i * RECORD_BYTES for i in range(count)]
            latencies: list[float] = []
            lock = threading.Lock()
            local = threading.local()

            def read(offset: int) -> None:
                if not hasattr(local, "buf"):
                    local.buf = mmap.mmap(-1, RECORD_BYTES)
                t0 = time.perf_counter()
                got = os.preadv(fd, [local.buf], offset)
                dt = time.perf_counter() - t0
                if got != RECORD_BYTES:
                    raise OSError(f"short O_DIRECT read at {offset}: {got} of {RECORD_BYTES} B")
                with lock:
                    latencies.append(dt)

            start = time.perf_counter()
            with ThreadPoolExecutor(readers) as pool:
                list(pool.map(read, offsets))
            elapsed = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        if probe_file:
            os.unlink(probe_file)
    total = count * RECORD_BYTES
    return StoreRead(
        path=path,
        read_gbps=round(total / elapsed / 1e9, 2),
        record_latency_ms=round(1000 * sum(latencies) / len(latencies), 3),
        bytes_read=total,
    )
