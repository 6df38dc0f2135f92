"""The fast-mode router: per MoE layer and decode step, how many of the coldest VRAM-cache misses
go to the CPU lane instead of the GPU's zero-copy path.

The GPU reads a missed expert over PCIe while it computes (zero-copy), so its time for a layer is
about  t_gpu(k) = n_hit * hit_ms + (n_miss - k) * (expert_bytes / link + zc_ms)  when k misses
go to the lane; the lane computes those k in  t_lane(k) = lane_a + sum_i lane_b(rows) * (1 + tok
* (cnt_i - 1))  (cnt_i: the rows that picked expert i), in parallel. The layer takes about
max(t_gpu(k), t_lane(k)) plus the wait for the lane, so the router picks the k in [0, max_k] that
minimises that, and k = 0 unless it is strictly faster than the GPU alone by `margin`: with a
slow lane (few cores) fast mode converges to exact mode's speed and never falls below it.

Unlike the seed project's policy vector (constants measured once), every rate here is a moving
estimate of what the running system measures: the lane's ms per expert for each row count
(from the lane's own job timings), its fixed cost per job, the link's GB/s and the GPU's ms per
resident and per zero-copy expert (from timed layers). `ct_b` (--ct-b) pins the lane's ms per
expert to a given value instead. The coldest misses go first: they are the least likely to be
admitted into the VRAM cache soon, so computing them on the CPU costs the cache nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ROWS = 8  # row-count buckets of the lane's per-expert estimate (decode batches up to 8)


class Ewma:
    """An exponentially weighted moving average that starts at a prior and counts its samples."""

    __slots__ = ("alpha", "n", "value")

    def __init__(self, prior: float, alpha: float):
        self.value, self.alpha, self.n = float(prior), float(alpha), 0

    def update(self, sample: float) -> None:
        # the first samples weigh more, so a wrong prior is forgotten within a few observations
        a = max(self.alpha, 1.0 / (self.n + 2))
        self.value += a * (float(sample) - self.value)
        self.n += 1


@dataclass
class Rates:
    """Priors for the estimates (ms; GB/s). The defaults are the seed's H200-class figures scaled
    to a 3 bpw GLM-5.3-Flash expert of 9.44 MB; the estimates move off them as soon as the engine
    measures."""

    hit_ms: float = 0.023
    zc_ms: float = 0.02  # GPU compute per zero-copy expert beyond its transfer
    link_gbps: float = 25.0
    lane_a_ms: float = 0.11
    lane_b_ms: float = 0.4  # per expert at one row
    tok: float = 0.2  # extra fraction of lane_b per extra row of one expert


@dataclass
class LayerStats:
    steps: int = 0
    lane_steps: int = 0
    misses: int = 0
    to_lane: int = 0
    lane_ms: float = 0.0
    predicted_ms: float = 0.0


@dataclass
class LaneRouter:
    n_layers: int
    expert_bytes: int
    rates: Rates = field(default_factory=Rates)
    max_k: int = 32
    margin: float = 0.02  # a split must beat the GPU alone by this share
    alpha: float = 0.1
    ct_b: float | None = None  # --ct-b: pin the lane's ms per expert

    def __post_init__(self):
        r, a = self.rates, self.alpha
        self.hit_ms, self.zc_ms = Ewma(r.hit_ms, a), Ewma(r.zc_ms, a)
        self.link_gbps = Ewma(r.link_gbps, a)
        self.lane_a = Ewma(r.lane_a_ms, a)
        # per row-count bucket: the lane's ms per expert
        self.lane_b = [Ewma(r.lane_b_ms * (1 + r.tok * i), a) for i in range(MAX_ROWS)]
        self.tok = r.tok
        self.layers = [LayerStats() for _ in range(self.n_layers)]

    # --- the decision --------------------------------------------------------------------------
    def miss_ms(self) -> float:
        """GPU time per zero-copy miss: its transfer at the link's rate plus its compute."""
        return self.expert_bytes / (self.link_gbps.value * 1e6) + self.zc_ms.value

    def lane_expert_ms(self, rows: int) -> float:
        if self.ct_b is not None:
            return self.ct_b * (1 + self.tok * (min(rows, MAX_ROWS) - 1))
        return self.lane_b[min(rows, MAX_ROWS) - 1].value

    def cost(self, k: int, n_hit: int, miss_rows: list[int]) -> tuple[float, float]:
        """(GPU ms, lane ms) of a layer with the first k of `miss_rows` on the lane."""
        n_miss = len(miss_rows)
        gpu = n_hit * self.hit_ms.value + (n_miss - k) * self.miss_ms()
        lane = 0.0
        if k:
            lane = self.lane_a.value + sum(self.lane_expert_ms(r) for r in miss_rows[:k])
        return gpu, lane

    def split(self, layer: int, n_hit: int, miss_rows: list[int]) -> int:
        """How many of the misses, listed coldest first with the rows that picked each, go to
        the lane. 0 whenever no split beats the GPU alone by the margin."""
        gpu0, _ = self.cost(0, n_hit, miss_rows)
        best_k, best = 0, gpu0
        # cost(k) for every k in one pass: the lane's sum grows by one expert a step (summed in
        # the same order as cost() sums it, so the same floats), the GPU's shrinks by one miss
        hit, miss, lane_sum = n_hit * self.hit_ms.value, self.miss_ms(), 0.0
        for k in range(1, min(self.max_k, len(miss_rows)) + 1):
            lane_sum += self.lane_expert_ms(miss_rows[k - 1])
            t = max(hit + (len(miss_rows) - k) * miss, self.lane_a.value + lane_sum)
            if t < best:
                best_k, best = k, t
        if best_k and best > gpu0 * (1 - self.margin):
            best_k, best = 0, gpu0
        st = self.layers[layer]
        st.steps += 1
        st.misses += len(miss_rows)
        st.to_lane += best_k
        st.lane_steps += best_k > 0
        st.predicted_ms += best
        return best_k

    # --- what the engine measured --------------------------------------------------------------
    def observe_lane(self, layer: int, miss_rows: list[int], ms: float) -> None:
        """The lane computed these experts (rows per expert) in `ms`, its job overhead included.
        The per-expert rate of the job's dominant row count absorbs what the fixed cost does not
        explain."""
        if not miss_rows:
            return
        self.layers[layer].lane_ms += ms
        per = (ms - self.lane_a.value) / len(miss_rows)
        rows = max(set(miss_rows), key=miss_rows.count)
        if per > 0:
            self.lane_b[min(rows, MAX_ROWS) - 1].update(per)
        else:  # the job was faster than its fixed cost: the fixed cost is too high
            self.lane_a.update(ms)

    def observe_link(self, nbytes: int, ms: float) -> None:
        if ms > 0 and nbytes > 0:
            self.link_gbps.update(nbytes / (ms * 1e6))

    def observe_gpu(self, n_hit: int, n_zc: int, ms: float) -> None:
        """A layer's GPU expert time with n_hit resident and n_zc zero-copy experts: splits the
        time between them by the current estimates and moves each toward its share."""
        if ms <= 0 or n_hit + n_zc == 0:
            return
        want_hit = n_hit * self.hit_ms.value
        want_zc = n_zc * self.miss_ms()
        scale = ms / (want_hit + want_zc)
        if n_hit:
            self.hit_ms.update(self.hit_ms.value * scale)
        if n_zc:
            transfer = self.expert_bytes / (self.link_gbps.value * 1e6)
            self.zc_ms.update(max(0.0, self.miss_ms() * scale - transfer))

    # --- introspection -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "rates": {
                "hit_ms": self.hit_ms.value,
                "zc_ms": self.zc_ms.value,
                "link_gbps": self.link_gbps.value,
                "lane_a_ms": self.lane_a.value,
                "lane_b_ms_by_rows": [e.value for e in self.lane_b],
                "ct_b": self.ct_b,
            },
            "layers": [
                {
                    "split": st.to_lane / st.misses if st.misses else 0.0,
                    "lane_ms_per_step": st.lane_ms / st.lane_steps if st.lane_steps else 0.0,
                    "steps": st.steps,
                    "to_lane": st.to_lane,
                    "misses": st.misses,
                }
                for st in self.layers
            ],
        }
