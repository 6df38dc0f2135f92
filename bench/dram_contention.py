"""Host DRAM shared by the GPU's reads over PCIe and the CPU lane's: each alone, then both at once.

    python bench/dram_contention.py [--json] [--seconds 3] [--gpu-mb 2048] [--pool-experts 96]
                                    [--cpus LIST]

Why (issue 26): fast mode sends some of a layer's VRAM misses to the CPU lane so that they are
read from DRAM by the CPU while the GPU reads the rest over PCIe. That gains only if the two
reads add up: if the host's DRAM cannot feed both at full rate, each slows the other and the lane
saves nothing whatever the router does. On the H200 host the lane alone reads about 37 GB/s of
trellis (micro_gemv, 2026-12-05) and the GPU about 50 GB/s over PCIe; nothing measured says
whether DRAM feeds both at once. This bench does, on any host with a CUDA GPU:

- `gpu_zero_copy`: a GPU reduction reads a pinned host buffer larger than the last-level cache
  through its device mapping (how exact mode's MoE kernels read a miss);
- `gpu_dma`: the same buffer copied to VRAM by the copy engine (how prefill staging reads);
- `lane`: the CPU lane's kernel (the fast precision, as `--mode fast` runs it) on jobs of 8
  random GLM-5.3-Flash-shaped experts from a pool larger than the last-level cache, back to back;
- `together_zero_copy` and `together_dma`: the lane's loop on its own thread and the GPU's loop
  at once, for the same time.

Figures: GB/s of each, alone and together (the lane's as trellis bytes read). Ratios:
`gpu_zero_copy_together_vs_alone`, `lane_together_vs_alone_zero_copy` (and the dma pair), and
`sum_together_vs_best_alone_zero_copy` (the two rates together over the faster one alone: 1.0
means DRAM gives no more to two readers than to one, so a lane share cannot gain; near the sum of
both alone over the faster, they add). The threads are pinned as the server pins them: the lane's
workers to its cores, the GPU's launching thread and the lane's driving thread to the cores the
layout leaves. Without a GPU the lane is measured alone and the GPU figures are null, with the
reason in `config.gpu`.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
from benchlib import host_fields

from glm53.tiers.cpu_lane import CpuLane, LaneLayout, expert_table, lane_layout, random_expert
from glm53.tiers.thread_pins import pin_thread

HIDDEN, INTER, TOP_K = 4096, 2048, 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--seconds", type=float, default=3.0, help="time of each phase")
    p.add_argument("--gpu-mb", type=int, default=2048, help="pinned buffer the GPU reads, MiB")
    p.add_argument("--pool-experts", type=int, default=96,
                   help="experts the lane walks (96 of this shape: about 0.9 GB)")  # fmt: skip
    p.add_argument("--cpus", default=None, help="the lane's CPUs (default: the server's layout)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)  # CI: small
    p.add_argument("--inter", type=int, default=INTER, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.gpu_mb < 1 or args.pool_experts < TOP_K:
        p.error(f"--seconds > 0, --gpu-mb >= 1 and --pool-experts >= {TOP_K}")
    return args


def reduce_into(torch, src, out) -> None:
    """Sum the 1-D `src` into the 0-d `out` without allocating: every element read once. (torch
    takes `out=` only with `dim`; without it the first H200 run on 2026-12-05 raised TypeError.)"""
    torch.sum(src, dim=0, out=out)


class GpuReader:
    """The GPU's side: `step()` queues one read of the whole pinned buffer and returns its bytes;
    `sync()` waits for every queued read."""

    def __init__(self, nbytes: int, how: str):
        import torch

        from glm53 import _cuda
        from glm53.tiers.vram_cache import _uva_tensor

        self.torch, self.how, self.nbytes = torch, how, nbytes
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host.view(torch.int32).random_()  # every page touched, not zeros
        if how == "zero_copy":  # the device's mapping of the pinned pages: SM loads over PCIe
            dev_ptr = _cuda.host_device_pointer(self.host.data_ptr())
            self.src = _uva_tensor(dev_ptr, nbytes, "cuda").view(torch.float32)
            self.out = torch.empty((), dtype=torch.float32, device="cuda")
        else:  # the copy engine
            self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def step(self) -> int:
        if self.how == "zero_copy":
            reduce_into(self.torch, self.src, self.out)
        else:
            self.dst.copy_(self.host, non_blocking=True)
        return self.nbytes

    def sync(self) -> None:
        self.torch.cuda.synchronize()


def gpu_rate(reader: GpuReader, seconds: float, stop: threading.Event | None = None) -> float:
    """GB/s of the reader over about `seconds` (one read first, untimed)."""
    reader.step()
    reader.sync()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            done += reader.step()
        reader.sync()
    elapsed = time.perf_counter() - t0
    if stop is not None:
        stop.set()
    return done / elapsed / 1e9


class LaneLoop:
    """The lane's side: jobs of TOP_K experts walking the pool, back to back on the lane's pool
    (CpuLane.run: the calling thread waits while the workers compute)."""

    def __init__(self, cpu: CpuLane, table, record_bytes: int, pool_n: int, hidden: int, rng):
        self.cpu, self.table, self.record_bytes, self.pool_n = cpu, table, record_bytes, pool_n
        self.x = rng.standard_normal((1, hidden)).astype(np.float16).astype(np.float32)
        self.rows = np.zeros(TOP_K, dtype=np.int32)
        self.weights = np.full(TOP_K, 1.0 / TOP_K, dtype=np.float32)
        self.next = 0

    def job(self) -> int:
        experts = (self.next + np.arange(TOP_K, dtype=np.int32)) % self.pool_n
        self.next = (self.next + TOP_K) % self.pool_n
        self.cpu.run(self.table, self.x, self.rows, experts, self.weights)
        return TOP_K * self.record_bytes

    def rate(self, seconds: float, stop: threading.Event | None = None) -> float:
        """GB/s of trellis over about `seconds`, or until `stop` is set (the GPU's phase ended)."""
        self.job()  # untimed: wakes the workers
        t0, done = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
            done += self.job()
        return done / (time.perf_counter() - t0) / 1e9


def together(reader: GpuReader, lane: LaneLoop, seconds: float, reserved) -> tuple[float, float]:
    """(GPU GB/s, lane GB/s) with both loops running at once: the lane's on a thread of its own
    (pinned as the GPU's thread is), started first so that both run over the GPU's whole phase."""
    out: dict = {}
    stop, started = threading.Event(), threading.Event()

    def drive():
        if reserved:
            pin_thread("lane_driver", threading.get_native_id(), reserved)
        lane.job()
        started.set()
        out["lane"] = lane.rate(seconds * 2, stop)  # until the GPU's phase ends

    t = threading.Thread(target=drive, name="glm53-lane-driver")
    t.start()
    started.wait()
    gpu = gpu_rate(reader, seconds, stop)
    t.join()
    return gpu, out["lane"]


def ratio(a, b):
    return a / b if a and b else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    layout = LaneLayout(tuple(int(c) for c in args.cpus.split(","))) if args.cpus else lane_layout()
    reserved = layout.reserved
    if reserved:  # the GPU's launching thread as the server's engine thread
        pin_thread("engine", threading.get_native_id(), reserved)
    cpu = CpuLane(layout, precision="fast")
    rng = np.random.default_rng(args.seed)
    experts = [random_expert(rng, args.hidden, args.inter) for _ in range(args.pool_experts)]
    record = sum(lin.trellis.nbytes for lin in experts[0])
    lane = LaneLoop(cpu, expert_table(experts), record, args.pool_experts, args.hidden, rng)
    figures: dict = {"lane_alone_gbps": lane.rate(args.seconds)}
    gpu_note = "measured"
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: the GPU's reads are not measured")
    except (ImportError, RuntimeError) as exc:
        gpu_note = str(exc)
    ratios: dict = {}
    for how in ("zero_copy", "dma"):
        if gpu_note != "measured":
            figures |= {f"gpu_{how}_alone_gbps": None, f"together_{how}": None}
            ratios |= {f"gpu_{how}_together_vs_alone": None,
                       f"lane_together_vs_alone_{how}": None,
                       f"sum_together_vs_best_alone_{how}": None}  # fmt: skip
            continue
        reader = GpuReader(args.gpu_mb << 20, how)
        alone = gpu_rate(reader, args.seconds)
        g, c = together(reader, lane, args.seconds, reserved)
        figures[f"gpu_{how}_alone_gbps"] = alone
        figures[f"together_{how}"] = {"gpu_gbps": g, "lane_gbps": c, "sum_gbps": g + c}
        ratios[f"gpu_{how}_together_vs_alone"] = ratio(g, alone)
        ratios[f"lane_together_vs_alone_{how}"] = ratio(c, figures["lane_alone_gbps"])
        ratios[f"sum_together_vs_best_alone_{how}"] = ratio(
            g + c, max(alone, figures["lane_alone_gbps"])
        )
        del reader
    result = {
        "bench": "dram_contention",
        "figures": figures,
        "ratios": ratios,
        "config": {
            **host_fields(),
            "seconds": args.seconds,
            "gpu_buffer_mb": args.gpu_mb,
            "gpu": gpu_note,
            "lane": {
                "cpus": list(layout.cpus),
                "reserved": list(reserved),
                "kernel": cpu.kernel_name,
                "precision": "fast",
                "experts_per_job": TOP_K,
                "pool_experts": args.pool_experts,
                "record_bytes": record,
                "shape": [args.hidden, args.inter],
            },  # fmt: skip
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        json.dump(result, sys.stdout, indent=2)
        print()
    return result


if __name__ == "__main__":
    main()
