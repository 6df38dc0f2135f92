"""Fast mode's GPU <-> CPU-lane hand-off, host side: the mailboxes and the lane that serves them.

A `Mailbox` is one MoE layer-slot's page-aligned host buffer in the layout of
pyx/lane_mailbox.h (header, picks, fp32 input rows, fp32 partial, done word); `MailboxLane` binds
one mailbox per layer to that layer's expert table and runs the native poller (glm53._lane) on a
`CpuLane`'s pool. The device side (cuda/lane.cu: publish, bounded wait + combine, select) reads
and writes the same bytes through their UVA address once the GPU path registers them
(`pin`). That device side ran on an H200: tests/gpu/test_lane_mailbox_gpu.py passed on
2026-12-02 and again on 2026-12-05. tests/test_lane_mailbox.py drives the lane through the same
protocol from a host thread that mocks the device, in CI.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from glm53 import _gemv, _lane
from glm53.errors import BuildMismatch
from glm53.tiers.cpu_lane import SWIGLU_LIMIT, CpuLane

# How long the lane stays awake after a job (the poller and the pool's workers alike) before it
# sleeps. A decode step's MoE layers come 1-2 ms apart, so a shorter spin makes every job after
# a layer without one pay the wake: on the H200 host (14 threads, one decode row) a one-expert job
# took 325 us right after the last and 720-837 us after a 0.5-4 ms gap at a 200 us spin, and
# 310-370 us after any of those gaps at 5 ms; fast mode's fixed-split sweep went from 116.7 to
# 140.2 tok/s at 10 % of the misses on the lane, fallbacks from 30 to 0
# (bench/results/h200-lane_latency-2026-12-05.json, h200-gpu_slice-fast-spin-2026-12-05.json).
# The lane sleeps again 5 ms after a step's last job: between requests it holds no core.
IDLE_SPIN_NS = 5_000_000
PICK_DTYPE = np.dtype([("row", "<i4"), ("expert", "<i4"), ("weight", "<f4")])
MAX_ROWS = _lane.MAX_ROWS
MAX_PICKS = _lane.MAX_PICKS
# cuda/lane_cuda.h's g53_lane_dev, in declaration order: the device state of one layer-slot
LANE_DEV_FIELDS = [
    ("mbox", "<u8"),
    ("seq", "<u4"),
    ("pending", "<i4"),
    ("timed_out", "<i4"),
    ("n_sel", "<i4"),
    ("published", "<u8"),
    ("lane_picks", "<u8"),
    ("fallbacks", "<u8"),
]


@dataclass(slots=True)
class LayerReport:
    """One layer's report between two decode steps (MailboxLane.take_reports)."""

    n_hit: int  # the last decode call's distinct VRAM-cache hits and misses (0, 0: no call)
    n_miss: int
    # rows per distinct expert that call sent to the lane (empty: it published nothing)
    sent_rows: list[int] = field(default_factory=list)
    job_rows: list[int] = field(default_factory=list)  # rows per expert of the lane's newest job
    job_ms: float = 0.0  # that job's time (job_rows empty: no job finished since the last report)


def expert_rows(picks: np.ndarray) -> list[int]:
    """Rows per distinct expert of a mailbox's picks, in first-pick order."""
    counts: dict[int, int] = {}
    for e in picks["expert"].tolist():
        counts[e] = counts.get(e, 0) + 1
    return list(counts.values())


def lane_dev_dtype(layout: Sequence[int]) -> np.dtype:
    """g53_lane_dev as a numpy dtype at the offsets the CUDA library reports (its
    `_cuda.lane_dev_layout()`: offsets, then the size)."""
    if len(layout) != len(LANE_DEV_FIELDS) + 1:
        raise BuildMismatch(
            f"the CUDA library's g53_lane_dev has {len(layout) - 1} fields, this glm53 expects "
            f"{len(LANE_DEV_FIELDS)}: rebuild glm53 (pip install -e . or reinstall the package)"
        )
    return np.dtype(
        {
            "names": [n for n, _ in LANE_DEV_FIELDS],
            "formats": [f for _, f in LANE_DEV_FIELDS],
            "offsets": list(layout[:-1]),
            "itemsize": layout[-1],
        }
    )


