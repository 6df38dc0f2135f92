"""Pinning the engine thread and the server's event loop to the cores the CPU lane leaves them.

Fast mode's lane (glm53.tiers.cpu_lane.lane_layout) runs one worker on every physical core of
the GPU's NUMA node but the first RESERVED_CORES, and leaves those (`LaneLayout.reserved`, SMT
siblings included) to the engine thread, which drives exllamav3's Generator, and to the event
loop, which serves HTTP. Left unpinned, the OS may run either of them on a lane core, where
it takes turns with a worker in the middle of a job and the GPU waits for both.

`pin_server_threads` runs on the event loop's thread once the engine has loaded (glm53.api.app):
it pins the engine thread, found as the thread that built the fast lane (the engine's load runs
on the engine thread), the lane's mailbox poller (a native thread that hands each published job
to the workers and writes its result back: on a lane core it would take turns with that core's
worker, and every job's fork-join would wait for both), and the loop's own thread. An
in-process driver (the benches' lane rows) pins itself and the poller the same way for a while
(`lane_threads_pinned`), so that it measures the served layout. `os.sched_setaffinity` on Linux sets one
thread's mask when given its native id (`threading.get_native_id()`), not the process's.
Threads a pinned thread starts later inherit its mask (from the loop thread: the offload
threads, created on first use, and any thread asyncio's default pool adds), which keeps them off
the lane's cores as well; threads started before (the lane's own workers, pinned one per core;
granian's; the default pool's thread that ran the engine's construction) keep theirs.
Nothing is pinned for an engine without a lane, or when the user chose the lane's CPUs
(--cpus): the layout then reserves none.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import msgspec


class ThreadPin(msgspec.Struct, frozen=True):
    """One thread's pin: its role, its native id and the CPUs it may run on now."""

    role: str  # "engine" or "event_loop"
    native_id: int
    cpus: tuple[int, ...]


def pin_thread(role: str, native_id: int, cpus: Iterable[int]) -> ThreadPin:
    """Pin the thread of this process with `native_id` to `cpus` (within the process's affinity
    mask) and return the pin as the kernel reports it back."""
    wanted = sorted(set(cpus))
    if not wanted:
        raise ValueError(f"pin_thread({role!r}): no CPU to pin to")
    os.sched_setaffinity(native_id, wanted)
    return ThreadPin(role, native_id, tuple(sorted(os.sched_getaffinity(native_id))))


def pin_server_threads(engine) -> dict[str, ThreadPin]:
    """Call on the event loop's thread once `engine` has loaded: pin the engine thread, the
    lane's poller and this thread to the CPUs its lane layout reserves, and return the pins by
    role. Empty for an
    engine without a lane (the GPU engine's modes but fast, the CPU and scripted engines) and
    for a layout that reserves none (--cpus)."""
    fast = engine.fast  # the GPU engine's FastLane in fast mode, else None
    if fast is None:
        return {}
    reserved = fast.lane.lane.layout.reserved
    if not reserved:
        return {}
    return {
        **pin_lane_threads(fast.lane, fast.owner_native_id),
        "event_loop": pin_thread("event_loop", threading.get_native_id(), reserved),
    }


def pin_lane_threads(lane, engine_native_id: int) -> dict[str, ThreadPin]:
    """Pin the engine thread (`engine_native_id`) and the mailbox poller of `lane` (a
    glm53.tiers.lane_mailbox.MailboxLane: FastLane.lane) to the CPUs its layout reserves, and
    return the pins by role; empty for a layout that reserves none (--cpus)."""
    reserved = lane.lane.layout.reserved
    if not reserved:
        return {}
    poller = lane.poller.native_id
    if poller <= 0:  # 0 would make sched_setaffinity pin the calling thread instead
        raise RuntimeError("internal error: the lane's poller has no thread id (not started?)")
    return {
        "engine": pin_thread("engine", engine_native_id, reserved),
        "lane_poller": pin_thread("lane_poller", poller, reserved),
    }


@contextmanager
def lane_threads_pinned(lane, enabled: bool = True) -> Iterator[dict[str, ThreadPin]]:
    """For an in-process driver (the benches): pin the calling thread, which drives the engine,
    and `lane`'s poller as the server pins them (pin_lane_threads; nothing when not `enabled`),
    yield the pins, and give the calling thread its own mask back on the way out (the poller
    ends with its lane)."""
    mask = os.sched_getaffinity(0)
    try:
        yield pin_lane_threads(lane, threading.get_native_id()) if enabled else {}
    finally:
        os.sched_setaffinity(0, mask)
