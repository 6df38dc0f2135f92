"""Fast mode's host-side glue in the GPU engine (glm53.tiers.fast_lane, the prefill mark in
glm53.exl3.fast_hooks, the /metrics counters), without CUDA.

The lane, its pool, its poller and the router are the real ones. `MockDevice` (a mock: the real
device side is cuda/lane.cu, which needs a GPU) writes a layer's reported hits and misses and
publishes picks through the same mailbox protocol, as tests/test_lane_mailbox.py's does.
`MockDeviceLayer` stands in for fast_hooks.FastLayer's device counters. The GPU side of all this
is tests/gpu/test_fast_mode_gpu.py (run on an H200 on 2026-12-02).
"""

import time

import numpy as np
import pytest

from glm53.tiers.cpu_lane import CpuLane, LaneLayout, expert_table, random_expert
from glm53.tiers.fast_lane import NVME_STATUS, STATUS, FastLane
from glm53.tiers.lane_mailbox import MailboxLane
from glm53.tiers.lane_router import LaneRouter

HIDDEN, INTER = 256, 256
SETTLE_S = 10.0  # a wait that must succeed: it ends as soon as done lands
EXPERT_BYTES = 9_440_000  # a GLM-5.3-Flash expert at 3 bpw


class MockDevice:
    """A mock of the device's side of one layer's mailbox: reports hits and misses, publishes."""

    def __init__(self, mbox, layer):
        self.mbox, self.layer, self.seq = mbox, layer, mbox.seq

    def report(self, n_hit, n_miss):
        self.mbox.header[4], self.mbox.header[5] = n_hit, n_miss

    def publish(self, x, rows, experts, weights):
        m, n = self.mbox, len(rows)
        m.rows[: len(x)] = x
        m.picks["row"][:n], m.picks["expert"][:n], m.picks["weight"][:n] = rows, experts, weights
        m.header[1], m.header[2], m.header[3] = n, len(x), self.layer
        self.seq += 1
        m.store("seq", self.seq)

    def wait(self):
        end = time.monotonic() + SETTLE_S
        while self.mbox.done != self.seq:
            assert time.monotonic() < end, "the lane never answered"
            time.sleep(50e-6)


class MockDeviceLayer:
    """A mock of fast_hooks.FastLayer's device counters and timings (the real ones read
    g53_lane_dev and CUDA events) and of its wait, which FastLane.step sets."""

    def __init__(self, published=0, lane_picks=0, fallbacks=0, timings=()):
        self.values = {"published": published, "lane_picks": lane_picks, "fallbacks": fallbacks}
        self.timings = list(timings)
        self.wait_ns = 0

    def counters(self):
        return dict(self.values)

    def take_timing(self):
        return self.timings.pop(0) if self.timings else None


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(1616)
    return expert_table([random_expert(rng, HIDDEN, INTER, 3) for _ in range(8)])


def rows(n):
    rng = np.random.default_rng(n)
    return (rng.standard_normal((n, HIDDEN)) * 4).astype(np.float16).astype(np.float32)


def test_nvme_modes_lane_says_its_own_status_not_fast_modes(table):
    """The nvme mode lane (glm53.exl3.fast.start_fast on an nvme-exact load) is the same
    FastLane; its /stats status is its own, not fast mode's (tests/gpu/test_nvme_mode_gpu.py's
    served test reads it)."""
    with MailboxLane(CpuLane(LaneLayout((0,))), [table]) as lane:
        st = FastLane(lane, LaneRouter(1, EXPERT_BYTES), status=NVME_STATUS).stats()
    assert st["status"] == NVME_STATUS != STATUS and st["status"].startswith("nvme mode")


@pytest.mark.parametrize("ct_b, sends", [(1e-4, True), (1e3, False)])
def test_each_step_sets_the_routers_budgets_and_stats_show_the_split(table, ct_b, sends):
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        fast = FastLane(lane, LaneRouter(2, EXPERT_BYTES, ct_b=ct_b))
        assert fast.budgets == [0, 0]  # nothing goes to the lane before the first step
        for i, mbox in enumerate(lane.mailboxes):
            MockDevice(mbox, i).report(2, 5 + i)
        budgets = fast.step()
        assert [m.load("budget") for m in lane.mailboxes] == budgets == fast.budgets
        if sends:
            assert all(0 < k <= n for k, n in zip(budgets, (5, 6), strict=True)), budgets
        else:  # a lane far slower than the link: nothing goes to it, fast runs as exact
            assert budgets == [0, 0]
        st = fast.stats()
        assert st["status"] == STATUS and "passed on an H200" in st["status"]
        assert st["steps"] == 1 and st["ct_b"] == ct_b
        assert [layer["budget"] for layer in st["layers"]] == budgets
        assert [layer["misses"] for layer in st["layers"]] == [5, 6]
        for layer, k, n in zip(st["layers"], budgets, (5, 6), strict=True):
            assert layer["split"] == k / n and layer["to_lane"] == k
        # no device layers here: only the device knows its fallbacks, so none are claimed
        assert st["fallbacks"] is None and "fallbacks" not in st["layers"][0]
        # an iteration without a decode call (prefill only) reports nothing: the budgets stay
        # and the router counts no step
        assert fast.step() == budgets
        assert [layer.steps for layer in fast.router.layers] == [1, 1]
        MockDevice(lane.mailboxes[0], 0).report(0, 1)  # a new report for layer 0 only
        fast.step()
        assert [layer.steps for layer in fast.router.layers] == [2, 1]


