"""The tiered MoE block that replaces transformers' `Glm5NextTextMoE` in the CPU engine.

The router and the shared expert are transformers' own modules (torch, fp32). The routed
experts come from the RAM tier (read from the expert source with O_DIRECT on a miss, evicted by
CLOCK under --ram-cap) and are computed by the CPU lane straight from their EXL3 trellis.
A layer whose picks name more distinct experts than the tier has slots runs in waves: each
wave makes a share of them resident and computes their picks before the next wave evicts them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from glm53 import _gemv
from glm53.tiers.cpu_lane import CpuLane
from glm53.tiers.ram_tier import RamTier


@dataclass(slots=True)
class LayerCounters:
    """Per MoE layer: distinct expert lookups that hit / missed the RAM tier, bytes read from
    the source, lane jobs and the wall time spent waiting for them."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    lane_jobs: int = 0
    lane_ns: int = 0
    tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StreamTally(Protocol):
    """Per-stream counts a TieredMoE adds to (glm53.engine.base.StreamUsage has these fields)."""

    cpu_lane_picks: int
    ram_hits: int
    ram_misses: int
    store_read_bytes: int


class TallyTarget:
    """Which stream's tally the MoE layers add to, shared by all of an engine's layers. The
    engine points `tally` at a stream's counters before it runs that stream's tokens (one
    stream at a time), or at None to count nothing per stream. Owned by the engine thread."""

    __slots__ = ("tally",)

    def __init__(self):
        self.tally: StreamTally | None = None


def pack_jobs(picks: np.ndarray, experts: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
    """Group pick indices into lane jobs: one expert per job, at most MAX_ROWS of its picks (in
    row order), each pick on its own job row. `_gemv.Pool.run_picks` packs a batch this way in
    native code (the tests hold it to this function).

    The lane splits an expert's work by the number of experts in its job, which changes the
    summation order; with one expert per job and a fixed chunking, a pick's result depends only
    on (expert, its rows), not on which other experts share a wave."""
    order = picks[np.lexsort((rows[picks], experts[picks]))]
    if len(order) == 0:
        return []
    bounds = np.flatnonzero(np.diff(experts[order])) + 1
    jobs = []
    for group in np.split(order, bounds):
        jobs.extend(group[i : i + _gemv.MAX_ROWS] for i in range(0, len(group), _gemv.MAX_ROWS))
    return jobs


class TieredMoE(nn.Module):
    """Router + shared expert in torch, routed experts through the RAM tier and the CPU lane."""

    def __init__(
        self,
        layer: int,
        hf_block: nn.Module,
        tier: RamTier,
        lane: CpuLane,
        act_limit: float,
        target: TallyTarget | None = None,
    ):
        super().__init__()
        self.target = TallyTarget() if target is None else target
        self.layer = layer
        self.gate = hf_block.gate
        self.shared_experts = hf_block.shared_experts
        self.tier = tier
        self.lane = lane
        self.act_limit = act_limit
        self.counters = LayerCounters()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).float().contiguous()
        _, weights, picks = self.gate(x)
        routed = self.routed(x, picks, weights.float())
        return routed.view(shape).to(hidden_states.dtype) + self.shared_experts(hidden_states)

    def routed(self, x: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each row's picks of weight * expert(x[row]), [rows, hidden] fp32.

        Every pick gets its own output row (the lane batches them into one-expert jobs, see
        pack_jobs) and the rows are summed in pick order at the end, so the result does not
        depend on waves or slots: any --ram-cap gives the same bits."""
        c, tally = self.counters, self.target.tally
        num_rows, top_k = picks.shape
        c.tokens += num_rows
        x_np = x.numpy()
        experts = picks.numpy().reshape(-1).astype(np.int32)
        weight_np = weights.numpy().reshape(-1).astype(np.float32, copy=False)
        rows = np.repeat(np.arange(num_rows, dtype=np.int64), top_k)
        contrib = np.empty((num_rows * top_k, x.shape[1]), dtype=np.float32)
        _, first = np.unique(experts, return_index=True)
        pending = experts[np.sort(first)]
        slot_of = np.empty(self.tier.num_experts, dtype=np.int32)
        while len(pending):
            wave = self.tier.make_resident(self.layer, pending)
            c.hits += wave.num_hits
            c.misses += wave.num_admitted
            c.bytes_read += wave.bytes_read
            slot_of.fill(-1)
            slot_of[wave.experts] = wave.slots
            slots = slot_of[experts]
            in_wave = np.flatnonzero(slots >= 0)
            start = time.perf_counter_ns()
            c.lane_jobs += self.lane.run_picks(
                self.tier.table,
                x_np,
                rows[in_wave],
                slots[in_wave],
                weight_np[in_wave],
                in_wave,
                contrib,
                act_limit=self.act_limit,
            )
            c.lane_ns += time.perf_counter_ns() - start
            if tally is not None:
                tally.ram_hits += wave.num_hits
                tally.ram_misses += wave.num_admitted
                tally.store_read_bytes += wave.bytes_read
                tally.cpu_lane_picks += len(in_wave)
            pending = pending[slot_of[pending] < 0]
        return torch.from_numpy(contrib).view(num_rows, top_k, -1).sum(dim=1)
