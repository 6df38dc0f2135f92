"""Fast mode's GPU <-> CPU-lane hand-off (pyx/lane_mailbox.h, pyx/lane.c), host side.

The device side (cuda/lane.cu) cannot run here, so `MockDevice`, a host thread, plays the GPU's
role through the same memory protocol: it writes picks and rows, release-stores seq last, waits a
bounded time for done == seq and then reads the partial; on a timeout it takes the fallback (it
computes the picks itself, standing in for the GPU's second, zero-copy MoE call), counts it and
moves on. The lane under test is the real one: the native poller running the real MoE job on a
real CpuLane pool. tests/gpu/test_lane_mailbox_gpu.py runs the real kernels (passed on an H200
on 2026-12-02 and 2026-12-05).
"""

import importlib.util
import threading
import time

import numpy as np
import pytest

from glm53 import _lane
from glm53.tiers.cpu_lane import (
    FAST_REL_TOL,
    CpuLane,
    LaneLayout,
    expert_table,
    random_expert,
    reference_moe,
)
from glm53.tiers.lane_mailbox import (
    IDLE_SPIN_NS,
    LANE_DEV_FIELDS,
    MAX_PICKS,
    MAX_ROWS,
    Mailbox,
    MailboxLane,
    lane_dev_dtype,
)

HIDDEN, INTER = 256, 256
EXACT_REL_TOL = 1e-5  # the exact lane's fp32 against fp64 (tests/test_gemv.py's REL_TOL)
SETTLE_S = 10.0  # a wait that must succeed: generous, it ends as soon as done lands


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


class MockDevice:
    """A mock of the device's side of one mailbox (the real one is cuda/lane.cu)."""

    def __init__(self, mbox: Mailbox, layer: int = 0):
        self.mbox, self.layer = mbox, layer
        self.seq = mbox.seq
        self.fallbacks = 0

    def publish(self, x: np.ndarray, rows, experts, weights) -> int:
        m = self.mbox
        n = len(rows)
        m.rows[: len(x)] = x
        m.picks["row"][:n], m.picks["expert"][:n], m.picks["weight"][:n] = rows, experts, weights
        m.header[1], m.header[2], m.header[3] = n, len(x), self.layer
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        m.store("seq", self.seq)  # last, with release: the payload is visible first
        return self.seq

    def wait(self, budget_s: float) -> bool:
        """Whether done == this seq within budget_s; a done of any other seq is ignored."""
        end = time.monotonic() + budget_s
        while self.mbox.done != self.seq:
            if time.monotonic() > end:
                self.fallbacks += 1
                return False
            time.sleep(50e-6)
        return True

    def partial(self, num_rows: int) -> np.ndarray:
        return self.mbox.partial[:num_rows].copy()


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(16)
    experts = [random_expert(rng, HIDDEN, INTER, 3) for _ in range(12)]
    return experts, expert_table(experts)


def fp16_rows(rng, num_rows):
    """MoE input rows as the device sends them: fp16 values, converted exactly to fp32."""
    return (rng.standard_normal((num_rows, HIDDEN)) * 4).astype(np.float16).astype(np.float32)


def random_picks(rng, num_rows, num_experts, num_picks):
    rows = rng.integers(0, num_rows, num_picks).astype(np.int32)
    rows[: min(num_rows, num_picks)] = np.arange(min(num_rows, num_picks))  # most rows get one
    experts = rng.integers(0, num_experts, num_picks).astype(np.int32)
    weights = rng.uniform(0.05, 0.4, num_picks).astype(np.float16).astype(np.float32)
    return rows, experts, weights


@pytest.mark.parametrize("precision, tol", [("exact", EXACT_REL_TOL), ("fast", FAST_REL_TOL)])
def test_published_picks_come_back_as_the_lanes_own_result_within_the_bound(layer, precision, tol):
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)), precision=precision)
    rng = np.random.default_rng(1)
    with MailboxLane(cpu, [table]) as lane:
        device = MockDevice(lane.mailboxes[0])
        for num_rows in (1, 3, 8):
            x = fp16_rows(rng, num_rows)
            rows, ids, weights = random_picks(rng, num_rows, len(experts), 2 * num_rows)
            device.publish(x, rows, ids, weights)
            assert device.wait(SETTLE_S)
            got = device.partial(num_rows)
            assert np.array_equal(got, cpu.run(table, x, rows, ids, weights))  # same job, same bits
            assert rel_err(got, reference_moe(x, rows, ids, weights, experts)) < tol
        assert lane.stats()["jobs"] == 3 and device.fallbacks == 0


