"""Store benchmark: `glm53 store pack` and `verify` throughput on a multi-GB synthetic store,
against fio sequential O_DIRECT write and read of a file of the same size on the same
filesystem, in the same run. Targets: pack >= 0.7x fio write, verify >= 0.9x fio read.

The checkpoint is a `slice` (real GLM-5.3-Flash widths: 9,474,048-byte records) cut to
--moe-layers MoE layers of --experts experts (default 1 x 288 = 2.73 GB of records). Each
round runs fio write, pack, fio read, verify back to back; medians are reported. Pack reads a
source in the page cache (as right after a download); with --cold, a last pack reads it from
disk after posix_fadvise(DONTNEED) (no target; the source shares the drive here). Everything
written is deleted at the end. Needs fio (Debian/Ubuntu: apt-get install fio).

Both hash every byte, so each round also measures the sha256 ceiling on this host at that
moment: hashlib (OpenSSL) and, where the CPU has AVX-512, the x16 engine, on one thread and on
one per CPU. pack and verify use their own default engines (openssl, auto) unless --sha256 names
one for both; --other-engine adds to each round a pack and a verify with the other engine
(x16 <-> openssl), for a same-run comparison. The load average is recorded with every round. Every delete is followed by sync, so that its frees (discards, on a mount
with -o discard) do not land in the next measurement.

    python bench/store_bench.py [--dir /var/tmp] [--rounds 2] [--cold] [--other-engine] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from benchlib import git_commit

from glm53._odirect import SHA256_LANES, filesystem_of, probe, sha256_many
from glm53.store.compare import compare
from glm53.store.pack import pack
from glm53.store.verify import verify
from glm53.synth.shapes import preset
from glm53.synth.writer import SynthWriter

TARGETS = {"pack_vs_fio_write": 0.7, "verify_vs_fio_read": 0.9}
RECORD_BYTES = 9_474_048  # a slice record: real widths at 3 bpw


def run_fio(path: Path, size: int, rw: str, args) -> float:
    cmd = [
        "fio",
        "--name=store_bench",
        f"--filename={path}",
        "--direct=1",
        f"--rw={rw}",
        f"--bs={args.fio_block}",
        f"--iodepth={args.fio_depth}",
        f"--ioengine={args.fio_engine}",
        f"--size={size}",
        "--numjobs=1",
        "--output-format=json",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]["read" if rw == "read" else "write"]
    if job["io_bytes"] != size:
        raise RuntimeError(f"fio {rw} moved {job['io_bytes']} bytes, expected {size}")
    return job["bw_bytes"] / 1e9


def make_checkpoint(out: Path, moe_layers: int, experts: int) -> float:
    shape = preset(
        "slice",
        num_layers=1 + moe_layers,
        num_dense_layers=1,
        num_experts=experts,
        num_experts_per_tok=min(8, experts),
    )
    start = time.perf_counter()
    out.mkdir(parents=True)
    writer = SynthWriter(shape, 0, out)
    writer.write_metadata()  # the router stays uncalibrated: pack never reads it
    writer.write_shards(2 << 30)
    return time.perf_counter() - start


_HASH_BUFS: list = []


def sha256_rate(threads: int, engine: str = "openssl") -> float:
    """GB/s of sha256 over record-sized buffers on `threads` threads (hashlib, one record per
    call, or x16, 16 records per call): the CPU's ceiling for pack and verify on this host at
    this moment (both hash every byte)."""
    if not _HASH_BUFS:
        rng = np.random.default_rng(0)
        _HASH_BUFS.extend(rng.integers(0, 256, RECORD_BYTES, dtype=np.uint8) for _ in range(16))
    bufs = _HASH_BUFS
    batches = 3 * threads  # 16 records each

    def batch(_):
        if engine == "x16":
            sha256_many(bufs)
        else:
            for buf in bufs:
                hashlib.sha256(buf).digest()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(batch, range(batches)))
    return batches * len(bufs) * RECORD_BYTES / (time.perf_counter() - start) / 1e9


def warm(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def settle() -> None:
    """Commits the filesystem's journal after a delete, so that the frees (and, on a mount
    with -o discard, the discards of a whole store) are done before the next measurement
    instead of landing in the middle of it."""
    os.sync()


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where everything goes (a local disk)")
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="pack/verify hash threads (default 2-8)")
    ap.add_argument("--sha256", choices=["auto", "x16", "openssl"], help="both engines")
    ap.add_argument(
        "--other-engine",
        action="store_true",
        help="each round also packs and verifies with the other sha256 engine",
    )
    ap.add_argument("--pack-io-threads", type=int, default=8)
    ap.add_argument("--verify-io-threads", type=int, default=8)
    ap.add_argument("--fio-engine", default="libaio")
    ap.add_argument("--fio-depth", type=int, default=16)
    ap.add_argument("--fio-block", type=int, default=2 << 20, help="fio block bytes")
    ap.add_argument("--cold", action="store_true", help="also pack from a cold source")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if shutil.which("fio") is None:
        print(
            "store_bench: fio is not installed, so there is nothing to compare against; install "
            "it (Debian/Ubuntu: apt-get install fio) and run again",
            file=sys.stderr,
        )
        return 2
    probe(args.dir)
    fstype, mount = filesystem_of(args.dir)
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout
    work = Path(args.dir) / f"glm53-store-bench-{os.getpid()}"
    ckpt, store, fio_file = work / "ckpt", work / "store", work / "fio.bin"
    load_before = os.getloadavg()
    cpus = os.cpu_count() or 2
    rows: dict[str, list[float]] = {
        "fio_write": [],
        "pack": [],
        "fio_read": [],
        "verify": [],
        "sha256": [],  # hashlib, one thread per CPU
        "sha256_1t": [],
    }
    if SHA256_LANES:
        rows.update(sha256_x16=[], sha256_x16_1t=[])
    if args.other_engine:
        rows.update(pack_other=[], verify_other=[])
    load_rounds: list[float] = []
    engines = {"pack": "", "verify": ""}
    chosen = {} if args.sha256 is None else {"sha256": args.sha256}

    def run_pack(**engine):
        return pack(ckpt, store, threads=args.threads, io_threads=args.pack_io_threads,
                    hash_threads=args.threads, **engine)  # fmt: skip

    def run_verify(**engine):
        checked = verify(store, threads=args.threads, io_threads=args.verify_io_threads, **engine)
        if not checked.ok:
            raise RuntimeError(f"the benchmark's store failed verify: {checked.bad[:3]}")
        return checked

    figures: dict[str, float] = {}
    try:
        figures["synth_s"] = round(make_checkpoint(ckpt, args.moe_layers, args.experts), 1)
        shards = sorted(ckpt.glob("*.safetensors"))
        for _ in range(args.rounds):
            load_rounds.append(round(os.getloadavg()[0], 2))
            shutil.rmtree(store, ignore_errors=True)
            fio_file.unlink(missing_ok=True)
            settle()
            warm(shards)
            # fio needs the size; a first round learns it from the pack's plan
            size = figures.get("store_bytes") or args.moe_layers * args.experts * RECORD_BYTES
            size -= size % args.fio_block  # fio moves whole blocks
            rows["sha256"].append(sha256_rate(cpus))
            rows["sha256_1t"].append(sha256_rate(1))
            if SHA256_LANES:
                rows["sha256_x16"].append(sha256_rate(cpus, "x16"))
                rows["sha256_x16_1t"].append(sha256_rate(1, "x16"))
            rows["fio_write"].append(run_fio(fio_file, int(size), "write", args))
            result = run_pack(**chosen)
            engines["pack"] = result.sha256_engine
            figures["store_bytes"] = result.total_bytes
            rows["pack"].append(result.total_bytes / result.seconds / 1e9)
            rows["fio_read"].append(run_fio(fio_file, int(size), "read", args))
            checked = run_verify(**chosen)
            engines["verify"] = checked.sha256_engine
            rows["verify"].append(checked.gbps)
            if args.other_engine:
                other = {e: "openssl" if e == "x16" else "x16" for e in ("x16", "openssl")}
                shutil.rmtree(store)
                settle()
                warm(shards)
                result = run_pack(sha256=other[engines["pack"]])
                engines["pack_other"] = result.sha256_engine
                rows["pack_other"].append(result.total_bytes / result.seconds / 1e9)
                checked = run_verify(sha256=other[engines["verify"]])
                engines["verify_other"] = checked.sha256_engine
                rows["verify_other"].append(checked.gbps)
        fio_file.unlink(missing_ok=True)
        if not compare(store, ckpt, sample=16, seed=0).ok:
            raise RuntimeError("the benchmark's store differs from its checkpoint")
        if args.cold:
            shutil.rmtree(store)
            settle()
            drop_cache(shards)
            result = run_pack(**chosen)
            figures["pack_cold_source_gbps"] = round(result.total_bytes / result.seconds / 1e9, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for name, values in rows.items():
        figures[f"{name}_gbps"] = round(statistics.median(values), 3)
        figures[f"{name}_gbps_rounds"] = [round(v, 3) for v in values]
    figures["records"] = figures["store_bytes"] // RECORD_BYTES

    def ceiling(engine: str) -> float:
        return figures["sha256_x16_gbps" if engine == "x16" else "sha256_gbps"]

    ratios = {
        "pack_vs_fio_write": round(figures["pack_gbps"] / figures["fio_write_gbps"], 3),
        "verify_vs_fio_read": round(figures["verify_gbps"] / figures["fio_read_gbps"], 3),
        # both hash every byte: on a CPU-starved host these say how close to that ceiling
        "pack_vs_sha256": round(figures["pack_gbps"] / ceiling(engines["pack"]), 3),
        "verify_vs_sha256": round(figures["verify_gbps"] / ceiling(engines["verify"]), 3),
        # can the CPU hash as fast as the targets need? (>= 0.7 and >= 0.9 for them to be met)
        "hashlib_sha256_vs_fio_write": round(figures["sha256_gbps"] / figures["fio_write_gbps"], 3),
    }
    if SHA256_LANES:
        ratios["x16_sha256_vs_fio_write"] = round(
            figures["sha256_x16_gbps"] / figures["fio_write_gbps"], 3
        )
    if args.other_engine:
        ratios["pack_other_vs_fio_write"] = round(
            figures["pack_other_gbps"] / figures["fio_write_gbps"], 3
        )
        ratios["verify_other_vs_fio_read"] = round(
            figures["verify_other_gbps"] / figures["fio_read_gbps"], 3
        )
    config = {
        "dir": args.dir,
        "filesystem": f"{fstype} at {mount}",
        "moe_layers": args.moe_layers,
        "experts": args.experts,
        "rounds": args.rounds,
        "threads": args.threads or "default",
        "sha256_engines": engines,
        "sha256_lanes": SHA256_LANES,
        "pack_io_threads": args.pack_io_threads,
        "verify_io_threads": args.verify_io_threads,
        "fio": f"{fio_version.strip()} {args.fio_engine} iodepth {args.fio_depth} "
        f"bs {args.fio_block}",
        "targets": TARGETS,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)],
        "load_avg_rounds": load_rounds,
        "commit": git_commit(),
    }
    if args.json:
        print(
            json.dumps(
                {"bench": "store_bench", "figures": figures, "ratios": ratios, "config": config}
            )
        )
        return 0
    print(f"store_bench on {fstype} at {mount}: {figures['store_bytes'] / 1e9:.2f} GB store")
    print(f"{'':24}{'GB/s':>8}  {'target':>8}")
    print(f"{'fio write':24}{figures['fio_write_gbps']:8.3f}")
    print(f"{'pack':24}{figures['pack_gbps']:8.3f}  {ratios['pack_vs_fio_write']:6.2f}x (>= 0.7x)")
    print(f"{'fio read':24}{figures['fio_read_gbps']:8.3f}")
    print(
        f"{'verify':24}{figures['verify_gbps']:8.3f}  "
        f"{ratios['verify_vs_fio_read']:6.2f}x (>= 0.9x)"
    )
    if "pack_cold_source_gbps" in figures:
        print(f"{'pack, cold source':24}{figures['pack_cold_source_gbps']:8.3f}")
    print(f"{'hashlib sha256, 1 thread':24}{figures['sha256_1t_gbps']:8.3f}")
    print(f"{'hashlib sha256, 1/CPU':24}{figures['sha256_gbps']:8.3f}")
    if SHA256_LANES:
        print(f"{'x16 sha256, 1 thread':24}{figures['sha256_x16_1t_gbps']:8.3f}")
        print(f"{'x16 sha256, 1/CPU':24}{figures['sha256_x16_gbps']:8.3f}")
    if args.other_engine:
        print(f"{'pack, ' + engines['pack_other']:24}{figures['pack_other_gbps']:8.3f}")
        print(f"{'verify, ' + engines['verify_other']:24}{figures['verify_other_gbps']:8.3f}")
    print(f"sha256 engines: pack {engines['pack']}, verify {engines['verify']}")
    print(f"load average before/after: {config['load_avg_before_after']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