def test_the_lanes_jobs_and_time_reach_the_router_and_the_stats(table):
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        fast = FastLane(lane, LaneRouter(2, EXPERT_BYTES))
        device = MockDevice(lane.mailboxes[1], 1)
        device.report(1, 4)
        device.publish(rows(2), [0, 1, 1], [3, 4, 5], [0.25, 0.5, 0.25])
        device.wait()
        fast.step()
        st = fast.stats()
        assert st["jobs"] == 1 and st["lane_ms"] > 0 and st["failed"] == 0
        assert (st["layers"][0]["lane_jobs"], st["layers"][1]["lane_jobs"]) == (0, 1)
        assert st["layers"][1]["lane_ms"] > 0 and st["layers"][0]["lane_ms"] == 0
        assert fast.router.layers[1].lane_ms > 0  # the job's time reached the router
        assert fast.router.seen_by_rows == [1, 0, 0, 0, 0, 0, 0, 0]  # one-row experts only
        assert st["lane_warmup_jobs"] == 1  # the first job of its row count is not fitted
        assert fast.rows_per_miss == [1.0, 1.0]  # each sent expert had one row
        fast.step()  # no new job: the router observes nothing more
        assert sum(fast.router.seen_by_rows) == 1


def test_a_step_refits_the_routers_lane_rates_once_not_once_per_layer(table, monkeypatch):
    """Every layer's job reaches the router before any layer is split, so the lane's fit (a
    least-squares solve over its window) runs once per step: between iterations the GPU waits
    for this thread."""
    from glm53.tiers import lane_router

    fits = []
    real_fit = lane_router.LinearFit._fit
    monkeypatch.setattr(lane_router.LinearFit, "_fit", lambda f: (fits.append(f), real_fit(f)))
    with MailboxLane(CpuLane(LaneLayout((0,))), [table] * 3) as lane:
        router = LaneRouter(3, EXPERT_BYTES, warmup_jobs=0)
        fast = FastLane(lane, router)
        for i, mbox in enumerate(lane.mailboxes):
            device = MockDevice(mbox, i)
            device.report(1, 4)
            device.publish(rows(1), [0], [i], [0.5])
            device.wait()
        fits.clear()
        fast.step()
        assert len(router.lane.samples) == 3  # each layer's job was observed
        assert [f for f in fits if f is router.lane] == [router.lane]  # and fitted once


def test_device_counters_are_summed_and_shown_per_layer(table):
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        devs = [MockDeviceLayer(10, 30, 2), MockDeviceLayer(7, 9, 0)]
        st = FastLane(lane, LaneRouter(2, EXPERT_BYTES), devs).stats()
        assert (st["published"], st["lane_picks"], st["fallbacks"]) == (17, 39, 2)
        assert [layer["fallbacks"] for layer in st["layers"]] == [2, 0]


def test_timed_layers_teach_the_router_the_gpus_rates_and_each_layer_gets_its_wait(table):
    """A timed decode call's GPU share (publish to wait) reaches the router with the step's
    resident and zero-copy counts (the misses the lane took are neither); the router's wait
    for the next step lands on the device layer."""
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        devs = [MockDeviceLayer(timings=[(1.5, 0.0)]), MockDeviceLayer()]
        fast = FastLane(lane, LaneRouter(2, EXPERT_BYTES, ct_b=1e-4), devs)
        device = MockDevice(lane.mailboxes[0], 0)
        device.report(3, 5)
        device.publish(rows(2), [0, 1, 1], [3, 3, 4], [0.5, 0.25, 0.25])  # 2 experts sent
        device.wait()
        fast.step()
        assert list(fast.router.gpu.samples) == [((3.0, 3.0), 1.5)]  # 5 misses, 2 on the lane
        assert fast.router.layers[0].waited_ms == 0.0
        layer0 = fast.stats()["layers"][0]  # the timed call's parts, for where the time goes
        assert (layer0["waits"], layer0["gpu_ms"], layer0["waited_ms"]) == (1, 1.5, 0.0)
        assert fast.stats()["layers"][1]["waits"] == 0
        assert fast.rows_per_miss == [1.5, 1.0]  # expert 3 had two rows, expert 4 one
        assert fast.budgets[0] > 0 and devs[0].wait_ns == fast.waits_ns[0] > 0
        assert devs[1].wait_ns == 0  # no report: no step, no wait
        assert fast.stats()["layers"][0]["wait_ns"] == devs[0].wait_ns


def test_a_router_of_another_layer_count_is_refused(table):
    with MailboxLane(CpuLane(LaneLayout((0,))), [table]) as lane:
        with pytest.raises(ValueError, match="the router has 2 layers, the lane 1"):
            FastLane(lane, LaneRouter(2, EXPERT_BYTES))


