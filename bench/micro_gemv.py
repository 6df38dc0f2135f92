"""CPU expert lane micro-benchmark: trellis GB/s and ms per GLM-5.3-Flash expert for every kernel
(each variant at the exact and the fast precision) and thread count, the DRAM bandwidth of this
host measured in the same run, the lane's share of it, exllamav3's own CPU mul1 MoE kernel on the
same experts where it can run, and the lane's cost model (`a + b * experts` per thread count and
rows) for the kernel fast mode uses.

    python bench/micro_gemv.py [--json] [--threads 1,2,4,16] [--pool-mb 1200] [--no-exllamav3]
                               [--ab 1,2,4,8]

The headline figures (`trellis_gbps_per_thread`, `ratios.vs_exllamav3`, ...) are those of the
fast precision's best kernel, the one `--mode fast` runs; `exact_*` are the exact kernel's in the
same run, and `ratios.fast_vs_exact` compares the two.

Experts are random mul1 experts of GLM-5.3-Flash's shape (gate/up 4096 -> 2048, down 2048 ->
4096, K = 3 by default); the pool is larger than the last-level cache and jobs walk through it, so
every job reads its trellis from DRAM. A job is one decode row picking 8 distinct experts.

`--ab ROWS` adds a same-process A/B of the fast kernel against its previous kernel (where one is
kept: `_gemv.has_previous`), kernel alone on one thread, for each row count: the two run
alternately on the same matrices, `--ab-reps` times, and `figures.ab` gives the per-pair ratios'
median and quartiles and the ratio of the two kernels' 10th-percentile times (the least disturbed
by other load on the host); `ratios.fast_vs_previous_one_thread` is the one-row median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from benchlib import git_commit

HIDDEN, INTER, TOP_K = 4096, 2048, 8
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--threads", help="comma list of thread counts (default 1, 2, 4, ... all cores)")
    p.add_argument("--cpus", help="CPU list for the workers (default: one per physical core)")
    p.add_argument("--bits", type=float, default=3.0, help="bits per weight (default 3)")
    p.add_argument(
        "--pool-mb", type=int, default=0, help="expert pool size (default 4x LLC, >= 1 GB)"
    )
    p.add_argument("--jobs", type=int, default=16, help="timed jobs per point (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-exllamav3", action="store_true", help="skip exllamav3's CPU kernel")
    p.add_argument("--no-calibrate", action="store_true", help="skip the cost-model fit")
    p.add_argument("--ab", help="row counts for the fast kernel's A/B against its previous one")
    p.add_argument("--ab-reps", type=int, default=200, help="A/B pairs per row count (default 200)")
    p.add_argument("--exllamav3-child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def llc_bytes() -> int:
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 64 << 20


def make_pool(num: int, bits: float, seed: int):
    from glm53.tiers.cpu_lane import random_expert

    rng = np.random.default_rng(seed)
    return [random_expert(rng, HIDDEN, INTER, bits) for _ in range(num)]


def expert_bytes(expert) -> int:
    return sum(lin.trellis.nbytes for lin in expert)


def job_ids(num_experts: int, jobs: int, start: int = 0) -> list[list[int]]:
    """`jobs` jobs of TOP_K distinct experts each, walking through the pool."""
    return [[(start + j * TOP_K + i) % num_experts for i in range(TOP_K)] for j in range(jobs)]


def dram_bandwidth(threads: int, total_bytes: int) -> dict:
    """A multi-threaded memcpy of total_bytes (numpy copies release the GIL), reported as DRAM
    traffic (bytes read + bytes written per second), and a multi-threaded read of the same
    bytes; best of 3 each."""
    src = np.ones(total_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    bounds = np.linspace(0, total_bytes, threads + 1, dtype=np.int64)

    def copy(i):
        np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])

    words = src.view(np.uint64)
    wbounds = bounds // 8

    def read(i):  # a reduction streams its slice once: the read-only roofline the lane sees
        np.bitwise_xor.reduce(words[wbounds[i] : wbounds[i + 1]])

    def best_of_3(fn):
        best = float("inf")
        for _ in range(3):
            workers = [threading.Thread(target=fn, args=(i,)) for i in range(threads)]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - start)
        return best

    copy_s, read_s = best_of_3(copy), best_of_3(read)
    return {
        "copy_gbps": total_bytes / copy_s / 1e9,
        "dram_gbps": 2 * total_bytes / copy_s / 1e9,
        "read_gbps": total_bytes / read_s / 1e9,
    }


def time_lane(lane, table, x, jobs) -> float:
    """Median seconds per job."""
    times = []
    weights = np.full(TOP_K, 1.0 / TOP_K, np.float32)
    for ids in jobs:
        start = time.perf_counter()
        lane.run(table, x, [0] * len(ids), ids, weights[: len(ids)])
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def time_independent(table, x, cpus, variant, precision, num, jobs) -> float:
    """Median seconds per job when every CPU runs its own one-thread lane at the same time: the
    scaling ceiling of this host (shared memory bandwidth, all-core clocks) with no work split,
    no barriers and no shared queue, to tell the pool's own losses from the host's."""
    from glm53.tiers.cpu_lane import CpuLane, LaneLayout

    lanes = [CpuLane(LaneLayout((c,)), variant, precision) for c in cpus]
    lists = [job_ids(num, jobs + 2, start=1000 + 37 * i) for i in range(len(cpus))]
    for lane, ids in zip(lanes, lists, strict=True):
        time_lane(lane, table, x, ids[:2])
    start = threading.Barrier(len(lanes))
    medians = [0.0] * len(lanes)

    def run(i: int) -> None:
        start.wait()
        medians[i] = time_lane(lanes[i], table, x, lists[i][2:])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return float(np.median(medians))


def max_rel_err(pool, kernels) -> dict[str, float]:
    """Per kernel (variant, precision): max |error| / max |reference| against the fp64 reference."""
    from glm53.tiers.cpu_lane import CpuLane, LaneLayout, expert_table, kernel_name, reference_moe

    experts = pool[:2]
    table = expert_table(experts)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
    rows, ids, weights = [0, 0, 1, 1], [0, 1, 1, 0], [0.6, 0.4, 0.7, 0.3]
    ref = reference_moe(x, rows, ids, weights, experts)
    errs = {}
    for v, p in kernels:
        out = CpuLane(LaneLayout((os.sched_getaffinity(0).pop(),)), v, p).run(
            table, x, rows, ids, weights
        )
        errs[kernel_name(v, p)] = float(np.abs(out - ref).max() / np.abs(ref).max())
    return errs


def ab_previous(variant: int, rows: list[int], bits: float, reps: int, seed: int) -> dict:
    """The fast kernel of `variant` against its previous kernel, kernel alone on this thread:
    gate-shaped matrices (4096 -> 2048), 16 of them (about 48 MB at K = 3, past most L2s; the
    kernel is bound by its arithmetic, not by where the trellis is), each pair run back to back
    in alternating order. Outputs are checked equal (both kernels are bit-identical to the scalar
    one, tests/test_gemv_fast.py)."""
    from glm53 import _gemv

    k2 = round(2 * bits)
    rng = np.random.default_rng(seed)
    kt, nt = HIDDEN // 16, INTER // 16
    mats = [rng.integers(-(2**15), 2**15, (kt, nt, 8 * k2), dtype=np.int16) for _ in range(16)]
    out = {}
    for m in rows:
        xh = rng.standard_normal((m, HIDDEN)).astype(np.float32)
        new_s, old_s = [], []
        for rep in range(reps + 2):
            mat = mats[rep % len(mats)]
            order = (False, True) if rep % 2 else (True, False)
            times = {}
            for previous in order:
                start = time.perf_counter()
                got = _gemv.tiles(variant, mat, xh, precision=_gemv.FAST, previous=previous)
                times[previous] = time.perf_counter() - start
                if rep == 0:
                    times[f"out{previous}"] = got
            if rep == 0 and not np.array_equal(times["outTrue"], times["outFalse"]):
                raise SystemExit(f"A/B: the two kernels differ at {m} rows (they must not)")
            if rep >= 2:  # two warm-up pairs
                new_s.append(times[False])
                old_s.append(times[True])
        new_a, old_a = np.array(new_s), np.array(old_s)
        ratio = old_a / new_a  # > 1: the current kernel is faster
        nbytes = mats[0].nbytes
        out[str(m)] = {
            "ratio_median": float(np.median(ratio)),
            "ratio_p25": float(np.percentile(ratio, 25)),
            "ratio_p75": float(np.percentile(ratio, 75)),
            "ratio_of_p10_times": float(np.percentile(old_a, 10) / np.percentile(new_a, 10)),
            "new_gbps_p10": nbytes / float(np.percentile(new_a, 10)) / 1e9,
            "previous_gbps_p10": nbytes / float(np.percentile(old_a, 10)) / 1e9,
            "pairs": len(ratio),
        }
    return out


# --- exllamav3's CPU kernel, in a child process (its worker has crashed on some hosts) ----------


def exllamav3_child(spec: str) -> None:
    """Time exllamav3's exl3_moe_cpu_forward on the same experts; prints one JSON line."""
    cfg = json.loads(spec)
    os.environ.setdefault("EXL3_MOE_CPU_PIN", "0")  # its core-order probe segfaulted on a test host
    import torch
    from exllamav3.ext import exllamav3_ext as ext

    pool = make_pool(cfg["num"], cfg["bits"], cfg["seed"])
    k = cfg["bits"]
    group = int(ext.exl3_moe_cpu_swizzle_group(float(k)))
    planar = int(ext.exl3_moe_cpu_planar_layout(float(k)))
    result = {"swizzle_group": group, "planar": planar}
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((1, HIDDEN)).astype(np.float16))
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, dtype=torch.float16)
    out = torch.empty((1, HIDDEN), dtype=torch.float32)

    def tensors(which, swizzled):
        tr, su, sv = [], [], []
        for expert in pool:
            lin = expert[which]
            t = lin.trellis
            if swizzled and group:
                tk, tn, ps = t.shape
                if planar:
                    w = t.view(np.int32).reshape(tk, tn // group, group, 8, ps // 16)
                    t = w.transpose(1, 0, 2, 4, 3).reshape(-1).view(np.int16).reshape(t.shape)
                else:
                    t = t.reshape(tk, tn // group, group, ps).transpose(1, 0, 2, 3)
                t = np.ascontiguousarray(t).reshape(tk, tn, ps)
            tr.append(torch.from_numpy(np.ascontiguousarray(t)))
            su.append(torch.from_numpy(lin.suh))
            sv.append(torch.from_numpy(lin.svh))
        return tr, su, sv

    for name, swizzled in (("native", False), ("swizzled", True)):
        if swizzled and not group:
            continue
        g, u, d = (tensors(i, swizzled) for i in range(3))
        handle = ext.exl3_moe_cpu_make_layer(*g, *u, *d, [], [], [], 0, 10.0, int(swizzled))
        for threads in cfg["threads"]:
            times = []
            for ids in job_ids(len(pool), cfg["jobs"] + 2):
                sel = torch.tensor([ids], dtype=torch.int64)
                start = time.perf_counter()
                ext.exl3_moe_cpu_forward(handle, x, sel, weights, out, threads)
                times.append(time.perf_counter() - start)
            result[f"{name}_{threads}"] = float(np.median(times[2:]))
        ext.exl3_moe_cpu_free_layer(handle)
        del g, u, d
    print(json.dumps(result))


def run_exllamav3(num, bits, seed, threads, jobs) -> tuple[dict | None, str]:
    try:
        import exllamav3  # noqa: F401
    except Exception as e:  # not installed, or broken
        return None, f"exllamav3 not importable here ({type(e).__name__}: {e})"
    spec = json.dumps({"num": num, "bits": bits, "seed": seed, "threads": threads, "jobs": jobs})
    cmd = [sys.executable, __file__, "--exllamav3-child", spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "exllamav3 CPU kernel timed out after 1800 s (extension build?)"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"exllamav3 CPU kernel failed (exit {proc.returncode}): {' | '.join(tail)}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


# --- main -------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.exllamav3_child:
        exllamav3_child(args.exllamav3_child)
        return 0
    from glm53 import _gemv
    from glm53.tiers.cpu_lane import (
        FAST_REL_TOL,
        CpuLane,
        LaneLayout,
        _cpu_list_text,
        expert_table,
        kernel_name,
        measure_cost,
        parse_cpu_list,
        physical_cores,
    )

    cpus = parse_cpu_list(args.cpus) if args.cpus else physical_cores()
    max_threads = len(cpus)
    if args.threads:
        thread_counts = [int(t) for t in args.threads.split(",")]
    else:
        thread_counts = [1]
        while thread_counts[-1] * 2 < max_threads:
            thread_counts.append(thread_counts[-1] * 2)
        thread_counts += [max_threads] if thread_counts[-1] != max_threads else []
    thread_counts = [t for t in thread_counts if t <= max_threads]
    llc = llc_bytes()
    pool_bytes = args.pool_mb << 20 if args.pool_mb else max(1 << 30, 4 * llc)
    probe = make_pool(1, args.bits, args.seed)
    per_expert = expert_bytes(probe[0])
    num = max(2 * TOP_K, pool_bytes // per_expert)
    started = time.perf_counter()
    pool = make_pool(num, args.bits, args.seed)
    table = expert_table(pool)
    x = np.random.default_rng(2).standard_normal((1, HIDDEN)).astype(np.float16).astype(np.float32)
    variants = [v for v in _gemv.VARIANTS if _gemv.variant_supported(v)]
    best = max(variants)
    # the fast kernels by name: the avx512-fp16 variant runs the avx512 one
    fast_kernels = {kernel_name(v, _gemv.FAST): v for v in variants}
    kernels = [(v, _gemv.EXACT) for v in variants]
    kernels += [(v, _gemv.FAST) for v in fast_kernels.values()]
    best_fast = kernel_name(best, _gemv.FAST)

    dram = dram_bandwidth(max_threads, max(pool_bytes // 2, 1 << 30))
    table_rows = []
    for v, prec in kernels:
        name = kernel_name(v, prec)
        counts = [1] if v == _gemv.SCALAR else thread_counts
        for t in counts:
            lane = CpuLane(LaneLayout(tuple(cpus[:t])), v, prec)
            jobs = job_ids(num, 1 if v == _gemv.SCALAR else args.jobs + 2, start=t * 7 + 3 * prec)
            if v == _gemv.SCALAR:
                jobs = [jobs[0][:1]]  # one expert: the scalar path is slow by design
                seconds = time_lane(lane, table, x, jobs)
                experts_per_job = 1
            else:
                time_lane(lane, table, x, jobs[:2])  # warm up the pool and the tables
                seconds = time_lane(lane, table, x, jobs[2:])
                experts_per_job = TOP_K
            gbps = experts_per_job * per_expert / seconds / 1e9
            table_rows.append(
                {
                    "variant": name,
                    "precision": _gemv.precision_name(prec),
                    "threads": t,
                    "ms_per_expert": seconds * 1e3 / experts_per_job,
                    "trellis_gbps": gbps,
                    "trellis_gbps_per_thread": gbps / t,
                    "dram_share": gbps / dram["dram_gbps"],
                    "dram_read_share": gbps / dram["read_gbps"],
                }
            )
            del lane
    independent_gbps = (
        TOP_K
        * per_expert
        / time_independent(table, x, cpus, best, _gemv.FAST, num, args.jobs)
        / 1e9
    )
    errs = max_rel_err(pool, kernels)
    cost = None
    if not args.no_calibrate:
        cost = measure_cost(
            table, LaneLayout(tuple(cpus)), thread_counts, variant=best, precision="fast"
        )

    ab = ab_rows = None
    if args.ab:
        ab_rows = [int(m) for m in args.ab.split(",")]
        if not _gemv.has_previous(best, _gemv.FAST):
            raise SystemExit(f"--ab: the {best_fast} kernel keeps no previous kernel to compare")
        ab = ab_previous(best, ab_rows, args.bits, args.ab_reps, args.seed)

    exl, exl_reason = (None, "skipped (--no-exllamav3)")
    if not args.no_exllamav3:
        del table
        exl, exl_reason = run_exllamav3(num, args.bits, args.seed, thread_counts, args.jobs)

    best_name = _gemv.variant_name(best)
    rows_of = {
        name: {r["threads"]: r for r in table_rows if r["variant"] == name}
        for name in (best_name, best_fast)
    }
    fast_rows, exact_rows = rows_of[best_fast], rows_of[best_name]
    top = max(fast_rows)
    all_cores, exact_all = fast_rows[top], exact_rows[top]
    vs_exl = vs_exl_swz = exact_vs_exl = None
    if exl:
        ours = all_cores["ms_per_expert"] * TOP_K / 1e3
        vs_exl = exl[f"native_{top}"] / ours
        exact_vs_exl = exl[f"native_{top}"] / (exact_all["ms_per_expert"] * TOP_K / 1e3)
        if f"swizzled_{top}" in exl:
            vs_exl_swz = exl[f"swizzled_{top}"] / ours
    exact_errs = [e for k, e in errs.items() if not k.endswith(" fast")]
    fast_errs = [e for k, e in errs.items() if k.endswith(" fast")]
    figures = {
        "max_rel_err": max(exact_errs),
        "fast_max_rel_err": max(fast_errs),
        "fast_rel_tol": FAST_REL_TOL,
        "rel_err_by_variant": errs,
        # the kernel fast mode runs (exact_* below: the exact kernel of the same variant)
        "trellis_gbps_per_thread": fast_rows[1]["trellis_gbps_per_thread"]
        if 1 in fast_rows
        else None,
        "ms_per_expert": all_cores["ms_per_expert"],
        "ms_per_expert_threads": top,
        "trellis_gbps_all_cores": all_cores["trellis_gbps"],
        "trellis_gbps_per_thread_all_cores": all_cores["trellis_gbps_per_thread"],
        "independent_gbps_per_thread": independent_gbps,
        "exact_trellis_gbps_one_thread": (
            exact_rows[1]["trellis_gbps_per_thread"] if 1 in exact_rows else None
        ),
        "exact_ms_per_expert": exact_all["ms_per_expert"],
        "exact_trellis_gbps_all_cores": exact_all["trellis_gbps"],
        "dram_gbps": dram["dram_gbps"],
        "memcpy_gbps": dram["copy_gbps"],
        "dram_read_gbps": dram["read_gbps"],
        "table": table_rows,
        "exllamav3_ms_per_expert": (
            {k: v * 1e3 / TOP_K for k, v in exl.items() if k.split("_")[-1].isdigit()}
            if exl
            else None
        ),
        "cost_model": (
            {f"{t},{m}": [round(a, 4), round(b, 4)] for (t, m), (a, b) in cost.fits.items()}
            if cost
            else None
        ),
        "ab": ab,
    }
    ratios = {
        "vs_exllamav3": vs_exl,
        "vs_exllamav3_swizzled": vs_exl_swz,
        "exact_vs_exllamav3": exact_vs_exl,
        "fast_vs_exact": exact_all["ms_per_expert"] / all_cores["ms_per_expert"],
        "fast_vs_exact_one_thread": (
            exact_rows[1]["ms_per_expert"] / fast_rows[1]["ms_per_expert"]
            if 1 in fast_rows and 1 in exact_rows
            else None
        ),
        "dram_share": all_cores["dram_share"],
        "dram_read_share": all_cores["dram_read_share"],
        # all-core pool throughput against every core running its own one-thread lane at once
        "pool_vs_independent": all_cores["trellis_gbps"] / (top * independent_gbps),
        # the fast kernel against its previous one, kernel alone, one thread, one row (--ab)
        "fast_vs_previous_one_thread": ab["1"]["ratio_median"] if ab and "1" in ab else None,
    }
    config = {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": _cpu_list_text(cpus),
        "threads": thread_counts,
        "variants": [_gemv.variant_name(v) for v in variants],
        "kernels": [kernel_name(v, p) for v, p in kernels],
        "best_variant": best_name,
        "fast_kernel": best_fast,
        "bits": args.bits,
        "shape": f"gate/up {HIDDEN}->{INTER}, down {INTER}->{HIDDEN}",
        "expert_trellis_bytes": per_expert,
        "pool_experts": num,
        "pool_bytes": num * per_expert,
        "llc_bytes": llc,
        "job": f"1 row x {TOP_K} distinct experts, fp32, clamp 10",
        "dram_method": f"{max_threads}-thread numpy memcpy, (read + write) bytes / s, best of 3; "
        "dram_read_gbps: the same threads xor-reducing the buffer",
        "swizzle": "none: each work unit streams whole tile rows, already contiguous (0 extra RAM)",
        "exllamav3": exl_reason or f"exl3_moe_cpu_forward, int8 activations, {exl}",
        "independent": f"each of the {max_threads} CPUs runs its own one-thread lane "
        f"({best_fast}) at the same time, {args.jobs} jobs each; figure = median per-lane GB/s",
        "cost_model": f"{best_fast}: ms = a + b * experts per 'threads,rows' (every expert "
        "picked by all rows)",
        "ab": (
            f"{best_fast} (pyx/gemv_avx512_fast.c) against its previous kernel "
            f"(gemv_avx512_fast_v1.c), kernel alone, one thread, K = {args.bits}, rows {ab_rows}, "
            f"{args.ab_reps} alternating pairs each; ratio = previous time / current time"
            if ab
            else "not run (--ab)"
        ),
        "seed": args.seed,
        "commit": git_commit(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    result = {"bench": "micro_gemv", "figures": figures, "ratios": ratios, "config": config}
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    f, r, c = result["figures"], result["ratios"], result["config"]
    print(f"CPU lane on {c['cpu']} ({c['cpus']}), K={c['bits']}, pool {c['pool_bytes'] >> 20} MiB")
    print(
        f"DRAM: {f['dram_gbps']:.1f} GB/s (read+write of a memcpy; {f['memcpy_gbps']:.1f} GB/s "
        f"copied); read-only {f['dram_read_gbps']:.1f} GB/s"
    )
    print(
        f"{'kernel':>14} {'threads':>7} {'ms/expert':>10} {'GB/s':>8} {'GB/s/thr':>9} "
        f"{'DRAM %':>7} {'read %':>7}"
    )
    for row in f["table"]:
        print(
            f"{row['variant']:>14} {row['threads']:>7} {row['ms_per_expert']:>10.3f} "
            f"{row['trellis_gbps']:>8.2f} {row['trellis_gbps_per_thread']:>9.2f} "
            f"{100 * row['dram_share']:>6.1f}% {100 * row['dram_read_share']:>6.1f}%"
        )
    print(
        f"{c['cpus']} independent one-thread lanes at once: "
        f"{f['independent_gbps_per_thread']:.2f} GB/s each; the pool's all-core figure is "
        f"{r['pool_vs_independent']:.2f} of their sum"
    )
    print(
        f"max rel err vs fp64 reference: exact {f['max_rel_err']:.2e}, fast "
        f"{f['fast_max_rel_err']:.2e} (bound {f['fast_rel_tol']:.0e})"
    )
    print(f"{c['fast_kernel']} vs {c['best_variant']}: {r['fast_vs_exact']:.2f}x at all cores")
    print(f"vs exllamav3: {r['vs_exllamav3']} ({c['exllamav3']})")
    if f["cost_model"]:
        print("cost model a + b*experts (ms) by threads,rows:", f["cost_model"])
    for m, row in (f["ab"] or {}).items():
        print(
            f"A/B {c['fast_kernel']} vs previous, {m} row(s), one thread: median "
            f"{row['ratio_median']:.3f}x (quartiles {row['ratio_p25']:.3f}-{row['ratio_p75']:.3f}), "
            f"p10 times {row['ratio_of_p10_times']:.3f}x"
        )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
