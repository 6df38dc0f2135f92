"""Fast mode's host side in the GPU engine: the CPU lane over the pinned home, the router, and
the per-step plumbing between them. NOT YET RUN ON A GPU: `glm53 serve --mode fast` reaches this
only with --allow-unrun-modes (glm53.engine.gpu.create), for its GPU tests
(tests/gpu/test_fast_mode_gpu.py). docs/fast-mode.md has the protocol.

`start_fast` builds it on an exact-mode load: a `MailboxLane` whose expert tables point into the
pinned home's arenas (the lane reads the same bytes the GPU reads zero-copy: no second copy in
RAM), fast_hooks' `FastLayer` on every MoE module, and a `LaneRouter`. Between Generator
iterations the engine calls `FastLane.step`: the router sees each layer's newest lane time and
the device's timed layers, and sets each layer's budget and wait for the next step (one step
late: docs/fast-mode.md). `FastLane` itself
needs no CUDA (its device layers are optional), so CI drives it against a mock device.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

import numpy as np

from glm53.tiers.lane_mailbox import MAX_PICKS, MailboxLane
from glm53.tiers.lane_router import LaneRouter

STATUS = "written, not yet run on a GPU (served only with --allow-unrun-modes)"


class FastLane:
    """The lane, the router and (on the GPU path) the device layers of one fast-mode engine.
    Owned by the engine thread; `stats` may run on another thread under the engine's lock."""

    def __init__(self, lane: MailboxLane, router: LaneRouter, layers: Sequence = ()):
        if router.n_layers != len(lane.mailboxes):
            raise ValueError(
                f"the router has {router.n_layers} layers, the lane {len(lane.mailboxes)}"
            )
        self.lane, self.router, self.layers = lane, router, list(layers)
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
        counted again. Returns the budgets."""
        for i, rep in enumerate(self.lane.take_reports()):
            if rep.job_rows:
                self.router.observe_lane(i, rep.job_rows, rep.job_ms)
            if rep.sent_rows:
                self.rows_per_miss[i] = sum(rep.sent_rows) / len(rep.sent_rows)
            timing = self.layers[i].take_timing() if self.layers else None
            if timing is not None and rep.n_hit + rep.n_miss:
                gpu_ms, waited_ms = timing
                self.router.observe_gpu(rep.n_hit, rep.n_miss - len(rep.sent_rows), gpu_ms)
                self.router.observe_wait(i, waited_ms)
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
            "status": STATUS,
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
            "lane_rejected": router["lane_rejected"],
            "ct_b": router["ct_b"],
            "forced_share": router["forced_share"],
            "layers": layers,
        }

    def close(self) -> None:
        self.lane.close()


def swiglu_limit(model_dir: str) -> float:
    """The checkpoint's swiglu_limit (0: none), as the CPU engine's lane reads it."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return float(cfg.get("text_config", cfg).get("swiglu_limit", 0.0))


def lane_tables(home, moe) -> list:
    """An ExpertTable per MoE module over the pinned home's trellis (views into its arenas, no
    copy) and host copies of the experts' suh/svh (exllamav3 keeps those in VRAM: a few KB an
    expert). exllamav3 1.6.5's layout: `gates` / `ups` / `downs` LinearEXL3 per expert, each
    with `.inner.trellis/suh/svh`."""
    from glm53 import _gemv

    geo, tables = home.geo, []
    for i, mod in enumerate(moe):
        arena = home.arenas[home.moe_layers[i]]
        first = mod.gates[0].inner
        k_in, k_mid = first.trellis.shape[0] * 16, first.trellis.shape[1] * 16
        table = _gemv.ExpertTable(len(mod.gates), k_in, k_mid, first.trellis.shape[2] // 8)
        for e in range(len(mod.gates)):
            parts = []
            for p, lin in enumerate((mod.gates[e], mod.ups[e], mod.downs[e])):
                off = e * geo.record_bytes + geo.part_off[p]
                shape = tuple(lin.inner.trellis.shape)
                trellis = arena.view[off : off + geo.part_bytes[p]].view(np.int16).reshape(shape)
                parts.append((trellis, lin.inner.suh.cpu().numpy(), lin.inner.svh.cpu().numpy()))
            table.set(e, *parts)
        tables.append(table)
    return tables


def start_fast(
    loaded, model_dir: str, cpu_lane, ct_b: float | None = None, budget_ns: int | None = None
) -> FastLane:
    """Fast mode on an exact-mode load (exl3_load.load(..., "exact")): the lane over its pinned
    home, the hooks on its MoE modules (prefill marked exact), the router. `budget_ns` pins
    every layer's wait for the lane (None: the router's predicted wait, per layer and step).
    GPU only."""
    from glm53.tiers import fast_hooks

    if loaded.home is None or loaded.ec is None:
        raise RuntimeError("fast mode needs an exact-mode load (the pinned home and VRAM cache)")
    lane = MailboxLane(cpu_lane, lane_tables(loaded.home, loaded.moe), swiglu_limit(model_dir))
    try:
        fast_hooks.install_fast_hooks()
        fast_hooks.mark_prefill_exact(loaded.model)
        layers = fast_hooks.attach_fast(loaded.moe, lane.mailboxes, loaded.ec, budget_ns)
    except Exception:
        fast_hooks.detach_fast(loaded.moe)
        fast_hooks.unmark_prefill_exact(loaded.model)
        lane.close()
        raise
    router = LaneRouter(len(loaded.moe), loaded.home.geo.record_bytes, ct_b=ct_b)
    return FastLane(lane, router, layers)


def stop_fast(fast: FastLane, loaded) -> None:
    """Detach the hooks (unpins the mailboxes) and stop the lane, before the load closes."""
    from glm53.tiers import fast_hooks

    fast_hooks.detach_fast(loaded.moe)
    fast_hooks.unmark_prefill_exact(loaded.model)
    fast.close()
