"""Fast mode's start and stop on an exact-mode load: the CPU lane's expert tables over the pinned
home's arenas (read from exllamav3 1.6.5's MoE modules), fast_hooks on every MoE module, and the
router (glm53.tiers.fast_lane.FastLane, the host side, which needs no exllamav3). On an
nvme-exact load the same start is nvme mode (the lane over the RAM tier: glm53.tiers.nvme_lane).
Only the GPU engine's `--mode fast` / `--mode nvme` call it. fast mode ran on an H200
(2026-12-02: its device tests 21 of 22, the one failure a fidelity bound; 2026-12-05:
bench/gpu_slice.py's fast row and its GPU tests 5 of 5 inside exllamav3's own floor) and nvme
mode (2026-12-05: 6 of 6) are served without --allow-unrun-modes.
"""

from __future__ import annotations

import json
import os

import numpy as np

from glm53.exl3 import fast_hooks
from glm53.tiers.fast_lane import NVME_STATUS, STATUS, FastLane
from glm53.tiers.lane_mailbox import MailboxLane
from glm53.tiers.lane_router import LaneRouter


def trace_ranges(on: bool) -> None:
    """Run the fast hooks' host work in named profiler ranges (fast_hooks.TRACE_RANGES: the
    profiler's view of where the lane's path costs host time; a few us a range, so off when
    serving)."""
    fast_hooks.TRACE_RANGES = bool(on)


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
    """Fast mode on an exact-mode load (glm53.exl3.load(..., "exact")): the lane over its pinned
    home, the hooks on its MoE modules (prefill marked exact), the router. On an nvme-exact load
    (its `nvme`), nvme mode: the same lane, hooks and router over the RAM tier (the lane's table
    is the tier's, the publish reads its key -> slot table: glm53.tiers.nvme_lane). `budget_ns`
    pins every layer's wait for the lane (None: the router's predicted wait, per layer and
    step). GPU only."""
    if loaded.home is None or loaded.ec is None:
        raise RuntimeError(
            "internal error: fast mode needs an exact-mode load (the pinned home and VRAM cache)"
        )
    key_lane = None
    if loaded.nvme is not None:
        from glm53.tiers.nvme_lane import ram_lane_tables

        tables = ram_lane_tables(loaded.nvme.tier, len(loaded.moe))
        key_lane = loaded.nvme.key_lane
    else:
        tables = lane_tables(loaded.home, loaded.moe)
    lane = MailboxLane(cpu_lane, tables, swiglu_limit(model_dir))
    try:
        fast_hooks.install_fast_hooks()
        fast_hooks.mark_prefill_exact(loaded.model)
        layers = fast_hooks.attach_fast(loaded.moe, lane.mailboxes, loaded.ec, budget_ns, key_lane)
    except Exception:
        fast_hooks.detach_fast(loaded.moe)
        fast_hooks.unmark_prefill_exact(loaded.model)
        lane.close()
        raise
    router = LaneRouter(len(loaded.moe), loaded.home.geo.record_bytes, ct_b=ct_b)
    return FastLane(lane, router, layers, NVME_STATUS if loaded.nvme is not None else STATUS)


def stop_fast(fast: FastLane, loaded) -> None:
    """Detach the hooks (unpins the mailboxes) and stop the lane, before the load closes. The
    prefill mark stays on an nvme-exact load (its read-fault isolation uses it)."""
    fast_hooks.detach_fast(loaded.moe)
    if loaded.nvme is None:
        fast_hooks.unmark_prefill_exact(loaded.model)
    fast.close()
