"""Micro-benchmark: sha256 throughput on this host, the ceiling of `glm53 store pack` and
`verify` (both hash every byte). hashlib (OpenSSL; SHA extensions where the CPU has them) one
record per call, against glm53._odirect.sha256_many (16 records side by side in AVX-512 lanes),
each on 1 .. --threads threads, over record-sized buffers (9,474,048 bytes: a 3 bpw expert).
Reports wall GB/s (what a pack gets on a loaded host) and GB per CPU-second of the hashing
threads (what the code costs, less sensitive to other load); --rounds alternate the two.

    python bench/micro_sha256.py [--threads 2] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from glm53._odirect import SHA256_LANES, sha256_many

RECORD_BYTES = 9_474_048


def run(engine: str, threads: int, bufs: list, batches: int) -> tuple[float, float]:
    """(wall GB/s, GB per CPU-second) of `batches` batches of 16 records per thread."""

    def work(_):
        cpu = time.thread_time()
        for _ in range(batches):
            if engine == "x16":
                sha256_many(bufs)
            else:
                for buf in bufs:
                    hashlib.sha256(buf).digest()
        return time.thread_time() - cpu

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        cpu = sum(pool.map(work, range(threads)))
    wall = time.perf_counter() - start
    nbytes = threads * batches * len(bufs) * RECORD_BYTES
    return nbytes / wall / 1e9, nbytes / cpu / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="up to this many")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=2, help="16-record batches per thread")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, RECORD_BYTES, dtype=np.uint8) for _ in range(16)]
    engines = ["openssl"] + (["x16"] if SHA256_LANES else [])
    counts = sorted({1, args.threads})
    rows: dict[str, list[tuple[float, float]]] = {}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine in order:
            for n in counts:
                rows.setdefault(f"{engine}_{n}t", []).append(run(engine, n, bufs, args.batches))
    figures = {}
    for name, values in rows.items():
        figures[f"{name}_gbps"] = round(statistics.median(v[0] for v in values), 3)
        figures[f"{name}_gb_per_cpu_s"] = round(statistics.median(v[1] for v in values), 3)
    if SHA256_LANES:
        figures["x16_vs_openssl_per_cpu_s"] = round(
            figures["x16_1t_gb_per_cpu_s"] / figures["openssl_1t_gb_per_cpu_s"], 2
        )
    config = {
        "record_bytes": RECORD_BYTES,
        "threads": counts,
        "rounds": args.rounds,
        "sha256_lanes": SHA256_LANES,
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "host": f"{platform.node()} {platform.processor() or platform.machine()} "
        f"{os.cpu_count()} cpus",
        "load_avg_before_after": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }
    if args.json:
        print(json.dumps({"bench": "micro_sha256", "figures": figures, "config": config}))
        return 0
    print(f"{'engine':16}{'wall GB/s':>10}{'GB/CPU-s':>10}")
    for name in rows:
        print(f"{name:16}{figures[f'{name}_gbps']:10.3f}{figures[f'{name}_gb_per_cpu_s']:10.3f}")
    print(f"load average before/after: {config['load_avg_before_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