class Mailbox:
    """One layer-slot's mailbox: `hidden`-wide rows, in its own anonymous mapping (page aligned,
    so cudaHostRegister can pin it as it is). Views name the sections; `addr` is the host
    address the native lane and the device (through UVA) use."""

    def __init__(self, hidden: int):
        self.hidden = hidden
        self.layout = _lane.layout(hidden)
        nbytes = self.layout["bytes"]
        self._map = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)[:nbytes]
        self.addr = self.buf.ctypes.data
        self.device_addr: int | None = None  # set by pin()
        lay = self.layout
        self.header = self.buf[: lay["n_miss"] + 4].view(np.int32)  # seq, n_picks, ...
        self.picks = self.buf[lay["picks"] : lay["picks"] + MAX_PICKS * PICK_DTYPE.itemsize].view(
            PICK_DTYPE
        )
        self.rows = self.buf[lay["rows"] : lay["partial"]].view(np.float32).reshape(MAX_ROWS, -1)
        self.partial = self.buf[lay["partial"] :].view(np.float32).reshape(MAX_ROWS, -1)

    def word(self, name: str) -> int:
        """Host address of a uint32 field (seq, done, status, budget, ...)."""
        return self.addr + self.layout[name]

    def load(self, name: str) -> int:
        return _lane.load_acquire(self.word(name))

    def store(self, name: str, value: int) -> None:
        _lane.store_release(self.word(name), value)

    @property
    def seq(self) -> int:
        return self.load("seq")

    @property
    def done(self) -> int:
        return self.load("done")

    @property
    def status(self) -> int:
        return int(self.buf[self.layout["status"] : self.layout["status"] + 4].view(np.int32)[0])

    def pin(self) -> int:
        """Register the mailbox with CUDA (pinned, mapped); returns its device (UVA) address.
        The GPU path only: needs glm53 built with CUDA. unpin() before the mailbox is dropped
        (every cudaHostRegister has its unregister)."""
        from glm53 import _cuda

        if self.device_addr is None:
            _cuda.host_register(self.addr, len(self._map))
            self.device_addr = _cuda.host_device_pointer(self.addr)
        return self.device_addr

    def unpin(self) -> None:
        from glm53 import _cuda

        if self.device_addr is not None:
            _cuda.host_unregister(self.addr)
            self.device_addr = None

    def set_budget(self, experts: int) -> None:
        """The router's split for this layer: the most experts the device may send."""
        if not 0 <= experts <= MAX_PICKS:
            raise ValueError(f"a lane budget of {experts} experts is outside 0..{MAX_PICKS}")
        self.store("budget", experts)


class MailboxLane:
    """A mailbox per MoE layer, bound to that layer's experts, served by one poller thread on
    `lane`'s pool. Owned by the engine thread; the poller owns the mailboxes' host lines."""

    def __init__(
        self,
        lane: CpuLane,
        tables: Sequence[_gemv.ExpertTable],
        act_limit: float = SWIGLU_LIMIT,
        spin_ns: int = IDLE_SPIN_NS,
        max_sleep_ns: int = 200_000,
    ):
        if not tables:
            raise ValueError("MailboxLane: no layers")
        self.lane = lane
        self.tables = list(tables)
        self.mailboxes = [Mailbox(t.hidden) for t in self.tables]
        self.poller = _lane.Lane(lane.pool, len(self.tables), spin_ns, max_sleep_ns)
        lane.pool.idle_spin_ns = spin_ns  # the workers wake as the poller does
        for i, (mbox, table) in enumerate(zip(self.mailboxes, self.tables, strict=True)):
            self.poller.set_slot(i, mbox.buf, table, act_limit, lane.variant, lane.precision)
        self.poller.start()
        self._observed = [0] * len(self.tables)  # jobs per layer already reported
        self._seen_seq = [m.seq for m in self.mailboxes]  # seq per layer already reported

    @property
    def idle_spin_ns(self) -> int:
        """How long the lane stays awake after a job, the poller and the pool's workers alike,
        before they sleep: a job arriving later pays their wake (the poller's sleep of up to
        max_sleep_ns, the workers' futex). bench/gpu_slice.py's --lane-spin-us sweeps it."""
        return self.poller.spin_ns

    @idle_spin_ns.setter
    def idle_spin_ns(self, ns: int) -> None:
        if ns < 0:
            raise ValueError(f"idle_spin_ns must be >= 0, got {ns}")
        self.poller.spin_ns = ns
        self.lane.pool.idle_spin_ns = ns

    def stats(self) -> dict:
        """The lane's counters, with each layer's as `layers` (jobs, busy_ns, last_job_ns,
        last_picks: the lane's time per layer for /stats and the router)."""
        st = self.poller.stats()
        st["layers"] = [self.poller.slot_stats(i) for i in range(len(self.mailboxes))]
        return st

    def take_reports(self) -> list[LayerReport]:
        """Between decode steps, on the engine thread: per layer, what the device reported for
        its last decode call and the lane's newest job. The device writes the report on every
        decode call and is idle between Generator iterations, which is when the engine calls
        this. A report is consumed (zeroed) once read: a layer with no decode call since the
        last one (an iteration of prefill only) reports (0, 0)."""
        reports = []
        for i, mbox in enumerate(self.mailboxes):
            rep = LayerReport(int(mbox.header[4]), int(mbox.header[5]))
            mbox.header[4] = mbox.header[5] = 0
            seq = mbox.seq
            payload = None
            if seq != self._seen_seq[i]:  # published since the last report: this step's picks
                self._seen_seq[i] = seq
                payload = expert_rows(mbox.picks[: int(mbox.header[1])])
                rep.sent_rows = payload
            st = self.poller.slot_stats(i)
            if st["jobs"] > self._observed[i]:
                self._observed[i] = st["jobs"]
                # the job is the mailbox's payload when its result is the newest one; else the
                # payload moved on (the job came late) and only its pick count is known: each
                # pick counts as an expert of one row
                if mbox.done == seq and payload is None:
                    payload = expert_rows(mbox.picks[: int(mbox.header[1])])
                if mbox.done != seq or payload is None:
                    payload = [1] * st["last_picks"]
                rep.job_rows, rep.job_ms = payload, st["last_job_ns"] / 1e6
            reports.append(rep)
        return reports

    def close(self) -> None:
        self.poller.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
