"""The CPU expert lane, Python side: which CPUs it runs on, expert tables built from EXL3 arrays,
the exact reference it is tested against, and the per-host cost model the planner reads.

The kernels and the pinned pool are native (`glm53._gemv`, pyx/gemv.h); this module only sets
them up. The lane computes routed experts in fp32 from the EXL3 trellis; `reference_moe` is the
same computation in fp64 from the numpy decoder. At precision "fast" the kernels skip the
codebook's fp16 rounding and use int16 inputs (pyx/gemv_fast.h); `reference_moe_fast` is that
computation in fp64, and `FAST_REL_TOL` bounds how far it may stray from the exact reference.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glm53 import _gemv
from glm53.errors import Glm53Error
from glm53.models.exl3 import MUL1_MULT, Exl3Weights, decode_states, tc_perm
from glm53.models.exl3 import _blocks as _hadamard_blocks

log = logging.getLogger(__name__)

SWIGLU_LIMIT = 10.0  # GLM-5.3-Flash swiglu_limit
RESERVED_CORES = 2  # left to the OS, the main thread and the host controller
SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
SYS_PCI = Path("/sys/bus/pci/devices")
# A batch of picks whose experts hold fewer weights than this (picks x 3 x hidden x inter) runs
# on the calling thread alone: about 0.5 ms of one core, against a worker's wake-up (tens of us
# on an idle host, a scheduler slice on a loaded one)
CALLER_ONLY_WEIGHTS = 1 << 21

VARIANTS = {_gemv.variant_name(v): v for v in _gemv.VARIANTS}
PRECISIONS = {_gemv.precision_name(p): p for p in _gemv.PRECISIONS}
# The fast lane's bound on one expert's output against the fp64 reference: max |error| over max
# |reference|. It measures 3e-4 to 4e-4 on random GLM-shaped experts (bench/micro_gemv.py's
# fast_max_rel_err). What fast mode must meet is tests/gpu/test_gemv_fast_gpu.py: an error no
# larger than exllamav3's GPU kernel's own on the same expert and input.
FAST_REL_TOL = 1e-3


class LaneConfigError(ValueError, Glm53Error):
    """A CPU lane setting (--cpus / GLM53_CT_CPUS, --cpu-threads / GLM53_CT_THREADS) that cannot
    be used; the message names the setting and the fix."""


# --- CPU layout --------------------------------------------------------------------------------


def parse_cpu_list(text: str) -> list[int]:
    """'2-5,8,10-11' -> [2, 3, 4, 5, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaneConfigError(
                f"--cpus {text!r}: {part!r} is not a CPU number or range like 2-23"
            )
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise LaneConfigError(f"--cpus {text!r}: range {part!r} runs backwards")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise LaneConfigError(f"--cpus {text!r} names no CPU; give a list like 2-23 or 0,2,4")
    if len(set(cpus)) != len(cpus):
        raise LaneConfigError(f"--cpus {text!r} names a CPU twice")
    return cpus


def core_cpus(allowed: set[int] | None = None) -> dict[int, tuple[int, ...]]:
    """Each physical core this process may run on: its lowest SMT sibling -> all its logical
    CPUs in the mask, in CPU order."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    of_core: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(allowed):
        topo = SYS_CPU / f"cpu{cpu}" / "topology"
        try:
            core = (
                (topo / "physical_package_id").read_text().strip(),
                (topo / "core_id").read_text().strip(),
            )
        except OSError:  # no sysfs topology (containers, odd kernels): every CPU is a core
            core = ("", str(cpu))
        of_core.setdefault(core, []).append(cpu)
    return {cpus[0]: tuple(cpus) for cpus in sorted(of_core.values())}


def physical_cores(allowed: set[int] | None = None) -> list[int]:
    """One logical CPU (the lowest SMT sibling) per physical core this process may run on, in
    CPU order."""
    return sorted(core_cpus(allowed))


@dataclass(frozen=True, slots=True)
class LaneLayout:
    """The CPUs the lane's workers are pinned to (one worker each), and how they were chosen.
    `reserved`: the logical CPUs (SMT siblings included) of the cores the lane leaves to the
    engine thread and the event loop (glm53.tiers.thread_pins); none when --cpus chose the
    lane's CPUs, or when the lane takes every core."""

    cpus: tuple[int, ...]
    note: str = ""
    reserved: tuple[int, ...] = ()

    @property
    def threads(self) -> int:
        return len(self.cpus)


def device_pci_address(device) -> str | None:
    """The CUDA device's PCI address in sysfs form (0000:3b:00.0), from torch's device
    properties; None where this torch does not give it."""
    import torch

    return pci_address_of(torch.cuda.get_device_properties(torch.device(device)))


def pci_address_of(props) -> str | None:
    """torch's CUDA device properties (pci_domain_id, pci_bus_id, pci_device_id) as a sysfs
    PCI address; None where one is missing."""
    parts = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
    if any(not isinstance(x, int) for x in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def gpu_node_cpus(pci_address: str | None) -> tuple[set[int] | None, str]:
    """The CPUs of the NUMA node of the GPU at `pci_address` (sysfs form, 0000:3b:00.0), and
    where that came from; None with the reason when sysfs does not say (no address, a
    container without /sys, numa_node -1 on a one-node host)."""
    if not pci_address:
        return None, "the GPU's PCI address is unknown"
    try:
        node = int((SYS_PCI / pci_address / "numa_node").read_text().strip())
        if node < 0:
            return None, f"sysfs gives no NUMA node for GPU {pci_address}"
        listed = (SYS_NODE / f"node{node}" / "cpulist").read_text().strip()
    except (OSError, ValueError):
        return None, f"sysfs gives no NUMA node for GPU {pci_address}"
    try:
        return set(parse_cpu_list(listed)), f"NUMA node {node}, GPU {pci_address}'s"
    except LaneConfigError:
        return None, f"node {node}'s cpulist {listed!r} does not parse"


def lane_layout(
    cpus: str | None = None, threads: int | None = None, gpu_pci: str | None = None
) -> LaneLayout:
    """Resolve --cpus / --cpu-threads (Settings.cpus, Settings.cpu_threads) into a layout.

    Default: one worker per physical core except the first two, on the NUMA node of the GPU at
    `gpu_pci` when sysfs names it (threads on a far node would read the pinned experts across
    the interconnect; glm53.doctor.inputs.lane_layout plans the same). With fewer than three
    cores that leaves none: the lane then runs one worker on the last core, and the note says
    so. --cpus, and --cpu-threads (which may take the reserved cores too), are taken over the
    whole affinity mask, as validated before the load."""
    allowed = set(os.sched_getaffinity(0))
    where = ""
    if cpus is None and threads is None and gpu_pci is not None:
        near, why = gpu_node_cpus(gpu_pci)
        if near and near & allowed:
            allowed &= near
            where = f", on {why}"
        else:
            where = f", on every node ({why})" if near is None else (
                f", on every node ({why} has no CPU this process may run on)")  # fmt: skip
    if threads is not None and threads < 1:
        raise LaneConfigError(f"--cpu-threads {threads}: the lane needs at least 1 thread")
    if cpus is not None:
        listed = parse_cpu_list(cpus)
        outside = sorted(set(listed) - allowed)
        if outside:
            raise LaneConfigError(
                f"--cpus {cpus}: CPUs {outside} are outside this process's affinity mask "
                f"{_cpu_list_text(sorted(allowed))}; choose CPUs inside it (GLM53_CT_CPUS)"
            )
        if threads is not None and threads > len(listed):
            raise LaneConfigError(
                f"--cpu-threads {threads} exceeds the {len(listed)} CPUs of --cpus {cpus}; "
                "list more CPUs or ask for fewer threads"
            )
        return LaneLayout(tuple(listed[: threads or len(listed)]), "from --cpus")
    siblings = core_cpus(allowed)
    cores = sorted(siblings)
    lane = cores[RESERVED_CORES:]

    def left(taken) -> tuple[int, ...]:  # the reserved cores' CPUs, but for cores the lane took
        return tuple(sorted(c for core in cores[:RESERVED_CORES] if core not in taken
                            for c in siblings[core]))  # fmt: skip

    if threads is not None:
        if threads > len(cores):
            raise LaneConfigError(
                f"--cpu-threads {threads} exceeds the {len(cores)} physical cores available; "
                "list CPUs with --cpus to use SMT siblings"
            )
        pool = lane + cores[:RESERVED_CORES]  # reserved cores last
        note = "" if threads <= len(lane) else "shares the reserved cores"
        return LaneLayout(tuple(pool[:threads]), note, left(pool[:threads]))
    if not lane:
        note = (
            f"only {len(cores)} physical core(s): the CPU lane runs 1 thread on cpu {cores[-1]}, "
            "sharing it with the OS and the controller"
        )
        log.warning(note)
        return LaneLayout((cores[-1],), note + where, left({cores[-1]}))
    note = f"every physical core but the first {RESERVED_CORES}{where}"
    return LaneLayout(tuple(lane), note, left(()))


def _cpu_list_text(cpus: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


# --- experts -----------------------------------------------------------------------------------

Expert = tuple[Exl3Weights, Exl3Weights, Exl3Weights]  # gate, up, down


def expert_table(experts: Sequence[Expert]) -> _gemv.ExpertTable:
    """An ExpertTable pointing at the arrays of `experts` (no copy). All must be mul1 at one
    bitrate, gate/up `hidden -> inter` and down `inter -> hidden`."""
    if not experts:
        raise ValueError("expert_table: no experts")
    gate = experts[0][0]
    hidden, inter, k2 = gate.in_features, gate.out_features, gate.k2
    table = _gemv.ExpertTable(len(experts), hidden, inter, k2)
    for index, linears in enumerate(experts):
        for name, lin in zip(("gate", "up", "down"), linears, strict=True):
            if lin.codebook != "mul1":
                raise ValueError(
                    f"expert {index} {name}: the CPU lane decodes the mul1 codebook only, this "
                    f"linear uses {lin.codebook}; serve it from the GPU"
                )
            if lin.k2 != k2:
                raise ValueError(
                    f"expert {index} {name}: {lin.bits} bits per weight, expert 0 has {k2 / 2}; "
                    "one table holds one bitrate"
                )
            if lin.bias is not None:
                raise ValueError(f"expert {index} {name}: biased experts are not supported")
        table.set(index, *((lin.trellis, lin.suh, lin.svh) for lin in linears))
    return table


def swiglu(g: np.ndarray, u: np.ndarray, limit: float = SWIGLU_LIMIT) -> np.ndarray:
    """GLM's clamped SwiGLU, silu(min(g, L)) * clamp(u, -L, L); L = 0 means no clamp.

    (exllamav3's CPU kernel caps silu(g) at L instead; the two differ only where g > L.)"""
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return g / (1.0 + np.exp(-g)) * u


def reference_moe(
    x: np.ndarray,
    rows: Sequence[int],
    expert_ids: Sequence[int],
    weights: Sequence[float],
    experts: Sequence[Expert],
    act_limit: float = SWIGLU_LIMIT,
) -> np.ndarray:
    """What the lane computes, in fp64 from the numpy decoder: `[num_rows, hidden]`."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    inner: dict[int, tuple[np.ndarray, ...]] = {}
    for r, e, w in zip(rows, expert_ids, weights, strict=True):
        if e not in inner:  # decode each expert once
            inner[e] = tuple(lin.inner_weight().astype(np.float64) for lin in experts[e])
        gate, up, down = experts[e]
        wg, wu, wd = inner[e]
        g = gate.apply(x[r], inner=wg)
        u = up.apply(x[r], inner=wu)
        out[r] += w * down.apply(swiglu(g, u, act_limit), inner=wd)
    return out


def _quantise_blocks(xh: np.ndarray) -> np.ndarray:
    """The fast kernels' int16 step (gemv_fast.h), dequantised, per 128-block of the last axis."""
    b = xh.astype(np.float32).reshape(*xh.shape[:-1], -1, 128)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * (np.float32(16383) / safe))
    scale = np.where(amax > 0, safe / np.float32(16383), np.float32(0))
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(xh.shape)


def _unrounded_inner(lin: Exl3Weights) -> np.ndarray:
    """Wq `[k, n]` fp64 from the mul1 codebook without its fp16 rounding: KINV * s + C0."""
    t = lin.trellis
    kt, nt, _ = t.shape
    x = decode_states(t).astype(np.uint32) * np.uint32(MUL1_MULT)
    s = sum((x >> np.uint32(b)) & np.uint32(0xFF) for b in (0, 8, 16, 24)).astype(np.float64)
    tiles = np.empty((kt, nt, 256))
    tiles[:, :, tc_perm()] = s * (1774 / 2**18) - 3.453125
    return tiles.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(16 * kt, 16 * nt)


def _apply_fast(lin: Exl3Weights, x: np.ndarray, inner: np.ndarray) -> np.ndarray:
    xh = _quantise_blocks(_hadamard_blocks(x * lin.suh.astype(np.float64), -1))
    return _hadamard_blocks(xh @ inner, -1) * lin.svh.astype(np.float64)


def reference_moe_fast(
    x: np.ndarray,
    rows: Sequence[int],
    expert_ids: Sequence[int],
    weights: Sequence[float],
    experts: Sequence[Expert],
    act_limit: float = SWIGLU_LIMIT,
) -> np.ndarray:
    """What the lane computes at precision "fast", in fp64: the same MoE as `reference_moe` with
    the unrounded codebook and the int16 steps of pyx/gemv_fast.h."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    inner: dict[int, tuple[np.ndarray, ...]] = {}
    for r, e, w in zip(rows, expert_ids, weights, strict=True):
        if e not in inner:
            inner[e] = tuple(_unrounded_inner(lin) for lin in experts[e])
        gate, up, down = experts[e]
        g = _apply_fast(gate, x[r], inner[e][0])
        u = _apply_fast(up, x[r], inner[e][1])
        out[r] += w * _apply_fast(down, swiglu(g, u, act_limit), inner[e][2])
    return out


def lane_precision(setting: str, engine: str, mode: str) -> str:
    """The lane's precision for --ct-precision `setting` ("auto", "exact" or "fast") in an
    engine ("cpu", "gpu") and tier mode: auto is fast only where the GPU engine's mode runs the
    lane beside the GPU (fast, nvme), whose results are held to the GPU kernel's error."""
    if setting not in ("auto", *PRECISIONS):
        raise LaneConfigError(
            f"--ct-precision {setting!r} is not one of auto, {', '.join(PRECISIONS)}"
        )
    if setting != "auto":
        return setting
    return "fast" if engine == "gpu" and mode in ("fast", "nvme") else "exact"


def kernel_name(variant: int, precision: int) -> str:
    """'avx2', 'avx2 fast', ...: the variant's tile kernel at that precision."""
    if precision == _gemv.EXACT:
        return _gemv.variant_name(variant)
    if variant == _gemv.AVX512_FP16:
        variant = _gemv.AVX512
    return f"{_gemv.variant_name(variant).split()[0]} fast"


# --- the lane ----------------------------------------------------------------------------------


class CpuLane:
    """The pinned worker pool and the kernel variant it runs. Thread-safe: jobs queue in C."""

    def __init__(
        self,
        layout: LaneLayout | None = None,
        variant: str | int = "best",
        precision: str | int = "exact",
    ):
        self.layout = layout or lane_layout()
        if isinstance(precision, str):
            if precision not in PRECISIONS:
                raise LaneConfigError(
                    f"lane precision {precision!r} is not one of {', '.join(PRECISIONS)}"
                )
            precision = PRECISIONS[precision]
        elif precision not in _gemv.PRECISIONS:
            raise LaneConfigError(f"lane precision {precision} is not one of {_gemv.PRECISIONS}")
        if isinstance(variant, str):
            if variant == "best":
                variant = _gemv.best_variant()
            elif variant in VARIANTS:
                variant = VARIANTS[variant]
            else:
                raise LaneConfigError(
                    f"kernel variant {variant!r} is not one of best, {', '.join(VARIANTS)}"
                )
        if not _gemv.variant_supported(variant):
            raise LaneConfigError(
                f"this CPU cannot run the {_gemv.variant_name(variant)} kernels; "
                f"it runs {_gemv.variant_name(_gemv.best_variant())}"
            )
        self.variant = variant
        self.precision = precision
        self.pool = _gemv.Pool(self.layout.threads, self.layout.cpus)

    @property
    def variant_name(self) -> str:
        return _gemv.variant_name(self.variant)

    @property
    def precision_name(self) -> str:
        return _gemv.precision_name(self.precision)

    @property
    def kernel_name(self) -> str:
        """The tile kernel it runs, e.g. 'avx2 fast' (the avx512-fp16 variant's fast kernel is
        the avx512 one)."""
        return kernel_name(self.variant, self.precision)

    def describe(self) -> str:
        cpus = _cpu_list_text(sorted(self.layout.cpus))
        note = f" ({self.layout.note})" if self.layout.note else ""
        return (
            f"CPU lane: {self.variant_name} {self.precision_name}, {self.layout.threads} "
            f"thread(s) on cpus {cpus}{note}"
        )

    def run(self, table, x, rows, expert_ids, weights, out=None, act_limit=SWIGLU_LIMIT):
        """MoE output rows (float32 [num_rows, hidden]) for the picks, computed on the lane."""
        return self.pool.run(
            table,
            x,
            rows,
            expert_ids,
            weights,
            out,
            variant=self.variant,
            act_limit=act_limit,
            precision=self.precision,
        )

    def run_picks(self, table, x, rows, expert_ids, weights, dest, out, act_limit=SWIGLU_LIMIT):
        """out[dest[i]] = weights[i] * expert(expert_ids[i])(x[rows[i]]) for every pick, as one
        native batch (see _gemv.Pool.run_picks); returns the number of jobs.

        The calling thread always takes part: a batch smaller than CALLER_ONLY_WEIGHTS (a decode
        step's few experts) runs on it alone, since waking a worker costs more than such a
        batch's work; a larger one is shared with the pool's workers."""
        work = len(rows) * 3 * table.hidden * table.inter
        caller = _gemv.CALLER_RUNS_ALL if work < CALLER_ONLY_WEIGHTS else _gemv.CALLER_HELPS
        return self.pool.run_picks(
            table,
            x,
            rows,
            expert_ids,
            weights,
            dest,
            out,
            variant=self.variant,
            act_limit=act_limit,
            caller=caller,
            precision=self.precision,
        )


# --- cost model ---------------------------------------------------------------------------------


@dataclass(slots=True)
class LaneCost:
    """Measured lane time per job, `a_ms + b_ms * experts`, for each (threads, rows), where every
    expert of the job is picked by `rows` rows (decoded once, applied to each)."""

    variant: str
    bits: float
    fits: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    samples: list[tuple[int, int, int, float]] = field(default_factory=list)  # threads, rows, E, ms

    def ms(self, threads: int, rows: int, experts: int) -> float:
        a, b = self.fits[(threads, rows)]
        return a + b * experts


def random_expert(rng: np.random.Generator, hidden: int, inter: int, bits: float = 3) -> Expert:
    """A mul1 expert with uniform random trellis and scales near 1, like a synthetic checkpoint's."""
    k2 = int(round(2 * bits))

    def linear(k: int, n: int) -> Exl3Weights:
        trellis = rng.integers(-(2**15), 2**15, (k // 16, n // 16, 8 * k2), dtype=np.int16)
        suh = (rng.choice([-1.0, 1.0], k) * rng.uniform(0.01, 0.02, k)).astype(np.float16)
        svh = rng.uniform(0.5, 1.0, n).astype(np.float16)
        return Exl3Weights(trellis, suh, svh, "mul1")

    return linear(hidden, inter), linear(hidden, inter), linear(inter, hidden)


def calibrate(
    thread_counts: Sequence[int] | None = None,
    rows: Sequence[int] = tuple(range(1, 9)),
    expert_counts: Sequence[int] = (1, 2, 4, 8),
    hidden: int = 4096,
    inter: int = 2048,
    bits: float = 3,
    layout: LaneLayout | None = None,
    variant: str | int = "best",
    pool_bytes: int = 1 << 30,
    repeats: int = 3,
    seed: int = 0,
    precision: str | int = "exact",
) -> LaneCost:
    """Measure the lane on this host and fit `a + b * experts` (ms) per thread count and rows.

    Experts are random GLM-5.3-Flash-shaped mul1 experts; `pool_bytes` of them (more than a
    last-level cache) are cycled through so every job reads its trellis from DRAM, as the lane
    does in service."""
    rng = np.random.default_rng(seed)
    one = random_expert(rng, hidden, inter, bits)
    expert_bytes = sum(lin.trellis.nbytes for lin in one)
    num = max(max(expert_counts), min(256, pool_bytes // expert_bytes))
    experts = [one] + [random_expert(rng, hidden, inter, bits) for _ in range(num - 1)]
    return measure_cost(
        expert_table(experts),
        layout,
        thread_counts,
        rows,
        expert_counts,
        variant,
        repeats,
        seed,
        precision,
    )


def measure_cost(
    table: _gemv.ExpertTable,
    layout: LaneLayout | None = None,
    thread_counts: Sequence[int] | None = None,
    rows: Sequence[int] = tuple(range(1, 9)),
    expert_counts: Sequence[int] = (1, 2, 4, 8),
    variant: str | int = "best",
    repeats: int = 3,
    seed: int = 0,
    precision: str | int = "exact",
) -> LaneCost:
    """`calibrate` on the experts of `table`, visited in turn (each point: best of `repeats`)."""
    layout = layout or lane_layout()
    thread_counts = list(thread_counts or _default_thread_counts(layout.threads))
    x = np.random.default_rng(seed).standard_normal((max(rows), table.hidden)).astype(np.float32)
    cost = LaneCost(variant="", bits=table.k2 / 2)
    cursor = 0
    for threads in thread_counts:
        lane = CpuLane(LaneLayout(layout.cpus[:threads]), variant, precision)
        cost.variant = lane.kernel_name
        for m in rows:
            points = []
            for count in expert_counts:
                if count * m > _gemv.MAX_PICKS:
                    continue
                best = float("inf")
                for _ in range(repeats):
                    ids = [(cursor + i) % table.num_experts for i in range(count)]
                    cursor += count
                    r_ids = [r for _ in ids for r in range(m)]
                    e_ids = [e for e in ids for _ in range(m)]
                    weights = np.full(len(r_ids), 0.125, np.float32)
                    start = time.perf_counter()
                    lane.run(table, x[:m], r_ids, e_ids, weights)
                    best = min(best, (time.perf_counter() - start) * 1e3)
                points.append((count, best))
                cost.samples.append((threads, m, count, best))
            if len(points) >= 2:
                b, a = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
                cost.fits[(threads, m)] = (float(a), float(b))
        del lane
    return cost


def _default_thread_counts(max_threads: int) -> list[int]:
    counts = [1]
    while counts[-1] * 2 < max_threads:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_threads:
        counts.append(max_threads)
    return counts
