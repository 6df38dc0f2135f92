"""The CPU lane's round trip as fast mode's device sees it, host only: a thread plays the GPU's
side of one MoE layer's mailbox (publish one decode row's picks, then poll `done`), with an idle
gap before each job as a decode step has between a layer's jobs, and the same job run straight
on the lane's pool beside it (the kernel and the pool's own hand-off, no mailbox) as the anchor.

    python bench/lane_latency.py [--json] [--experts 1,2,4] [--gaps-us 0,500,1500,4000]
                                 [--spins-us 200,5000] [--jobs 40]

Why: on the H200 on 2026-12-05 any share of misses sent to the lane cost fast mode about 0.5 ms
a MoE layer, flat from 10 % to 40 % of the misses (bench/results/README.md). A job of one or two
experts is 0.25-0.5 ms of kernel at 16 threads; what the rest is (the poller's sleep after its
idle spin, the workers' futex wake, the hand-offs) is what this measures, on any host, without a
GPU. `--spins-us` sets MailboxLane.idle_spin_ns (the poller's and the workers' spin after a job,
5 ms by default since this bench's H200 run of 2026-12-05, 200 us before): a gap longer than the
spin finds the lane asleep.

Figures, per spin, experts per job and gap: the round trip's median and 90th percentile in us,
and the anchor's median (`pool_us`, back to back, the same jobs). Ratios: `asleep_vs_awake`, the
round trip after the longest gap at the shortest spin over the same at the longest spin (what
waking costs), and `round_trip_vs_pool`, the round trip at no gap over the anchor (what the
mailbox adds to a job whose lane is awake). As served, the poller and this thread (the device's
stand-in) run on the cores the lane's layout leaves (glm53.tiers.thread_pins; none with --cpus,
which reserves nothing). Experts are random mul1 experts of GLM-5.3-Flash's
shape (gate/up 4096 -> 2048, down 2048 -> 4096), from a pool larger than the last-level cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from benchlib import host_fields

from glm53.tiers.cpu_lane import CpuLane, LaneLayout, expert_table, lane_layout, random_expert
from glm53.tiers.lane_mailbox import MailboxLane
from glm53.tiers.thread_pins import lane_threads_pinned

HIDDEN, INTER = 4096, 2048


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 0, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--experts", type=int_list, default=[1, 2, 4], help="experts a job (1 row)")
    p.add_argument("--gaps-us", type=int_list, default=[0, 500, 1500, 4000],
                   help="idle time before each job, us")  # fmt: skip
    p.add_argument("--spins-us", type=int_list, default=[200, 5000],
                   help="MailboxLane.idle_spin_ns values, us (its default: 5000)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=40, help="timed jobs a point")
    p.add_argument("--pool-experts", type=int, default=96,
                   help="experts to walk (96 of this shape: about 0.9 GB)")  # fmt: skip
    p.add_argument("--cpus", default=None, help="the lane's CPUs (default: the server's layout)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)  # CI: small
    p.add_argument("--inter", type=int, default=INTER, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def wait_until(t_ns: int) -> None:
    """Busy-wait to t_ns (perf_counter_ns): a sleep's own wake-up would blur the gap."""
    while time.perf_counter_ns() < t_ns:
        pass


def publish(mbox, seq: int, x, experts, weights) -> int:
    """One decode row's picks into the mailbox, as the device's lane_publish writes them."""
    n = len(experts)
    mbox.rows[:1] = x
    mbox.picks["row"][:n] = 0
    mbox.picks["expert"][:n] = experts
    mbox.picks["weight"][:n] = weights
    mbox.header[1], mbox.header[2], mbox.header[3] = n, 1, 0
    seq = (seq + 1) & 0xFFFFFFFF
    mbox.store("seq", seq)  # last, with release: the payload is visible first
    return seq


