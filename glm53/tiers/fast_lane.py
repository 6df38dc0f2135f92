"""Fast mode's host side in the GPU engine: the CPU lane over the pinned home, the router, and
the per-step plumbing between them: `glm53 serve --mode fast` (glm53.engine.gpu_create.create).
Its device-side tests passed on an H200 (2026-12-02: 21 of 22, the one failure a fidelity bound;
tests/gpu/test_fast_mode_gpu.py and the lane's; 2026-12-05: the lane's and the kernel's again,
bench/gpu_slice.py's fast row, and test_fast_mode_gpu.py 5 of 5 against exllamav3's own floor).
docs/fast-mode.md has the protocol.

`glm53.exl3.fast.start_fast` builds it on an exact-mode load: a `MailboxLane` whose expert tables
point into the pinned home's arenas (the lane reads the same bytes the GPU reads zero-copy: no
second copy in RAM), glm53.exl3.fast_hooks' `FastLayer` on every MoE module, and a
`LaneRouter`. Between Generator iterations the engine calls `FastLane.step`: the router sees each
layer's newest lane time and the device's timed layers, and sets each layer's budget and wait for
the next step (one step late: docs/fast-mode.md). `FastLane` itself needs no CUDA (its device layers are optional), so CI drives it against a mock device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from glm53.tiers.lane_mailbox import MAX_PICKS, MailboxLane
from glm53.tiers.lane_router import LaneRouter

STATUS = (
    "served; GPU tests passed on an H200 (2026-12-05: 5 of 5, inside exllamav3's own "
    "batch-1-vs-batch-4 floor; the lane's device tests the same day)"
)
# nvme mode's lane (the same FastLane over the RAM tier, glm53.tiers.nvme_lane)
NVME_STATUS = (
    "nvme mode: the lane over the RAM tier; served; its GPU tests passed on an H200 "
    "(2026-12-05: 6 of 6)"
)


class FastLane:
    """The lane, the router and (on the GPU path) the device layers of one fast-mode engine.
    Owned by the engine thread; `stats` may run on another thread under the engine's lock."""

    def __init__(
        self, lane: MailboxLane, router: LaneRouter, layers: Sequence = (), status: str = STATUS
    ):
        """`status` is what /stats says of this lane (STATUS: fast mode's; NVME_STATUS)."""
        if router.n_layers != len(lane.mailboxes):
            raise ValueError(
                f"the router has {router.n_layers} layers, the lane {len(lane.mailboxes)}"
            )
        self.lane, self.router, self.layers = lane, router, list(layers)
        self.status = status
        # the thread that built it: in the server, the engine thread (its load runs there),
        # which glm53.tiers.thread_pins pins to the cores the lane leaves
        self.owner_native_id = threading.get_native_id()
        self.steps = 0
        self.budgets = [int(m.load("budget")) for m in lane.mailboxes]
        self.waits_ns = [0] * len(lane.mailboxes)  # the router's wait per layer, newest step
        self.rows_per_miss = [1.0] * len(lane.mailboxes)

    def step(self) -> list[int]:
        """Between Generator iterations: the lane's newest job times and (on the GPU path) the
        device's timed layers reach the router; the router's split of each layer's last
        reported misses becomes that layer's budget for the next decode step, and its
        predicted wait the device layer's wait. Rows per missed expert are not reported, so
        each miss counts as the mean rows per expert of the layer's last lane payload (1 before
        any). A layer with no decode call since the last step keeps its budget and is not
        counted again. Returns the budgets.

        Every layer's measurements reach the router before any layer is split: the router
        refits its rates once per step, not once per layer (a refit is a least-squares solve
        over the window, a few hundred us of the engine thread's time, which the GPU waits
        for between iterations)."""
        reports = self.lane.take_reports()
        for i, rep in enumerate(reports):
            if rep.job_rows:
                self.router.observe_lane(i, rep.job_rows, rep.job_ms)
            if rep.sent_rows:
                self.rows_per_miss[i] = sum(rep.sent_rows) / len(rep.sent_rows)
            timing = self.layers[i].take_timing() if self.layers else None
            if timing is not None and rep.n_hit + rep.n_miss:
                gpu_ms, waited_ms = timing
                self.router.observe_gpu(rep.n_hit, rep.n_miss - len(rep.sent_rows), gpu_ms)
                self.router.observe_wait(i, waited_ms, gpu_ms)
        for i, rep in enumerate(reports):
            if rep.n_hit == 0 and rep.n_miss == 0:
                continue
            k = self.router.split(i, rep.n_hit, [self.rows_per_miss[i]] * rep.n_miss)
            self.lane.mailboxes[i].set_budget(min(k, MAX_PICKS))
            self.budgets[i] = k
            self.waits_ns[i] = self.router.layers[i].wait_ns
            if self.layers:
                self.layers[i].wait_ns = self.waits_ns[i]
        self.steps += 1
        return list(self.budgets)

    def device_counters(self) -> list[dict]:
        """Per layer, the device's published / lane_picks / fallbacks (reads the device)."""
        return [layer.counters() for layer in self.layers]

    def stats(self) -> dict:
        """For /stats: the lane's counters and time, the router's rates, and per layer the split,
        the budget, the lane's jobs and time and (on the GPU path) the device's counts. The
        fallbacks are None without device layers: only the device knows them."""
        lane = self.lane.stats()
        router = self.router.stats()
        dev = self.device_counters()
        layers = []
        for i, (r, slot) in enumerate(zip(router["layers"], lane["layers"], strict=True)):
            entry = {
                "split": r["split"],
                "budget": self.budgets[i],
                "wait_ns": self.waits_ns[i],
                "waited_ms": r["waited_ms"],
                "waits": r["waits"],
                "gpu_ms": r["gpu_ms"],
                "probes": r["probes"],
                "to_lane": r["to_lane"],
                "misses": r["misses"],
                "lane_jobs": slot["jobs"],
                "lane_ms": slot["busy_ns"] / 1e6,
                "lane_ms_per_step": r["lane_ms_per_step"],
            }
            if dev:
                entry.update(dev[i])
            layers.append(entry)
        return {
            "status": self.status,
            "kernel": self.lane.lane.kernel_name,
            "threads": self.lane.lane.layout.threads,
            "steps": self.steps,
            "jobs": lane["jobs"],
            "empty": lane["empty"],
            "discarded": lane["discarded"],
            "failed": lane["failed"],
            "lane_ms": lane["busy_ns"] / 1e6,
            "published": sum(d["published"] for d in dev) if dev else None,
            "lane_picks": sum(d["lane_picks"] for d in dev) if dev else None,
            "fallbacks": sum(d["fallbacks"] for d in dev) if dev else None,
            "rates": router["rates"],
            "lane_warmup_jobs": router["lane_warmup_jobs"],
            "lane_probe_jobs": router["lane_probe_jobs"],
            "lane_rejected": router["lane_rejected"],
            "ct_b": router["ct_b"],
            "forced_share": router["forced_share"],
            "layers": layers,
        }

    def close(self) -> None:
        self.lane.close()
