"""Fast mode's engine thread and event loop on the cores the CPU lane leaves
(glm53.tiers.thread_pins, LaneLayout.reserved): which CPUs the layout reserves, and that a pin
sets the affinity of the thread it names and of no other. The pins are real
(os.sched_setaffinity) on this host's own CPUs; the lane is the real one over a small table.
The server's side (glm53.api.app) pins only a GPU engine in fast mode, which needs a GPU."""

import os
import queue
import threading

import numpy as np
import pytest
from test_gemv import fake_topology
from test_lane_mailbox import MockDevice

from glm53.tiers import cpu_lane
from glm53.tiers.cpu_lane import CpuLane, LaneLayout, expert_table, lane_layout, random_expert
from glm53.tiers.fast_lane import FastLane
from glm53.tiers.lane_mailbox import MailboxLane
from glm53.tiers.lane_router import LaneRouter
from glm53.tiers.thread_pins import ThreadPin, lane_threads_pinned, pin_server_threads, pin_thread

SETTLE_S = 10.0  # a wait that must succeed: it ends as soon as the thread answers


def test_the_layout_reserves_the_first_two_cores_with_their_smt_siblings(tmp_path, monkeypatch):
    # 6 cores with SMT siblings numbered after them (cpus 6-11), as Linux numbers them
    fake_topology(tmp_path, [(0, c) for c in range(6)] * 2)
    monkeypatch.setattr(cpu_lane, "SYS_CPU", tmp_path)
    monkeypatch.setattr(cpu_lane.os, "sched_getaffinity", lambda pid: set(range(12)))
    assert lane_layout().reserved == (0, 1, 6, 7)
    assert lane_layout(threads=4).reserved == (0, 1, 6, 7)
    assert lane_layout(threads=5).reserved == (1, 7)  # the lane took core 0 as well
    assert lane_layout(threads=6).reserved == ()
    assert lane_layout(cpus="2-5").reserved == ()  # --cpus: the user placed the lane


def test_a_two_core_host_reserves_the_core_the_lane_leaves(tmp_path, monkeypatch):
    fake_topology(tmp_path, [(0, 0), (0, 1)])
    monkeypatch.setattr(cpu_lane, "SYS_CPU", tmp_path)
    monkeypatch.setattr(cpu_lane.os, "sched_getaffinity", lambda pid: {0, 1})
    layout = lane_layout()
    assert (layout.cpus, layout.reserved) == ((1,), (0,))


class Runner:
    """A started thread that runs the functions given to `run`, one at a time, and returns
    their results (a stand-in for the engine thread or the event loop's thread)."""

    def __init__(self):
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="pin-test", daemon=True)
        self.thread.start()
        self.native_id = self.run(threading.get_native_id)

    def _serve(self):
        while (fn := self._todo.get()) is not None:
            self._done.put(fn())

    def run(self, fn):
        self._todo.put(fn)
        return self._done.get(timeout=SETTLE_S)

    def own_affinity(self) -> set[int]:
        return self.run(lambda: os.sched_getaffinity(0))

    def stop(self):
        self._todo.put(None)
        self.thread.join(SETTLE_S)


def test_a_pin_sets_the_affinity_of_the_thread_it_names_and_no_other():
    mask = os.sched_getaffinity(0)
    one = max(mask)
    other = Runner()
    try:
        pin = pin_thread("engine", other.native_id, [one])
        assert pin == ThreadPin("engine", other.native_id, (one,))
        assert other.own_affinity() == {one}
        assert os.sched_getaffinity(0) == mask  # this thread kept its mask
    finally:
        other.stop()
    with pytest.raises(ValueError, match="no CPU to pin to"):
        pin_thread("engine", threading.get_native_id(), [])


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(2626)
    return expert_table([random_expert(rng, 256, 256, 3) for _ in range(4)])


class MockEngine:
    """A mock of the engine member that pin_server_threads reads (`fast`: the GPU engine's
    FastLane in fast mode, None for every other engine; the real GpuEngine needs a GPU)."""

    def __init__(self, fast):
        self.fast = fast