def test_a_stalled_lane_falls_back_and_its_late_result_never_lands_in_the_next_step(layer):
    """The device gives up on seq N and publishes N + 1 while the lane still holds N's result:
    the lane sees seq move on and drops it; N + 1's partial is N + 1's own."""
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)))
    rng = np.random.default_rng(2)
    with MailboxLane(cpu, [table]) as lane:
        device = MockDevice(lane.mailboxes[0])
        stalled = device.seq + 1
        lane.poller.stall(0, stalled)
        x1 = fp16_rows(rng, 4)
        p1 = random_picks(rng, 4, len(experts), 6)
        device.publish(x1, *p1)
        assert not device.wait(0.05)  # held: the bounded wait times out
        assert device.fallbacks == 1
        fallback = cpu.run(table, x1, *p1)  # the GPU's recompute, played by the mock
        assert np.abs(fallback).max() > 0

        x2 = fp16_rows(rng, 2)
        p2 = random_picks(rng, 2, len(experts), 3)
        device.publish(x2, *p2)
        while not lane.poller.held:  # the lane has computed N's result and holds it
            time.sleep(1e-3)
        lane.poller.release()
        assert device.wait(SETTLE_S)
        assert np.array_equal(device.partial(2), cpu.run(table, x2, *p2))
        st = lane.stats()
        assert (st["discarded"], st["jobs"], st["failed"]) == (1, 1, 0)
        assert lane.mailboxes[0].done == stalled + 1


def test_a_late_done_for_an_abandoned_seq_is_ignored_by_the_device(layer):
    """The other order: the lane publishes N after the device timed out on it but before the
    device moved on. The device waits for done == N + 1, so the stale done and partial of N are
    never taken for N + 1's."""
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)))
    rng = np.random.default_rng(3)
    with MailboxLane(cpu, [table]) as lane:
        mbox = lane.mailboxes[0]
        device = MockDevice(mbox)
        lane.poller.stall(0, device.seq + 1)
        x1, p1 = fp16_rows(rng, 3), random_picks(rng, 3, len(experts), 5)
        late = device.publish(x1, *p1)
        assert not device.wait(0.05)
        lane.poller.release()
        while mbox.done != late:  # the late result lands between the steps
            time.sleep(1e-3)
        lane.poller.stall(0, late + 1)  # and N + 1 is slow too: its wait must not take N's done
        x2, p2 = fp16_rows(rng, 3), random_picks(rng, 3, len(experts), 4)
        device.publish(x2, *p2)
        assert not device.wait(0.05)  # done == N is in the mailbox all along
        assert mbox.done == late and device.fallbacks == 2
        lane.poller.release()
        assert device.wait(SETTLE_S)
        assert np.array_equal(device.partial(3), cpu.run(table, x2, *p2))


def test_many_steps_over_layers_lose_and_duplicate_nothing(layer):
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)))
    rng = np.random.default_rng(4)
    num_layers, num_steps = 3, 60
    with MailboxLane(cpu, [table] * num_layers) as lane:
        devices = [MockDevice(m, i) for i, m in enumerate(lane.mailboxes)]
        expected_jobs = expected_empty = 0
        jobs_per_layer = [0] * num_layers
        for _ in range(num_steps):
            num_rows = int(rng.integers(1, MAX_ROWS + 1))
            for device in devices:  # the layers of one decode step, in order
                x = fp16_rows(rng, num_rows)
                num_picks = int(rng.integers(0, min(MAX_PICKS, 3 * num_rows) + 1))
                picks = random_picks(rng, num_rows, len(experts), num_picks)
                seq = device.publish(x, *picks)
                assert device.wait(SETTLE_S)
                assert device.mbox.done == seq
                if num_picks:
                    expected_jobs += 1
                    jobs_per_layer[device.layer] += 1
                    assert np.array_equal(device.partial(num_rows), cpu.run(table, x, *picks)), (
                        f"layer {device.layer} seq {seq}"
                    )
                else:
                    expected_empty += 1
        st = lane.stats()
        assert (st["jobs"], st["empty"], st["discarded"], st["failed"]) == (
            expected_jobs,
            expected_empty,
            0,
            0,
        )
        assert [d.seq for d in devices] == [num_steps] * num_layers
        assert [layer["jobs"] for layer in st["layers"]] == jobs_per_layer
        assert sum(layer["busy_ns"] for layer in st["layers"]) == st["busy_ns"]
        assert sum(d.fallbacks for d in devices) == 0


