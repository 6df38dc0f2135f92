"""The CPU lane's cost on a host that is described, not probed: a two-term model fitted on the
H200 test host's measured rates, carried to another host's cores and DRAM bandwidth.

Fit. The lane streams experts' trellis from DRAM through its threads. Each byte costs a core's
decode time and a share of the DRAM's read time, so n busy threads move

    1 / R(n) = 1 / (n c) + 1 / (s D)

GB/s, c the trellis one core decodes alone, D the host's measured DRAM read rate and s the share
of it the lane's access pattern reaches. The two H200 figures of one bench/micro_gemv.py run
(issue 26, 2026-12-02, the AVX-512 fast kernel) fix c and s: 3.0 GB/s on one thread, 25.9 GB/s
with all 16 threads busy (1.62 GB/s each), DRAM read 69.3 GB/s measured in the same run.

An AVX2-only host's cores decode slower. On the H200 host (bench/results/
h200-micro_gemv-2026-12-01.json) the AVX2 fast kernel did 1.905 GB/s on one thread against
3.737 for the AVX-512 fast one; the AVX2 kernel went 1.561x faster since (the kernel alone,
m = 1, cold, bench/results/cpu-amd-micro_gemv-2026-12-02-avx2fast.json), so c is scaled by
1.905 / 3.737 x 1.561. Not measured on an AVX2 host with many cores.

Job cost. a is the fixed cost of one lane job, from the H200 run's fitted cost model (14
threads, one row: a = 0.183 ms); b per expert grows with the rows a job carries, 17.7 % per
extra row (the same fit: b = 0.294 ms at one row, 0.449 at four)."""

from __future__ import annotations

import msgspec

from glm53.doctor.costmodel import expert_trellis_bytes

FIT_ONE_THREAD_GBPS = 3.0
FIT_THREADS = 16
FIT_ALL_THREADS_GBPS = 25.9
FIT_DRAM_READ_GBPS = 69.3
FIT_SOURCE = (
    "H200 host, bench/micro_gemv.py avx512 fast, 2026-12-02 (issue 26): 3.0 GB/s on 1 thread, "
    "25.9 GB/s on 16, DRAM read 69.3 GB/s"
)
AVX2_CORE_RATIO = 1.905 / 3.737 * 1.561
LANE_A_MS = 0.183
ROW_COST = (0.449 / 0.294 - 1) / 3
RESERVED_CORES = 2  # the engine thread and the event loop, as the doctor's lane layout keeps


class LaneFit(msgspec.Struct, frozen=True):
    core_gbps: float  # c: one core alone
    dram_share: float  # s: of the host's measured DRAM read rate


def fit(
    one_gbps: float = FIT_ONE_THREAD_GBPS,
    threads: int = FIT_THREADS,
    all_gbps: float = FIT_ALL_THREADS_GBPS,
    dram_gbps: float = FIT_DRAM_READ_GBPS,
) -> LaneFit:
    """c and s from a one-thread and an all-thread rate on a host of known DRAM read rate."""
    if threads < 2 or not one_gbps < all_gbps < threads * one_gbps:
        raise ValueError(
            f"cannot fit the lane: {all_gbps} GB/s on {threads} threads must lie between "
            f"{one_gbps} (one thread) and {threads * one_gbps} (no sharing)"
        )
    inv_core = (1 / one_gbps - 1 / all_gbps) / (1 - 1 / threads)
    return LaneFit(core_gbps=1 / inv_core, dram_share=1 / ((1 / one_gbps - inv_core) * dram_gbps))


H200_FIT = fit()


def lane_gbps(threads: int, dram_read_gbps: float, isa: str, f: LaneFit = H200_FIT) -> float:
    """Trellis GB/s of `threads` lane threads on a host whose DRAM reads at dram_read_gbps."""
    core = f.core_gbps * (AVX2_CORE_RATIO if isa == "avx2" else 1.0)
    return 1 / (1 / (threads * core) + 1 / (f.dram_share * dram_read_gbps))


def lane_ms(threads: int, dram_read_gbps: float, isa: str, bits: int = 3) -> tuple[float, float]:
    """(a, b) in ms for one row per expert: the job's fixed cost and one expert's trellis at
    lane_gbps."""
    b = expert_trellis_bytes(bits) / (lane_gbps(threads, dram_read_gbps, isa) * 1e6)
    return LANE_A_MS, b


def rows_factor(rows: float) -> float:
    """b at `rows` rows per expert over b at one row."""
    return 1 + ROW_COST * max(0.0, rows - 1)