# --- prefill stays exact ------------------------------------------------------------------------


class MockModel:
    """A mock of exllamav3's Model.prefill: records the params dict it was given."""

    def prefill(self, input_ids, params=None):
        self.seen = params
        return ("prefilled", input_ids)


def test_prefill_chunks_of_any_size_are_marked_exact_and_decode_calls_are_not():
    from glm53.exl3.fast_hooks import (
        NO_LANE,
        exact_call,
        mark_prefill_exact,
        unmark_prefill_exact,
    )
    from glm53.exl3.hooks import DECODE_MAX_ROWS

    model = MockModel()
    mark_prefill_exact(model)
    mark_prefill_exact(model)  # idempotent: one wrapper
    params = {"cache_seqlens": 0}
    assert model.prefill(input_ids=[1, 2, 3], params=params) == ("prefilled", [1, 2, 3])
    assert model.seen is params and params[NO_LANE] is True  # marked in place, not copied
    model.prefill([4])
    assert model.seen == {NO_LANE: True}
    # a 3-row prefill chunk takes the decode kernels, but its params are marked: exact
    assert exact_call(3, params)
    assert not exact_call(DECODE_MAX_ROWS, {})  # a decode step goes to the lane
    assert exact_call(DECODE_MAX_ROWS + 1, {})
    assert exact_call(1, {"activate_all_experts": True})
    unmark_prefill_exact(model)
    fresh = {}
    model.prefill([5], fresh)
    assert fresh == {} and "prefill" not in vars(model)


def _importers(module: str) -> list[str]:
    """The files of the glm53 package that import glm53.<module> (any form)."""
    import ast
    import pathlib

    import glm53

    root, found = pathlib.Path(glm53.__file__).parent, []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if f"glm53.{module}" in names:
                found.append(str(path.relative_to(root)))
                break
    return sorted(found)


def test_the_fast_mode_hooks_are_reached_only_through_fast_mode():
    """fast_hooks is attached by glm53.exl3.fast.start_fast, which only the GPU engine's fast
    mode calls, through glm53.exl3's start_fast;
    nothing else imports either."""
    assert _importers("exl3.fast_hooks") == ["exl3/fast.py"]
    assert _importers("exl3.fast") == ["exl3/__init__.py"]
    assert _importers("tiers.fast_lane") == ["exl3/fast.py"]


# --- /metrics -----------------------------------------------------------------------------------


def test_metrics_export_the_lanes_fallbacks_as_a_counter():
    from glm53.api.metrics import Metrics

    text = Metrics().prometheus({}, {"lane": {"fallbacks": 3, "jobs": 12}}).decode()
    assert "# TYPE glm53_lane_fallbacks_total counter\nglm53_lane_fallbacks_total 3\n" in text
    assert "glm53_lane_jobs_total 12\n" in text
    # without device counters (fallbacks None) no count is claimed; without a lane, no lines
    text = Metrics().prometheus({}, {"lane": {"fallbacks": None, "jobs": 1}}).decode()
    assert "glm53_lane_fallbacks_total" not in text
    assert "glm53_lane_" not in Metrics().prometheus({}, {"iterations": 1}).decode()


# --- the engine's plumbing ---------------------------------------------------------------------


class MockGenerator:
    """A mock of exllamav3's Generator (needs a GPU): an iteration that produced nothing."""

    def __init__(self):
        self.iterations = 0

    def iterate(self):
        self.iterations += 1
        return []


class MockCache:
    """A mock of the VRAM cache's state() (the real one reads the device)."""

    def state(self):
        return {"slots": 8}


class MockLoaded:
    """A mock of exl3_load's Loaded: the VRAM cache, no nvme tier, no stager."""

    ec, nvme, stager = MockCache(), None, None


class MockTokenizer:
    vocab_size = 32


def test_the_gpu_engine_steps_the_lane_after_every_iteration_and_shows_it_in_stats(table):
    """GpuEngine.iterate calls FastLane.step after each Generator iteration, and stats() carries
    the lane's section beside the tiers (the Generator and the load are mocks: they need a GPU;
    the lane and the router are real)."""
    import argparse

    from glm53.config import add_arguments, resolve
    from glm53.engine.gpu_create import create

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    s = resolve(parser.parse_args(["--mode", "fast"]), environ={})[0]
    e = create(s, "/nonexistent")
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        e.loaded, e.generator, e.tokenizer = MockLoaded(), MockGenerator(), MockTokenizer()
        e.fast = FastLane(lane, LaneRouter(2, EXPERT_BYTES, ct_b=1e-4))
        MockDevice(lane.mailboxes[0], 0).report(1, 3)
        assert e.iterate() == []
        assert e.fast.steps == 1 and e.fast.budgets[0] > 0 and e.fast.budgets[1] == 0
        e.iterate()
        st = e.stats()
        assert st["iterations"] == 2 and st["tiers"]["vram_cache"] == {"slots": 8}
        assert st["lane"]["steps"] == 2 and st["lane"]["layers"][0]["budget"] > 0
        e.loaded = e.fast = None  # nothing real to close
