"""Peak RSS of the CPU engine against --ram-cap, on the demo served from a packed store.

    python bench/ram_cap.py [--json] [--prompt 256] [--tokens 32] [--shares 0.25,0.5,1]

For each cap (a share of all routed experts' records), a fresh process loads the CPU engine
over the store, prefills the prompt and decodes greedily, then reports its peak RSS (VmHWM)
and its RSS before the engine loaded (Python, torch and glm53 imported). The overhead is
peak RSS - cap: what the process holds besides the RAM tier (weights, caches, buffers). The
anchor is the same run with every record in RAM: a cap that holds the overhead steady shows
the tier costs no more than its cap.

Figures: per cap, the peak and the overhead; the largest overhead is the stated bound
("peak RSS <= --ram-cap + overhead_max_bytes" on this preset). The demo's experts are 15 MB
in all, so the overhead (torch and the dense non-expert weights) dominates here; the full
model's figure needs a GPU host (issue 17's table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import host_fields


def status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(args) -> int:
    """One measured run; prints its figures as JSON."""
    import torch

    from glm53.engine.cpu import CpuEngine
    from glm53.engine.cpu_options import CpuEngineOptions

    base_rss = status_bytes("VmRSS")
    engine = CpuEngine(
        args.checkpoint, CpuEngineOptions(max_batch=1, ram_cap=args.cap, store=args.store)
    )
    engine.load()
    ids = list(range(5, 5 + args.prompt))
    with torch.inference_mode():
        cache = engine.new_cache()
        token = int(engine.forward(ids, cache).argmax())
        for _ in range(args.tokens):
            token = int(engine.forward([token], cache).argmax())
    ram = engine.stats()["tiers"]["ram"]
    print(
        json.dumps(
            {
                "base_rss_bytes": base_rss,
                "peak_rss_bytes": status_bytes("VmHWM"),
                "cap_bytes": ram["cap_bytes"],
                "slots": ram["slots"],
                "hit_rate": ram["hit_rate"],
            }
        )
    )
    engine.close()
    return 0


def measure(checkpoint: Path, store: Path, cap: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--checkpoint", str(checkpoint)]
    cmd += ["--store", str(store), "--cap", str(cap), "--prompt", str(args.prompt)]
    cmd += ["--tokens", str(args.tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the measured run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens to decode (default 32)")
    p.add_argument(
        "--shares", default="0.25,0.5,1", help="caps as shares of all records (default 0.25,0.5,1)"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    shares = sorted({float(s) for s in args.shares.split(",")} | {1.0})

    from glm53.store.pack import pack
    from glm53.store.reader import ExpertStore
    from glm53.synth.shapes import preset
    from glm53.synth.writer import write_checkpoint

    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="glm53-ram-cap-"))  # O_DIRECT: not tmpfs
    try:
        checkpoint = work / "demo"
        write_checkpoint(preset("demo"), checkpoint, seed=0, routing_source="stand-in")
        store = work / "store"
        pack(checkpoint, store, include_mtp=False, threads=1, io_threads=2)
        with ExpertStore(store) as s:
            record, num_records = s.record_bytes, s.manifest.num_records
        runs = []
        for share in shares:
            cap = max(1, round(share * num_records)) * record
            run = measure(checkpoint, store, cap, args)
            run["share"] = share
            run["overhead_bytes"] = run["peak_rss_bytes"] - run["cap_bytes"]
            runs.append(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    anchor = next(r for r in runs if r["share"] == 1.0)
    overheads = [r["overhead_bytes"] for r in runs]
    figures = {
        "overhead_max_bytes": max(overheads),
        "overhead_max_mib": round(max(overheads) / 2**20, 1),
        "base_rss_mib": round(anchor["base_rss_bytes"] / 2**20, 1),
        "runs": [
            {
                "share": r["share"],
                "cap_bytes": r["cap_bytes"],
                "slots": r["slots"],
                "peak_rss_bytes": r["peak_rss_bytes"],
                "overhead_bytes": r["overhead_bytes"],
                "hit_rate": round(r["hit_rate"], 4),
            }
            for r in runs
        ],
    }
    ratios = {
        # 1.0: the overhead does not grow with the cap; the bound holds at every cap
        "overhead_max_vs_all_experts": round(max(overheads) / anchor["overhead_bytes"], 4),
        "peak_smallest_cap_vs_all_experts": round(
            runs[0]["peak_rss_bytes"] / anchor["peak_rss_bytes"], 4
        ),
    }
    config = {
        "preset": "demo",
        "seed": 0,
        "record_bytes": record,
        "num_records": num_records,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "shares": shares,
        "store_dir_fs": "/var/tmp",
        "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        **host_fields(),
    }
    if not args.json:
        print(f"{'share':>6s}{'cap MiB':>10s}{'peak RSS MiB':>14s}{'overhead MiB':>14s}")
        for r in runs:
            print(
                f"{r['share']:6.2f}{r['cap_bytes'] / 2**20:10.1f}"
                f"{r['peak_rss_bytes'] / 2**20:14.1f}{r['overhead_bytes'] / 2**20:14.1f}"
            )
        return 0
    print(json.dumps({"bench": "ram_cap", "figures": figures, "ratios": ratios, "config": config}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