def test_the_server_pins_the_lanes_builder_and_its_own_thread_to_the_reserved_cpus(table):
    """A FastLane built on an "engine" thread (as the engine's load builds it), then
    pin_server_threads called on a "loop" thread: both run on the layout's reserved CPUs
    after, and the thread that runs the test is left alone."""
    mask = os.sched_getaffinity(0)
    reserved = (min(mask),)  # a fake layout over this host's CPUs: the lane on the last one
    layout = LaneLayout((max(mask),), "a test layout", reserved)
    engine, loop = Runner(), Runner()
    try:
        with MailboxLane(CpuLane(layout), [table]) as lane:
            fast = engine.run(lambda: FastLane(lane, LaneRouter(1, 9_440_000)))
            assert fast.owner_native_id == engine.native_id
            poller = lane.poller.native_id
            assert poller > 0 and poller not in (engine.native_id, loop.native_id)
            pins = loop.run(lambda: pin_server_threads(MockEngine(fast)))
            assert pins == {
                "engine": ThreadPin("engine", engine.native_id, reserved),
                "lane_poller": ThreadPin("lane_poller", poller, reserved),
                "event_loop": ThreadPin("event_loop", loop.native_id, reserved),
            }
            assert engine.own_affinity() == loop.own_affinity() == set(reserved)
            assert os.sched_getaffinity(poller) == set(reserved)
            assert os.sched_getaffinity(0) == mask
    finally:
        engine.stop()
        loop.stop()


def test_an_in_process_driver_pins_its_own_thread_and_the_poller(table):
    """The benches' lane rows: lane_threads_pinned on the thread that drives the engine pins it
    and the mailbox poller (a native thread) as pin_lane_threads does, the poller still answers
    jobs, and the driver gets its own mask back on the way out."""
    mask = os.sched_getaffinity(0)
    reserved = (min(mask),)
    layout = LaneLayout((max(mask),), "a test layout", reserved)
    driver = Runner()
    try:
        with MailboxLane(CpuLane(layout), [table]) as lane:
            poller = lane.poller.native_id
            before = os.sched_getaffinity(poller)

            def off():
                with lane_threads_pinned(lane, enabled=False) as pins:
                    return pins, os.sched_getaffinity(0)

            assert driver.run(off) == ({}, mask)  # not enabled: nothing pinned
            pinned = lane_threads_pinned(lane)
            pins = driver.run(pinned.__enter__)
            assert pins == {
                "engine": ThreadPin("engine", driver.native_id, reserved),
                "lane_poller": ThreadPin("lane_poller", poller, reserved),
            }
            assert before == mask and os.sched_getaffinity(poller) == set(reserved)
            assert driver.own_affinity() == set(reserved) and os.sched_getaffinity(0) == mask
            # a job published after the pin is answered, the same bits as the lane's own run
            device = MockDevice(lane.mailboxes[0])
            rows, ids, weights = [0, 0], [1, 3], [0.25, 0.5]
            x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float16)
            x = x.astype(np.float32)
            device.publish(x, rows, ids, weights)
            assert device.wait(SETTLE_S)
            cpu = lane.lane
            assert np.array_equal(device.partial(1), cpu.run(table, x, rows, ids, weights))
            driver.run(lambda: pinned.__exit__(None, None, None))
            assert driver.own_affinity() == mask  # the driver's own mask is back
    finally:
        driver.stop()


def test_nothing_is_pinned_without_a_lane_or_without_reserved_cpus(table):
    mask = os.sched_getaffinity(0)
    assert pin_server_threads(MockEngine(None)) == {}  # every engine and mode but fast
    with MailboxLane(CpuLane(LaneLayout((max(mask),), "from --cpus")), [table]) as lane:
        fast = FastLane(lane, LaneRouter(1, 9_440_000))
        assert pin_server_threads(MockEngine(fast)) == {}
    assert os.sched_getaffinity(0) == mask