def test_a_bad_payload_gets_no_done_and_the_device_falls_back(layer):
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)))
    rng = np.random.default_rng(5)
    with MailboxLane(cpu, [table]) as lane:
        mbox = lane.mailboxes[0]
        device = MockDevice(mbox)
        x = fp16_rows(rng, 2)
        device.publish(x, [0, 1], [3, len(experts)], [0.5, 0.5])  # expert out of range
        assert not device.wait(0.05)
        assert mbox.status == 1  # GEMV_EINVAL
        good = random_picks(rng, 2, len(experts), 2)
        device.publish(x, *good)  # the next step is served
        assert device.wait(SETTLE_S)
        assert np.array_equal(device.partial(2), cpu.run(table, x, *good))
        assert lane.stats()["failed"] == 1


@pytest.mark.parametrize("state", ["idle", "sleeping", "stalled"])
def test_shutdown_while_waiting_never_hangs(layer, state):
    experts, table = layer
    cpu = CpuLane(LaneLayout((0,)))
    lane = MailboxLane(cpu, [table], spin_ns=0 if state == "sleeping" else 200_000)
    if state == "stalled":
        device = MockDevice(lane.mailboxes[0])
        lane.poller.stall(0, device.seq + 1)
        device.publish(fp16_rows(np.random.default_rng(6), 1), [0], [1], [1.0])
        while not lane.poller.held:
            time.sleep(1e-3)
    elif state == "sleeping":
        time.sleep(0.01)
    closer = threading.Thread(target=lane.close)
    closer.start()
    closer.join(SETTLE_S)
    assert not closer.is_alive()
    with pytest.raises(RuntimeError, match="the lane is closed"):
        lane.poller.stats()


def test_layout_is_the_documented_one_and_bad_slots_are_refused(layer):
    _, table = layer
    lay = _lane.layout(4096)
    assert (lay["seq"], lay["done"], lay["picks"], lay["rows"]) == (0, 64, 128, 1024)
    assert lay["partial"] == 1024 + 8 * 4096 * 4 and lay["bytes"] == 263_168
    assert lay["picks"] + MAX_PICKS * lay["pick_bytes"] <= lay["rows"]
    poller = _lane.Lane(CpuLane(LaneLayout((0,))).pool, 1)
    with pytest.raises(ValueError, match="the mailbox must be a writable contiguous uint8 array"):
        poller.set_slot(0, np.zeros(10, np.uint8), table)
    with pytest.raises(RuntimeError, match="slot 0 has no mailbox; bind every slot first"):
        poller.start()
    with pytest.raises(ValueError, match="slot 3 is outside 0..0"):
        poller.set_slot(3, Mailbox(HIDDEN).buf, table)
    poller.close()


@pytest.mark.skipif(
    importlib.util.find_spec("glm53._cuda") is None,
    reason="glm53 was built without nvcc (-Dcuda=disabled or none found)",
)
def test_the_cuda_library_reads_the_same_layout():
    from glm53 import _cuda

    for hidden in (256, 4096, 6144):
        lay = _lane.layout(hidden)
        names = ("seq", "done", "budget", "picks", "rows", "partial", "bytes")
        assert _cuda.lane_mbox_layout(hidden) == [lay[n] for n in names]
    layout = _cuda.lane_dev_layout()
    dt = lane_dev_dtype(layout)
    assert dt.itemsize == layout[-1]
    assert [dt.fields[n][1] for n, _ in LANE_DEV_FIELDS] == layout[:-1]
    with pytest.raises(RuntimeError, match="rebuild glm53"):
        lane_dev_dtype([0, 8])


def test_reports_carry_the_devices_counts_the_sent_rows_and_the_lanes_newest_job(layer):
    """Between steps the host reads each layer's report once: the device's hits and misses,
    the rows per expert of what it sent, and the lane's newest job (its rows per expert from
    the payload it computed, and its time)."""
    experts, table = layer
    with MailboxLane(CpuLane(LaneLayout((0,))), [table, table]) as lane:
        for i, mbox in enumerate(lane.mailboxes):
            mbox.header[4], mbox.header[5] = 2, 6 + i  # as the device's publish writes them
        reports = lane.take_reports()
        assert [(r.n_hit, r.n_miss, r.sent_rows, r.job_rows) for r in reports] == [
            (2, 6, [], []),
            (2, 7, [], []),
        ]
        # read once: a step without a decode call reports nothing
        assert [(r.n_hit, r.n_miss) for r in lane.take_reports()] == [(0, 0), (0, 0)]
        device = MockDevice(lane.mailboxes[1], 1)
        lane.mailboxes[1].header[4], lane.mailboxes[1].header[5] = 1, 3
        rows = fp16_rows(np.random.default_rng(7), 2)
        device.publish(rows, [0, 1, 1, 0], [1, 2, 1, 3], [0.5, 0.5, 0.25, 0.25])
        assert device.wait(SETTLE_S)
        rep = lane.take_reports()[1]
        assert (rep.n_hit, rep.n_miss, rep.sent_rows, rep.job_rows) == (1, 3, [2, 1, 1], [2, 1, 1])
        assert rep.job_ms > 0
        again = lane.take_reports()[1]  # the job is reported once
        assert (again.sent_rows, again.job_rows) == ([], [])


