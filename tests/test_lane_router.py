"""The fast-mode router's decisions on a recorded decode trace (tests/fixtures/lane_trace.json,
written by tools/record_lane_trace.py from the demo model: per MoE layer and step, the VRAM-cache
hits and the misses coldest first with their rows).

The system under the router is simulated with fixed "true" costs (a GPU that reads misses over a
25 GB/s link, a lane of a given speed) plus seeded noise; the router sees only what it measures.
Its total time is compared with every fixed split (the sweep a person would run) and with exact
mode (nothing on the lane)."""

import json
import random
from pathlib import Path

import pytest

from glm53.tiers.lane_router import LaneRouter, Rates

TRACE = json.loads((Path(__file__).parent / "fixtures" / "lane_trace.json").read_text())
EXPERT_BYTES = 9_437_184  # one GLM-5.3-Flash expert at 3 bpw


class TrueSystem:
    def __init__(self, lane_b, lane_a=0.1, hit=0.023, link_gbps=25.0, zc=0.02, tok=0.2, seed=0):
        self.lane_b, self.lane_a, self.hit, self.tok = lane_b, lane_a, hit, tok
        self.miss = EXPERT_BYTES / (link_gbps * 1e6) + zc
        self.rng = random.Random(seed)

    def noise(self):
        return self.rng.uniform(0.9, 1.1)

    def gpu(self, n_hit, n_zc):
        return n_hit * self.hit + n_zc * self.miss

    def lane(self, rows):
        if not rows:
            return 0.0
        return self.lane_a + sum(self.lane_b * (1 + self.tok * (r - 1)) for r in rows)


def run(system, events, choose, router=None):
    total = 0.0
    for ev in events:
        misses = ev["miss_rows"]
        k = choose(ev)
        gpu_ms = system.gpu(ev["n_hit"], len(misses) - k) * system.noise()
        lane_ms = system.lane(misses[:k]) * system.noise()
        total += max(gpu_ms, lane_ms)
        if router is not None:
            router.observe_gpu(ev["n_hit"], len(misses) - k, gpu_ms)
            if k:
                router.observe_lane(ev["layer"], misses[:k], lane_ms)
    return total


def routed(system, events, **kw):
    router = LaneRouter(TRACE["n_layers"], EXPERT_BYTES, **kw)
    total = run(
        system,
        events,
        lambda ev: router.split(ev["layer"], ev["n_hit"], ev["miss_rows"]),
        router,
    )
    return total, router


def best_fixed(system, events):
    sweep = {
        k: run(
            TrueSystem(system.lane_b, seed=1), events, lambda ev, k=k: min(k, len(ev["miss_rows"]))
        )
        for k in range(0, 9)
    }
    return min(sweep.values()), sweep


def test_the_trace_has_misses_to_route():
    events = TRACE["events"]
    assert len(events) > 500
    assert sum(len(e["miss_rows"]) for e in events) > 1000


def test_a_fast_lane_is_used_and_the_split_is_within_10_percent_of_the_best_fixed_one():
    events = TRACE["events"] * 2
    system = TrueSystem(lane_b=0.12)
    total, router = routed(system, events)
    best, sweep = best_fixed(system, events)
    assert total <= 1.10 * best, (total, sweep)
    assert total < 0.8 * sweep[0]  # well ahead of exact mode
    st = router.stats()
    assert all(layer["to_lane"] > 0 for layer in st["layers"])
    assert st["rates"]["lane_b_ms_by_rows"][0] == pytest.approx(0.12, rel=0.2)


def test_a_slow_lane_converges_to_exact_mode_and_never_falls_below_it():
    """A 2-core host: the lane takes 3 ms per expert, against a prior of 0.4."""
    events = TRACE["events"]
    system = TrueSystem(lane_b=3.0)
    total, router = routed(system, events)
    exact = run(TrueSystem(3.0, seed=1), events, lambda ev: 0)
    assert total <= 1.02 * exact
    # after the first few layer steps the router has learned and sends nothing
    late = [ly["to_lane"] for ly in router.stats()["layers"]]
    assert sum(late) <= 2 * TRACE["n_layers"], late


def test_the_router_follows_a_lane_that_slows_down():
    events = TRACE["events"]
    router = LaneRouter(TRACE["n_layers"], EXPERT_BYTES)
    fast, slow = TrueSystem(lane_b=0.12), TrueSystem(lane_b=3.0)
    run(fast, events, lambda ev: router.split(ev["layer"], ev["n_hit"], ev["miss_rows"]), router)
    sent_fast = sum(ly["to_lane"] for ly in router.stats()["layers"])
    router2_before = sent_fast
    run(slow, events, lambda ev: router.split(ev["layer"], ev["n_hit"], ev["miss_rows"]), router)
    sent_slow = sum(ly["to_lane"] for ly in router.stats()["layers"]) - router2_before
    assert sent_fast > 500 and sent_slow < 0.1 * sent_fast


def test_ct_b_pins_the_lane_rate():
    ev = {"layer": 0, "n_hit": 2, "miss_rows": [1, 1, 1, 1, 1, 1]}
    slow = LaneRouter(1, EXPERT_BYTES, ct_b=50.0)
    assert slow.split(0, ev["n_hit"], ev["miss_rows"]) == 0
    slow.observe_lane(0, [1, 1], 0.05)  # measurements do not move a pinned rate
    assert slow.split(0, ev["n_hit"], ev["miss_rows"]) == 0
    fast = LaneRouter(1, EXPERT_BYTES, ct_b=0.001, rates=Rates(lane_a_ms=0.0))
    assert fast.split(0, ev["n_hit"], ev["miss_rows"]) == 6


def test_no_misses_no_split():
    router = LaneRouter(2, EXPERT_BYTES)
    assert router.split(1, 8, []) == 0
    assert router.stats()["layers"][1]["steps"] == 1


def test_split_is_the_argmin_of_cost_over_every_k():
    """split() prices every k in one pass; it must pick what cost() says, k by k."""
    rng = random.Random(11)
    for trial in range(200):
        router = LaneRouter(n_layers=1, expert_bytes=9_440_000, max_k=rng.choice((4, 16, 32)),
                            rates=Rates(lane_b_ms=rng.uniform(0.05, 2.0)))  # fmt: skip
        rows = [rng.randint(1, 8) for _ in range(rng.randint(0, 40))]
        n_hit = rng.randint(0, 60)
        gpu0 = router.cost(0, n_hit, rows)[0]
        best_k, best = 0, gpu0
        for k in range(1, min(router.max_k, len(rows)) + 1):
            t = max(router.cost(k, n_hit, rows))
            if t < best:
                best_k, best = k, t
        if best_k and best > gpu0 * (1 - router.margin):
            best_k = 0
        assert router.split(0, n_hit, rows) == best_k, trial
