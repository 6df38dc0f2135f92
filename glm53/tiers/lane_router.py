"""The fast-mode router: per MoE layer and decode step, how many of the coldest VRAM-cache misses
go to the CPU lane instead of the GPU's zero-copy path, and how long the GPU may wait for them.

The GPU reads a missed expert over PCIe while it computes (zero-copy), so its share of a layer
takes about  t_gpu(k) = n_hit * hit_ms + (n_miss - k) * miss_ms  when k misses go to the lane;
the lane computes those k in  t_lane(k) = lane_a + sum_i (lane_b + lane_c * (rows_i - 1))  (rows_i:
the rows that picked expert i), in parallel. The router prices the lane at its upper bound
t_lane(k) * (1 + tail), `tail` being a high quantile of the lane's own relative misprediction,
and picks the k in [0, max_k] that minimises  max(t_gpu(k), upper lane time); k = 0 unless that
beats the GPU alone by `margin`, so with a slow lane fast mode converges to exact mode's speed.

The device's wait for the lane starts when the GPU's share ends, so the wait budget of a layer
(`wait_ns`) is the lane's upper bound minus the GPU's fastest plausible share, plus the poller's
pick-up time: the lane is predicted to finish inside it, and what it is not predicted to finish
in a wait worth having is never sent. A stalled lane then costs that wait and the fallback.

Every rate is fitted from what the running system measures (`LinearFit`): the lane's fixed
cost and per-expert and per-extra-row costs from its own job timings, after its first jobs per
row count are discarded (they pay page faults and thread wake-up: on the H200 host such jobs
took 9.9 ms an expert against 0.36 measured warm); the GPU's ms per resident and per zero-copy
expert from timed layers, and from their difference the link's effective GB/s. `ct_b` (--ct-b)
pins the lane's ms per expert instead. A probe (a layer that sent the lane nothing for
`probe_after` steps sends it one miss, so that a lane priced too high is measured again) finds
the lane cold: its job is priced apart from the warm fit (`cold_job_ms`, the median of the
newest probe jobs) and the device waits for that price, at most PROBE_WAIT_CAP_MS, so that a
probe measures the lane instead of falling back by construction.

The coldest misses go first: they are the least likely to be admitted into the VRAM cache
soon, so computing them on the CPU costs the cache nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

MAX_ROWS = 8  # rows a decode batch can give one expert
# Below this many samples a fit's quantiles mean little: its upper margin is PRIOR_TAIL
MIN_TAIL_SAMPLES = 16
PRIOR_TAIL = 0.5
# A probe's job finds the lane cold (its threads asleep, its caches cold, after probe_after steps
# with nothing sent): it is priced apart from the warm fit, as the median of the newest
# COLD_WINDOW probe jobs (COLD_PRIOR_MS before any) times 1 + PRIOR_TAIL, and the device waits
# for it that long, at most PROBE_WAIT_CAP_MS (a lane slower than that when cold falls back).
COLD_WINDOW = 8
COLD_PRIOR_MS = 2.0
PROBE_WAIT_CAP_MS = 4.0
# The router's fits refit once per REFIT_EVERY new samples once they hold MIN_TAIL_SAMPLES (every
# sample before that). A refit (a least-squares solve, one pass of outlier rejection and two
# quantiles over the window) took 96-115 us on the 2-vCPU CI host; FastLane.step runs between
# Generator iterations, where the GPU waits for it, and with a lane job on every layer both fits
# took new samples every step (on an H100 at one stream the lane path's host work left the GPU
# idle 0.77 ms a token more than exact's path: bench/results/README.md). Rates move slowly:
# a fit at most REFIT_EVERY - 1 samples old prices the lane as well.
REFIT_EVERY = 8


class LinearFit:
    """time_ms = x . theta, fitted over the newest `window` samples.

    Least squares with a ridge toward the prior: the prior counts as a pseudo sample of weight
    `prior_weight` per coefficient, so a coefficient the samples cannot tell apart (the
    per-extra-row cost while every expert has one row) stays at its prior instead of swinging
    on noise, while a few samples move the others off a wrong prior (the weight is small: a
    prior 100x off biases a fit of 20 samples by under 1 %). A least-squares fit over a window
    rather than an EWMA: the lane's cost has a fixed part and a per-expert part, and one job's
    time cannot say which of the two it measured; a fit over jobs of different sizes can. One
    pass of outlier rejection (residuals beyond `reject` robust sigmas, from the median
    absolute deviation) keeps a preempted job from moving the mean. The rejected samples still
    count in the quantiles of the relative residual (`upper`, `lower`): what the budget must
    cover is the real spread, outliers included. Owned by the router's thread."""

    def __init__(
        self,
        prior: tuple[float, ...],
        window: int = 128,
        prior_weight: float = 0.01,
        reject: float = 4.0,
        quantile: float = 0.99,
        refit_every: int = 1,
    ):
        self.prior = np.asarray(prior, dtype=np.float64)
        self.samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.prior_weight, self.reject, self.quantile = prior_weight, reject, quantile
        self.n = 0  # samples ever added
        if refit_every < 1:
            raise ValueError(f"refit_every must be at least 1, got {refit_every}")
        # refit once per `refit_every` new samples, every sample while the window is young
        # (under MIN_TAIL_SAMPLES samples at the newest fit): REFIT_EVERY
        self.refit_every = int(refit_every)
        self._fitted_n = 0  # self.n at the newest fit
        self.rejected = 0  # samples the newest fit left out
        self._theta = self.prior.copy()
        self._upper, self._lower = PRIOR_TAIL, -PRIOR_TAIL
        self._dirty = False

    def add(self, x: tuple[float, ...], ms: float) -> None:
        self.samples.append((tuple(float(v) for v in x), float(ms)))
        self.n += 1
        self._dirty = True

    def _stale(self) -> bool:
        """New samples the newest fit has not seen, and enough of them to refit."""
        if not self._dirty:
            return False
        young = self._fitted_n < MIN_TAIL_SAMPLES
        return young or self.n - self._fitted_n >= self.refit_every

    @property
    def theta(self) -> np.ndarray:
        if self._stale():
            self._fit()
        return self._theta

    @property
    def upper(self) -> float:
        """The `quantile` of (measured - predicted) / predicted, at least 0: how much longer
        than predicted a sample may take."""
        if self._stale():
            self._fit()
        return self._upper

    @property
    def lower(self) -> float:
        """The 1 - `quantile` quantile of the relative residual, at most 0."""
        if self._stale():
            self._fit()
        return self._lower

    def _solve(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        lam = self.prior_weight * np.eye(len(self.prior))
        return np.linalg.solve(x.T @ x + lam, x.T @ y + lam @ self.prior)

    def _fit(self) -> None:
        self._dirty = False
        self._fitted_n = self.n
        if not self.samples:
            return
        x = np.array([s[0] for s in self.samples], dtype=np.float64)
        y = np.array([s[1] for s in self.samples], dtype=np.float64)
        theta = self._solve(x, y)
        res = y - x @ theta
        sigma = 1.4826 * np.median(np.abs(res - np.median(res)))
        keep = np.abs(res) <= max(self.reject * sigma, 1e-6)
        if keep.sum() >= len(self.prior) and not keep.all():
            theta = self._solve(x[keep], y[keep])
        self.rejected = int((~keep).sum())
        self._theta = theta
        pred = x @ theta
        rel = (y - pred) / np.maximum(pred, 1e-9)
        if len(rel) < MIN_TAIL_SAMPLES:
            self._upper, self._lower = PRIOR_TAIL, -PRIOR_TAIL
        else:
            self._upper = max(0.0, float(np.quantile(rel, self.quantile, method="higher")))
            self._lower = min(0.0, float(np.quantile(rel, 1 - self.quantile, method="lower")))


def _check_share(share: float | None) -> None:
    if share is not None and not 0.0 <= share <= 1.0:
        raise ValueError(f"forced_share {share} is outside 0..1")


@dataclass
class Rates:
    """Priors for the fits (ms; GB/s). The defaults are the seed's H200-class figures scaled to
    a 3 bpw GLM-5.3-Flash expert of 9.44 MB; the fits move off them as soon as the engine
    measures. A zero-copy expert costs a resident one's compute plus its transfer over the link:
    miss_ms = hit_ms + expert_bytes / link."""

    hit_ms: float = 0.023
    link_gbps: float = 25.0
    lane_a_ms: float = 0.11
    lane_b_ms: float = 0.4  # per expert at one row
    tok: float = 0.2  # each extra row of one expert costs this share of lane_b
    # the poller's pick-up delay after an idle gap: its longest sleep (200 us) plus the timer's
    # slack (about 50 us), docs/fast-mode.md; the job timings cannot see it
    pickup_ms: float = 0.25


@dataclass
class LayerStats:
    steps: int = 0
    lane_steps: int = 0
    misses: int = 0
    to_lane: int = 0
    probes: int = 0
    lane_ms: float = 0.0
    predicted_ms: float = 0.0
    waited_ms: float = 0.0  # the device's measured waits for the lane (timed steps)
    waits: int = 0  # the timed steps behind waited_ms and gpu_ms
    gpu_ms: float = 0.0  # the GPU's share of those steps: from the publish to the wait
    since_lane: int = 0  # steps with misses since this layer last sent the lane anything
    owed: float = 0.0  # forced_share: the share's fractional experts not sent yet
    wait_ns: int = 0  # the newest wait budget
    probe_pending: bool = False  # the newest split was a probe: its job is a cold one


@dataclass
class LaneRouter:
    """Owned by the engine thread; `stats` may run on another thread under the engine's lock.

    `forced_share` (benchmark and diagnostic knob, bench/gpu_slice.py's fixed-split sweep):
    send that share of each layer's misses to the lane whatever the rates say (the fraction
    carried from step to step, so 10 % of 4 misses is one expert every 2.5 steps); the wait
    budget is still the predicted one. `probe_after`: a layer whose misses have not gone to the
    lane for that many steps sends one, so a lane priced too high is measured again instead of
    never being chosen."""

    n_layers: int
    expert_bytes: int
    rates: Rates = field(default_factory=Rates)
    max_k: int = 32
    margin: float = 0.02  # a split must beat the GPU alone by this share
    window: int = 128  # samples per fit
    warmup_jobs: int = 1  # lane jobs discarded per row count before fitting
    quantile: float = 0.99  # of the lane's relative misprediction that its upper bound covers
    refit_every: int = REFIT_EVERY  # the fits' new samples per refit, once past MIN_TAIL_SAMPLES
    probe_after: int = 256
    ct_b: float | None = None  # --ct-b: pin the lane's ms per expert
    forced_share: float | None = None

    def __post_init__(self):
        _check_share(self.forced_share)
        r = self.rates
        # lane: ms = a + b * experts + c * (picks - experts)
        self.lane = LinearFit(
            (r.lane_a_ms, r.lane_b_ms, r.tok * r.lane_b_ms), self.window, quantile=self.quantile,
            refit_every=self.refit_every,
        )  # fmt: skip
        # GPU share: ms = hit * n_hit + miss * n_zero_copy
        miss = r.hit_ms + self.expert_bytes / (r.link_gbps * 1e6)
        self.gpu = LinearFit((r.hit_ms, miss), 2 * self.window, quantile=self.quantile,
                             refit_every=self.refit_every)  # fmt: skip
        self.pickup_ms = r.pickup_ms
        self.tok = r.tok
        self.seen_by_rows = [0] * MAX_ROWS  # lane jobs seen per row count, warm-up included
        self.fitted_by_rows = [0] * MAX_ROWS  # of those, the ones the fit took
        self.cold_ms: deque[float] = deque(maxlen=COLD_WINDOW)  # the newest probe jobs' times
        self.probe_jobs = 0  # probe jobs observed, ever
        self.layers = [LayerStats() for _ in range(self.n_layers)]

    def set_forced_share(self, share: float | None) -> None:
        """The benchmark knob (see the class): a share in 0..1, or None for the router's own."""
        _check_share(share)
        self.forced_share = share
        for st in self.layers:
            st.owed = 0.0

    # --- the rates -----------------------------------------------------------------------------
    @property
    def hit_ms(self) -> float:
        return float(self.gpu.theta[0])

    @property
    def miss_ms(self) -> float:
        """GPU time per zero-copy miss: its transfer at the link's rate plus its compute."""
        return float(self.gpu.theta[1])

    def link_gbps(self) -> float | None:
        """The link's effective rate: an expert's bytes over what a zero-copy expert costs beyond
        a resident one. None while the fit puts the two at the same cost."""
        extra = self.miss_ms - self.hit_ms
        return self.expert_bytes / (extra * 1e6) if extra > 0 else None

    def _lane_bc(self) -> tuple[float, float]:
        """The lane fit's ms an expert and ms an extra row, each at least 0, as floats (read
        once per split or job price: unpacking the fit's array per expert was most of a split's
        time, 14 us a layer on the CI host, 0.6 ms a step at GLM-5.3-Flash's 42 MoE layers)."""
        theta = self.lane.theta
        return max(float(theta[1]), 0.0), max(float(theta[2]), 0.0)

    def lane_expert_ms(self, rows: float, bc: tuple[float, float] | None = None) -> float:
        """The lane's ms for one expert picked by `rows` rows (a mean may be fractional); `bc`:
        _lane_bc(), when the caller has it."""
        extra = min(max(rows, 1.0), MAX_ROWS) - 1
        if self.ct_b is not None:
            return self.ct_b * (1 + self.tok * extra)
        b, c = bc if bc is not None else self._lane_bc()
        return b + c * extra

    def lane_ms(self, miss_rows) -> float:
        """The lane's predicted ms for a job of these experts (rows per expert)."""
        if not len(miss_rows):
            return 0.0
        bc = self._lane_bc()
        return max(float(self.lane.theta[0]), 0.0) + sum(
            self.lane_expert_ms(r, bc) for r in miss_rows
        )

    def cost(self, k: int, n_hit: int, miss_rows) -> tuple[float, float]:
        """(GPU ms, the lane's upper-bound ms) of a layer with the first k of `miss_rows` on
        the lane."""
        gpu = n_hit * self.hit_ms + (len(miss_rows) - k) * self.miss_ms
        return gpu, self.lane_ms(miss_rows[:k]) * (1 + self.lane.upper)

    # --- the decision --------------------------------------------------------------------------
    def split(self, layer: int, n_hit: int, miss_rows) -> int:
        """How many of the misses, listed coldest first with the rows that picked each, go to
        the lane. 0 whenever no split beats the GPU alone by the margin (a probe aside)."""
        st = self.layers[layer]
        # the engine observes a step's lane job before it splits the next step: a probe whose
        # job has not been observed by now gave no result (the device moved on)
        st.probe_pending = False
        n_miss = len(miss_rows)
        gpu0 = n_hit * self.hit_ms + n_miss * self.miss_ms
        best_k, best = 0, gpu0
        if self.forced_share is not None:
            st.owed += self.forced_share * n_miss
            best_k = min(int(st.owed), n_miss, self.max_k)
            st.owed -= best_k
            best = max(self.cost(best_k, n_hit, miss_rows))
        else:
            # cost(k) for every k in one pass: the lane's sum grows by one expert a step (summed
            # in the order lane_ms sums it, so the same floats), the GPU's shrinks by one miss
            hit, miss, scale = n_hit * self.hit_ms, self.miss_ms, 1 + self.lane.upper
            lane_a, lane_sum = max(float(self.lane.theta[0]), 0.0), 0.0
            bc = self._lane_bc()
            for k in range(1, min(self.max_k, n_miss) + 1):
                lane_sum += self.lane_expert_ms(miss_rows[k - 1], bc)
                t = max(hit + (n_miss - k) * miss, (lane_a + lane_sum) * scale)
                if t < best:
                    best_k, best = k, t
            if best_k and best > gpu0 * (1 - self.margin):
                best_k, best = 0, gpu0
            if best_k == 0 and n_miss and self.ct_b is None and st.since_lane >= self.probe_after:
                best_k, best = 1, max(self.cost(1, n_hit, miss_rows))
                st.probes += 1
                st.probe_pending = True
        st.steps += 1
        st.misses += n_miss
        st.to_lane += best_k
        st.lane_steps += best_k > 0
        st.predicted_ms += best
        if best_k:
            st.since_lane = 0
        elif n_miss:
            st.since_lane += 1
        st.wait_ns = self.wait_ns(best_k, n_hit, miss_rows)
        if st.probe_pending:  # a cold job: wait for its cold price, within the cap
            cold = min(self.cold_job_ms() + self.pickup_ms, PROBE_WAIT_CAP_MS)
            st.wait_ns = max(st.wait_ns, int(cold * 1e6))
        return best_k

    def cold_job_ms(self) -> float:
        """A probe job's upper price in ms: the median of the newest probe jobs (COLD_PRIOR_MS
        before any) times 1 + PRIOR_TAIL."""
        ms = float(np.median(self.cold_ms)) if self.cold_ms else COLD_PRIOR_MS
        return ms * (1 + PRIOR_TAIL)

    def wait_ns(self, k: int, n_hit: int, miss_rows) -> int:
        """The device's wait budget for a layer that sends the first k misses: the lane's upper
        bound, plus its pick-up delay, minus the GPU's fastest plausible share (its fitted time
        at its lower residual quantile, every expert as fast as a resident one: the budget is
        set a step ahead, on the last step's counts). The wait starts when that share ends, so
        a lane on its upper bound lands inside it. 0 for k = 0 (nothing is sent, nothing
        waited for)."""
        if k == 0:
            return 0
        lane = self.lane_ms(miss_rows[:k]) * (1 + self.lane.upper) + self.pickup_ms
        gpu = (n_hit + len(miss_rows) - k) * min(self.hit_ms, self.miss_ms) * (1 + self.gpu.lower)
        return int(max(lane - max(gpu, 0.0), self.pickup_ms) * 1e6)

    # --- what the engine measured --------------------------------------------------------------
    def observe_lane(self, layer: int, miss_rows, ms: float) -> None:
        """The lane computed these experts (rows per expert) in `ms`, its job overhead included.
        The first `warmup_jobs` jobs of each row count (the most rows any of its experts has)
        are counted but not fitted, and a probe's job (the layer's newest split was a probe)
        goes to the cold price instead of the fit: it found the lane cold, after probe_after
        steps without a job (on the H200 on 2026-12-05 the router fitted a = 19 ms from such
        jobs, priced the warm lane out and sent nothing else)."""
        if not len(miss_rows):
            return
        st = self.layers[layer]
        st.lane_ms += ms
        if st.probe_pending:  # a probe's job: a cold one, priced apart (cold_job_ms)
            st.probe_pending = False
            self.cold_ms.append(float(ms))
            self.probe_jobs += 1
            return
        bucket = min(int(max(miss_rows)), MAX_ROWS) - 1
        self.seen_by_rows[bucket] += 1
        if self.seen_by_rows[bucket] <= self.warmup_jobs:
            return
        self.fitted_by_rows[bucket] += 1
        experts = len(miss_rows)
        self.lane.add((1.0, experts, float(sum(miss_rows)) - experts), ms)

    def observe_gpu(self, n_hit: int, n_zc: int, ms: float) -> None:
        """A layer's GPU share (from the publish to the wait) with n_hit resident and n_zc
        zero-copy experts took `ms`."""
        if ms > 0 and n_hit + n_zc > 0:
            self.gpu.add((n_hit, n_zc), ms)

    def observe_wait(self, layer: int, ms: float, gpu_ms: float = 0.0) -> None:
        """The device waited `ms` for the lane at the end of a timed layer, after `gpu_ms` of its
        own share (the MoE call and the cache's route, from the publish to the wait)."""
        st = self.layers[layer]
        st.waited_ms += ms
        st.gpu_ms += gpu_ms
        st.waits += 1

    # --- introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        """Each rate with the samples behind it (the newest fit's window; lane_b_ms_by_rows:
        the jobs fitted per row count, ever)."""
        a, b, c = (float(v) for v in self.lane.theta)
        lane_n, gpu_n = len(self.lane.samples), len(self.gpu.samples)
        return {
            "rates": {
                "lane_a_ms": {"value": a, "samples": lane_n},
                "lane_b_ms_by_rows": {
                    "value": [self.lane_expert_ms(r) for r in range(1, MAX_ROWS + 1)],
                    "samples": list(self.fitted_by_rows),
                },
                "lane_upper_share": {"value": self.lane.upper, "samples": lane_n},
                "hit_ms": {"value": self.hit_ms, "samples": gpu_n},
                "miss_ms": {"value": self.miss_ms, "samples": gpu_n},
                "link_gbps": {"value": self.link_gbps(), "samples": gpu_n},
                "pickup_ms": {"value": self.pickup_ms, "samples": 0},
                "lane_cold_job_ms": {"value": self.cold_job_ms(), "samples": len(self.cold_ms)},
            },
            "lane_warmup_jobs": sum(self.seen_by_rows) - sum(self.fitted_by_rows),
            "lane_probe_jobs": self.probe_jobs,
            "lane_rejected": self.lane.rejected,
            "ct_b": self.ct_b,
            "forced_share": self.forced_share,
            "layers": [
                {
                    "split": st.to_lane / st.misses if st.misses else 0.0,
                    "lane_ms_per_step": st.lane_ms / st.lane_steps if st.lane_steps else 0.0,
                    "steps": st.steps,
                    "to_lane": st.to_lane,
                    "misses": st.misses,
                    "probes": st.probes,
                    "wait_ns": st.wait_ns,
                    "waited_ms": st.waited_ms,
                    "waits": st.waits,
                    "gpu_ms": st.gpu_ms,
                }
                for st in self.layers
            ],
        }