@pytest.mark.parametrize("lane_ms, sends", [(1e-4, True), (1e3, False)])
def test_budgets_follow_the_router_on_the_reported_misses(layer, lane_ms, sends):
    """The device reports a layer's hits and misses in the mailbox; between steps the router
    turns them into that layer's budget: some misses for a lane much faster than the link, none
    for one far slower (fast mode then runs as exact mode)."""
    from glm53.tiers.fast_lane import FastLane
    from glm53.tiers.lane_router import LaneRouter

    experts, table = layer
    cpu = CpuLane(LaneLayout((0,)))
    with MailboxLane(cpu, [table, table]) as lane:
        router = LaneRouter(2, expert_bytes=9_440_000, ct_b=lane_ms)
        for i, mbox in enumerate(lane.mailboxes):
            mbox.header[4], mbox.header[5] = 2, 6 + i  # as the device's publish writes them
        fast = FastLane(lane, router)
        budgets = fast.step()
        assert [m.load("budget") for m in lane.mailboxes] == budgets
        if sends:
            assert all(0 < k <= n for k, n in zip(budgets, (6, 7), strict=True)), budgets
        else:
            assert budgets == [0, 0]
        # a published job's time reaches the router as the lane's time for its layer
        device = MockDevice(lane.mailboxes[1], 1)
        device.publish(fp16_rows(np.random.default_rng(7), 1), [0, 0], [1, 2], [0.5, 0.5])
        assert device.wait(SETTLE_S)
        fast.step()
        assert router.layers[1].lane_ms > 0 and router.layers[0].lane_ms == 0
        # one job seen: the first of its row count, warm-up (counted, not fitted)
        assert router.seen_by_rows[0] == 1 and router.lane.n == 0


@pytest.mark.parametrize("spin_us", [0, 200, 50_000])
def test_the_lanes_idle_spin_is_set_live_and_every_job_is_answered_at_any_spin(layer, spin_us):
    """MailboxLane.idle_spin_ns sets the poller's and the pool's workers' spin after a job while
    they run (bench/gpu_slice.py --lane-spin-us sweeps it). At 0 both sleep after every job, so
    each job after a pause is picked up from sleep (the poller's nanosleep, the workers' futex):
    none is lost and each partial is still the lane's own result, bit for bit."""
    experts, table = layer
    cpu = CpuLane(LaneLayout((0, 0)))
    rng = np.random.default_rng(30 + spin_us)
    with MailboxLane(cpu, [table]) as lane:
        assert lane.idle_spin_ns == IDLE_SPIN_NS == cpu.pool.idle_spin_ns  # the default, both
        lane.idle_spin_ns = spin_us * 1000
        assert lane.idle_spin_ns == spin_us * 1000 == lane.poller.spin_ns
        assert cpu.pool.idle_spin_ns == spin_us * 1000
        device = MockDevice(lane.mailboxes[0])
        for i in range(6):
            if i % 2:  # past a 0 or 200 us spin (the lane is asleep when this comes), inside 50 ms
                time.sleep(0.002)
            x = fp16_rows(rng, 2)
            rows, ids, weights = random_picks(rng, 2, len(experts), 4)
            device.publish(x, rows, ids, weights)
            assert device.wait(SETTLE_S), f"job {i} at a {spin_us} us spin was not answered"
            assert np.array_equal(device.partial(2), cpu.run(table, x, rows, ids, weights))
        assert lane.stats()["jobs"] == 6 and device.fallbacks == 0
        with pytest.raises(ValueError, match="idle_spin_ns must be >= 0"):
            lane.idle_spin_ns = -1
        with pytest.raises(ValueError, match="Pool.idle_spin_ns must be >= 0"):
            cpu.pool.idle_spin_ns = -1
        with pytest.raises(ValueError, match="Lane.spin_ns must be >= 0"):
            lane.poller.spin_ns = -1
