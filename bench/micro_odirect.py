"""Micro-benchmark: glm53._odirect.Reader against fio on the same file, same block size and
queue depth, in the same run. Writes a --size file (default 4 GiB) with the O_DIRECT Writer,
then alternates reader and fio runs (--rounds each, order swapped every round) and compares the
medians. Both sides use O_DIRECT, so the page cache flatters neither. The file is deleted at the
end. Needs fio (Debian: apt-get install fio).

Reader: --queue-depth threads, requests of --request-bytes (an expert record) split into
--block-bytes pieces; fio: one job, --fio-engine, iodepth --queue-depth, bs --block-bytes.

    python bench/micro_odirect.py [--size 4G] [--dir /var/tmp] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
from benchlib import git_commit

from glm53._odirect import Reader, Writer, aligned_empty, filesystem_of, probe

FILL_CHUNK_BYTES = 64 << 20


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def write_file(path: str, size: int, seed: int) -> float:
    """Writes size random-ish bytes (a random chunk with each 4 KiB block stamped with its
    offset, so no two blocks are equal) with the O_DIRECT Writer; returns GB/s."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, FILL_CHUNK_BYTES, dtype=np.uint8)
    bufs = [aligned_empty(FILL_CHUNK_BYTES) for _ in range(2)]
    start = time.perf_counter()
    with Writer(path, threads=4, truncate=True) as writer:
        writer.preallocate(0, size)
        for i, offset in enumerate(range(0, size, FILL_CHUNK_BYTES)):
            buf = bufs[i % 2]
            if i >= 2:
                writer.wait([i - 2])[0].check()  # its buffer is free again
            length = min(FILL_CHUNK_BYTES, size - offset)
            buf[:] = base
            buf.view(np.uint64)[::512] = np.arange(offset, offset + FILL_CHUNK_BYTES, 4096)
            writer.submit(offset, length, buf, i)
        for c in writer.wait():
            c.check()
        writer.sync()
    return size / (time.perf_counter() - start) / 1e9


def run_reader(path: str, size: int, args, order: np.ndarray) -> float:
    request_bytes = args.request_bytes
    # enough requests in flight to keep every thread on a piece, twice over
    pieces_per_request = -(-request_bytes // args.block_bytes)
    num_slots = 2 * -(-args.queue_depth // pieces_per_request)
    slots = [aligned_empty(request_bytes) for _ in range(num_slots)]
    in_flight: list[int] = []
    start = time.perf_counter()
    with Reader(path, threads=args.queue_depth, piece_bytes=args.block_bytes) as reader:
        for n, index in enumerate(order):
            if len(in_flight) == num_slots:
                reader.wait([in_flight.pop(0)])[0].check()
            offset = int(index) * request_bytes
            reader.submit(offset, min(request_bytes, size - offset), slots[n % num_slots], n)
            in_flight.append(n)
        for c in reader.wait():
            c.check()
    return size / (time.perf_counter() - start) / 1e9


def run_fio(path: str, size: int, args) -> float:
    cmd = [
        "fio",
        "--name=micro_odirect",
        f"--filename={path}",
        "--readonly",
        "--direct=1",
        f"--rw={args.pattern}",
        f"--bs={args.block_bytes}",
        f"--iodepth={args.queue_depth}",
        f"--ioengine={args.fio_engine}",
        f"--size={size}",
        "--numjobs=1",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    read = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    if read["io_bytes"] != size:
        raise RuntimeError(f"fio read {read['io_bytes']} bytes, expected {size}")
    return read["bw_bytes"] / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_bytes, default=4 << 30, help="file size (default 4G)")
    ap.add_argument("--dir", default="/var/tmp", help="where the file goes (a local disk)")
    ap.add_argument("--block-bytes", type=parse_bytes, default=2 << 20)
    ap.add_argument("--request-bytes", type=parse_bytes, default=8 << 20)
    ap.add_argument("--queue-depth", type=int, default=16)
    ap.add_argument("--pattern", choices=["randread", "read"], default="randread")
    ap.add_argument("--fio-engine", default="libaio")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if shutil.which("fio") is None:
        print(
            "micro_odirect: fio is not installed, so there is nothing to compare against; "
            "install it (Debian/Ubuntu: apt-get install fio) and run again",
            file=sys.stderr,
        )
        return 2
    if args.size % args.request_bytes or args.request_bytes % args.block_bytes:
        ap.error("--size must be a multiple of --request-bytes, and that of --block-bytes")
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout
    probe(args.dir)
    fstype, mount = filesystem_of(args.dir)

    path = os.path.join(args.dir, f"glm53-micro-odirect-{os.getpid()}.bin")
    rng = np.random.default_rng(args.seed)
    num_requests = args.size // args.request_bytes
    reader_gbps, fio_gbps = [], []
    try:
        write_gbps = write_file(path, args.size, args.seed)
        for r in range(args.rounds):
            order = (
                rng.permutation(num_requests)
                if args.pattern == "randread"
                else np.arange(num_requests)
            )
            for side in ("reader", "fio") if r % 2 == 0 else ("fio", "reader"):
                if side == "reader":
                    reader_gbps.append(run_reader(path, args.size, args, order))
                else:
                    fio_gbps.append(run_fio(path, args.size, args))
                if not args.json:
                    last = reader_gbps[-1] if side == "reader" else fio_gbps[-1]
                    print(f"round {r} {side:6s} {last:7.3f} GB/s")
    finally:
        if os.path.exists(path):
            os.unlink(path)

    reader_median = statistics.median(reader_gbps)
    fio_median = statistics.median(fio_gbps)
    result = {
        "bench": "micro_odirect",
        "figures": {
            "reader_gbps": round(reader_median, 4),
            "fio_gbps": round(fio_median, 4),
            "reader_runs_gbps": [round(x, 4) for x in reader_gbps],
            "fio_runs_gbps": [round(x, 4) for x in fio_gbps],
            "write_gbps": round(write_gbps, 4),
        },
        "ratios": {"vs_fio": round(reader_median / fio_median, 4)},
        "config": {
            "size_bytes": args.size,
            "dir": args.dir,
            "fstype": fstype,
            "mount": mount,
            "block_bytes": args.block_bytes,
            "request_bytes": args.request_bytes,
            "queue_depth": args.queue_depth,
            "pattern": args.pattern,
            "fio_engine": args.fio_engine,
            "fio_version": fio_version.strip(),
            "rounds": args.rounds,
            "seed": args.seed,
            "commit": git_commit(),
            "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus "
            f"Linux {platform.release()}",
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'side':8s} {'median GB/s':>12s}")
        print(f"{'reader':8s} {reader_median:12.3f}")
        print(f"{'fio':8s} {fio_median:12.3f}")
        print(f"vs_fio {result['ratios']['vs_fio']:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