def round_trips(mbox, pool_n: int, k: int, gap_us: int, jobs: int, rng) -> list[float]:
    """us from each publish to its done, after `gap_us` idle."""
    out, seq = [], mbox.seq
    for j in range(jobs + 2):  # the first two warm the point up, not timed
        x = rng.standard_normal((1, mbox.hidden)).astype(np.float16).astype(np.float32)
        experts = [(j * k + i) % pool_n for i in range(k)]
        weights = np.full(k, 1.0 / k, dtype=np.float32)
        wait_until(time.perf_counter_ns() + gap_us * 1000)
        t0 = time.perf_counter_ns()
        seq = publish(mbox, seq, x, experts, weights)
        deadline = t0 + 10_000_000_000
        while mbox.done != seq:
            if time.perf_counter_ns() > deadline:
                raise RuntimeError(f"the lane did not answer job {j} in 10 s")
        t1 = time.perf_counter_ns()
        if j >= 2:
            out.append((t1 - t0) / 1000)
    return out


def pool_times(cpu, table, pool_n: int, k: int, jobs: int, rng) -> list[float]:
    """us of the same jobs run straight on the lane's pool (CpuLane.run), back to back."""
    out = []
    for j in range(jobs + 2):
        x = rng.standard_normal((1, table.hidden)).astype(np.float16).astype(np.float32)
        experts = np.array([(j * k + i) % pool_n for i in range(k)], dtype=np.int32)
        weights = np.full(k, 1.0 / k, dtype=np.float32)
        t0 = time.perf_counter_ns()
        cpu.run(table, x, np.zeros(k, dtype=np.int32), experts, weights)
        if j >= 2:
            out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered),
            "p90_us": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(argv)
    layout = LaneLayout(tuple(int(c) for c in args.cpus.split(","))) if args.cpus else None
    cpu = CpuLane(layout or lane_layout(), precision="fast")
    rng = np.random.default_rng(args.seed)
    experts = [random_expert(rng, args.hidden, args.inter) for _ in range(args.pool_experts)]
    table = expert_table(experts)
    points, pool = {}, {}
    # as served (glm53.tiers.thread_pins): the poller on the cores the lane leaves, and so this
    # thread, which plays the device's side here (the GPU polls without a core)
    with MailboxLane(cpu, [table]) as lane, lane_threads_pinned(lane) as pins:
        mbox = lane.mailboxes[0]
        default_spin = lane.idle_spin_ns
        for k in args.experts:
            pool[str(k)] = summary(pool_times(cpu, table, args.pool_experts, k, args.jobs, rng))
        try:
            for spin in args.spins_us:
                lane.idle_spin_ns = spin * 1000
                for k in args.experts:
                    for gap in args.gaps_us:
                        times = round_trips(mbox, args.pool_experts, k, gap, args.jobs, rng)
                        points[f"spin{spin}_k{k}_gap{gap}"] = dict(
                            summary(times), spin_us=spin, experts=k, gap_us=gap,
                            pool_us=pool[str(k)]["median_us"],
                        )  # fmt: skip
        finally:
            lane.idle_spin_ns = default_spin

    def median(spin, k, gap):
        p = points.get(f"spin{spin}_k{k}_gap{gap}")
        return p["median_us"] if p else None

    k0, long_gap = args.experts[0], max(args.gaps_us)
    default_us = default_spin // 1000
    asleep = median(min(args.spins_us), k0, long_gap)
    awake = median(max(args.spins_us), k0, long_gap)
    no_gap = median(args.spins_us[0], k0, min(args.gaps_us))
    ratios = {
        "asleep_vs_awake": asleep / awake if asleep and awake else None,
        "round_trip_vs_pool": no_gap / pool[str(k0)]["median_us"] if no_gap else None,
    }
    return {
        "bench": "lane_latency",
        "config": {
            "threads": cpu.layout.threads,
            "cpus": list(cpu.layout.cpus),
            "kernel": cpu.kernel_name,
            "hidden": args.hidden,
            "inter": args.inter,
            "pool_experts": args.pool_experts,
            "jobs": args.jobs,
            "default_spin_us": default_us,
            "thread_pins": {role: list(pin.cpus) for role, pin in pins.items()},
            **host_fields(),
        },  # fmt: skip
        "figures": {"round_trip": points, "pool": pool},
        "ratios": ratios,
    }


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        for name, p in result["figures"]["round_trip"].items():
            print(f"{name:28s} median {p['median_us']:9.1f} us  p90 {p['p90_us']:9.1f} us  "
                  f"pool {p['pool_us']:9.1f} us")  # fmt: skip
        print(json.dumps(result["ratios"]))
