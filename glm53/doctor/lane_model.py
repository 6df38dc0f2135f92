"""The CPU lane's cost on a host that is described, not probed: a two-term model fitted on the
H200 test host's measured rates, carried to another host's cores and DRAM bandwidth.

Fit. The lane streams experts' trellis from DRAM through its threads. Each byte costs a core's
decode time and a share of the DRAM's read time, so n busy threads move

    1 / R(n) = 1 / (n c) + 1 / (s D)

GB/s, c the trellis one core decodes alone, D the host's measured DRAM read rate and s the share
of it the lane's access pattern reaches. Per instruction set, c and s are the least-squares fit
of 1/R against 1/n over one bench/micro_gemv.py run's thread sweep of that set's fast kernel on
the H200 host (issue 26, 2026-12-05, bench/results/h200-micro_gemv-2026-12-05.json: 1, 2, 4, 8
and 16 threads, DRAM read 73.3 GB/s measured in the same run). Five thread counts, not two:
a fit through one one-thread figure and one all-thread figure swung with the one-thread noise
(3.0 and 4.3 GB/s in two runs), and with 2026-12-05's pair it put s above 1. The sweep gives
c = 4.60 GB/s and s = 0.91 for AVX-512, c = 2.68 GB/s and s = 0.60 for AVX2: an AVX2 core
decodes 0.58 of an AVX-512 one (the model assumed 0.80 before, from a one-thread ratio on
2026-12-01 scaled by a later kernel speed-up measured on another host). The fit's residuals
are within +8 % and -11 % at every point (tests/test_doctor_host_file.py). Not measured on an
AVX2 host with many cores: the AVX2 figures are the AVX2 kernel on the H200 host's Xeon.

Job cost. a is the fixed cost of one lane job, from the H200 run's fitted cost model (14
threads, one row: a = 0.183 ms); b per expert grows with the rows a job carries, 17.7 % per
extra row (the same fit: b = 0.294 ms at one row, 0.449 at four)."""

from __future__ import annotations

import msgspec

from glm53.doctor.costmodel import expert_trellis_bytes

SWEEP_THREADS = (1, 2, 4, 8, 16)
SWEEP_GBPS = {  # the fast kernel's trellis GB/s at SWEEP_THREADS, per instruction set
    "avx512": (4.283, 8.390, 13.308, 23.177, 39.236),
    "avx2": (2.525, 4.819, 8.163, 14.231, 24.026),
}
SWEEP_DRAM_READ_GBPS = 73.31
FIT_SOURCE = (
    "H200 host, bench/micro_gemv.py fast kernels at 1-16 threads, 2026-12-05 (issue 26): "
    "avx512 4.28-39.2 GB/s, avx2 2.52-24.0 GB/s, DRAM read 73.3 GB/s"
)
LANE_A_MS = 0.183
ROW_COST = (0.449 / 0.294 - 1) / 3
RESERVED_CORES = 2  # the engine thread and the event loop, as the doctor's lane layout keeps


class LaneFit(msgspec.Struct, frozen=True):
    core_gbps: float  # c: one core alone
    dram_share: float  # s: of the host's measured DRAM read rate


def fit_sweep(threads, gbps, dram_gbps: float) -> LaneFit:
    """c and s from a thread sweep (rates `gbps` at `threads` busy threads) on a host of known
    DRAM read rate: the least-squares line of 1/R against 1/n."""
    import numpy as np

    n = np.asarray(threads, dtype=np.float64)
    r = np.asarray(gbps, dtype=np.float64)
    if n.shape != r.shape or len(n) < 2 or len(set(n.tolist())) < 2 or (r <= 0).any():
        raise ValueError(
            f"cannot fit the lane: need rates at two or more thread counts, got {gbps}"
        )
    inv_core, inv_dram = np.polyfit(1 / n, 1 / r, 1)
    if inv_core <= 0 or inv_dram <= 0:
        raise ValueError(
            f"cannot fit the lane: rates {gbps} at threads {threads} give no positive cost per "
            "core and per DRAM byte; measure the sweep again"
        )
    return LaneFit(core_gbps=float(1 / inv_core), dram_share=float(1 / (inv_dram * dram_gbps)))


FITS = {isa: fit_sweep(SWEEP_THREADS, g, SWEEP_DRAM_READ_GBPS) for isa, g in SWEEP_GBPS.items()}


def lane_gbps(threads: int, dram_read_gbps: float, isa: str, f: LaneFit | None = None) -> float:
    """Trellis GB/s of `threads` lane threads of instruction set `isa` on a host whose DRAM
    reads at dram_read_gbps (`f`: another fit than the H200 sweep's for `isa`)."""
    f = FITS[isa] if f is None else f
    return 1 / (1 / (threads * f.core_gbps) + 1 / (f.dram_share * dram_read_gbps))


def lane_ms(threads: int, dram_read_gbps: float, isa: str, bits: int = 3) -> tuple[float, float]:
    """(a, b) in ms for one row per expert: the job's fixed cost and one expert's trellis at
    lane_gbps."""
    b = expert_trellis_bytes(bits) / (lane_gbps(threads, dram_read_gbps, isa) * 1e6)
    return LANE_A_MS, b


def rows_factor(rows: float) -> float:
    """b at `rows` rows per expert over b at one row."""
    return 1 + ROW_COST * max(0.0, rows - 1)
