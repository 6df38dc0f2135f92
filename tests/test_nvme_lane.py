"""nvme mode's lane over the RAM tier (glm53.tiers.nvme_lane, glm53.exl3.nvme_device's route
with a lane), on the CPU.

Real: the RAM tier, the store, O_DIRECT reads, the lane (its native poller and MoE job on a
CpuLane pool). Mocks, named: test_lane_mailbox's `MockDevice` (the publish and wait of
cuda/lane.cu, played by a host thread through the mailbox protocol), test_nvme_device_glue's
`MockExpertCache` / `MockCudaLib` (the device cache's tensors on the CPU, the launches recorded)
and `MockLaneLayer` here (a FastLayer's saved selection, after the device's publish). The publish
kernel's choice (key_lane) runs on a GPU only: tests/gpu/test_lane_mailbox_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lane_mailbox import SETTLE_S, MockDevice, fp16_rows
from test_nvme_device_glue import EXPERTS, POISON, RECORD, mock_nvme_home

from glm53 import _gemv
from glm53.models.checkpoint import Checkpoint
from glm53.store.reader import ExpertStore
from glm53.tiers.cpu_lane import CpuLane, LaneLayout
from glm53.tiers.expert_source import record_views
from glm53.tiers.lane_mailbox import MailboxLane
from glm53.tiers.nvme_lane import lane_slots, ram_lane_tables
from glm53.tiers.ram_tier import RamTier

LAYERS, TOP_K = 6, 2


def test_lane_slots_map_home_addresses_to_ram_slots_and_absent_to_minus_one():
    base, rb = 1 << 20, 4096
    got = lane_slots([base, POISON, base + 3 * rb, POISON], POISON, base, rb)
    assert got.dtype == np.int32 and got.tolist() == [0, -1, 3, -1]
    with pytest.raises(ValueError, match="not a RAM-tier record start"):
        lane_slots([base + 100], POISON, base, rb)
    assert lane_slots([], POISON, base, rb).tolist() == []


def test_the_lane_over_the_ram_tier_computes_the_store_records_bit_for_bit(demo, good_store):
    """A pick carries its RAM slot; the lane reads that slot's record through the tier's own
    table and its partial equals the same job over fresh copies of the store's records."""
    tier = RamTier(ExpertStore(good_store, Checkpoint(demo)), 24 * RECORD)
    layer = tier.source.moe_layers[1]
    tables = ram_lane_tables(tier, 2)  # the tier is empty: every entry at its own record
    assert tables == [tier.table, tier.table]
    experts = np.array([3, 17, 30, 8], dtype=np.int32)
    wave = tier.make_resident(layer, experts)
    slots = {int(e): int(s) for e, s in zip(wave.experts, wave.slots, strict=True)}
    data = (good_store / "experts.bin").read_bytes()
    fresh = _gemv.ExpertTable(len(experts), tier.table.hidden, tier.table.inter, tier.table.k2)
    keep = []
    for i, e in enumerate(experts.tolist()):
        r = 1 * EXPERTS + e
        rec = np.frombuffer(data[r * RECORD : (r + 1) * RECORD], dtype=np.uint8).copy()
        keep.append(rec)
        fresh.set(i, *record_views(rec, tier.source.layouts[(layer, e)]))
    cpu = CpuLane(LaneLayout((0,)), precision="exact")
    rng = np.random.default_rng(3)
    with MailboxLane(cpu, tables) as lane:
        device = MockDevice(lane.mailboxes[1], layer=1)
        x = fp16_rows(rng, 2)
        rows = np.array([0, 0, 1, 1], dtype=np.int32)
        weights = np.array([0.25, 0.5, 0.125, 0.375], dtype=np.float32)
        device.publish(x, rows, [slots[e] for e in experts.tolist()], weights)
        assert device.wait(SETTLE_S)
        got = device.partial(2)
    want = cpu.run(fresh, x, rows, np.arange(4, dtype=np.int32), weights)
    assert np.array_equal(got, want)
    tier.close()


class MockLaneLayer:
    """A mock of glm53.exl3.fast_hooks.FastLayer after its publish (the real one needs a GPU):
    `orig_sel` / `orig_w` hold the selection as routed, the live one has the lane's picks
    masked; `skip_timing` is recorded."""

    def __init__(self, routed, lane_experts):
        self.orig_sel = torch.full((64,), -7, dtype=torch.int64)
        self.orig_w = torch.zeros(64, dtype=torch.half)
        flat = torch.tensor(routed, dtype=torch.int64).reshape(-1)
        self.orig_sel[: flat.numel()] = flat
        self.orig_w[: flat.numel()] = 0.5
        taken = torch.isin(flat, torch.tensor(lane_experts, dtype=torch.int64))
        self.selected = torch.where(taken, -1, flat).reshape(len(routed), -1)
        self.weights = torch.where(taken, 0.0, 0.5).half().reshape(len(routed), -1)
        self.skipped = 0

    def skip_timing(self):
        self.skipped += 1


@pytest.fixture
def glue(demo, good_store, monkeypatch):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 8)
    yield home, ec, lib
    home.close()


def test_the_route_keeps_the_lanes_records_resident_points_them_and_admits_only_the_gpus(glue):
    """A full RAM tier (8 slots): the lane took experts 1 and 2 (RAM-resident at publish), the
    GPU's picks include misses the tier must read. The lane's records are hits of the wave,
    so no read evicts them and their bytes do not change while the lane may read them; the
    device points every pick as routed (a fallback reads the lane's from their RAM homes) and
    admits into VRAM only the GPU's picks; key_lane follows every home write."""
    home, ec, lib = glue
    tier, moe = home.tier, 4
    first = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=torch.int64)
    home.route(moe, first, True, {}, torch.full((4, 2), 0.5, dtype=torch.half))
    assert tier.clock.n_used == tier.num_slots == 8  # full
    key = {e: moe * EXPERTS + e for e in range(EXPERTS)}
    lane_slot = {e: tier.clock.slot_of(key[e]) for e in (1, 2)}
    before = {e: tier.record(s).copy() for e, s in lane_slot.items()}
    kl = home.key_lane.numpy()
    assert [kl[key[e]] for e in (1, 2)] == [lane_slot[1], lane_slot[2]]
    layer = MockLaneLayer([[1, 20], [2, 21], [22, 1]], lane_experts=[1, 2])
    lib.calls.clear()
    home.route(moe, layer.selected, True, {}, layer.weights, lane=layer)
    for e, s in lane_slot.items():  # still theirs, byte for byte
        assert tier.clock.slot_of(key[e]) == s and np.array_equal(tier.record(s), before[e])
    for e in (20, 21, 22):  # read, evicting only experts the step did not pick
        assert tier.clock.contains(key[e])
    evicted = [e for e in (3, 4, 5, 6, 7, 8) if not tier.clock.contains(key[e])]
    assert len(evicted) == 3 and all(kl[key[e]] == -1 for e in evicted)
    assert all(kl[key[e]] == tier.clock.slot_of(key[e]) for e in (1, 2, 20, 21, 22))
    assert np.array_equal(ec._t["home"].numpy(), home.home.home_of)
    routed = [1, 20, 2, 21, 22, 1]
    assert [c for c in lib.calls if c[0] != "register"] == [
        ("check_homes", moe, routed),
        ("route", moe, [-1, 20, -1, 21, 22, -1]),  # the lane's picks are not admitted
        ("point_picks", moe, routed),
    ]
    assert layer.skipped == 1  # the route read the store: not a GPU timing sample
    again = MockLaneLayer([[1, 20]], lane_experts=[1])
    home.route(moe, again.selected, True, {}, again.weights, lane=again)
    assert again.skipped == 0  # all hits: timed as usual
    assert home.home.counters["ram_hits"] >= 2


def test_a_fault_in_an_nvme_decode_step_is_masked_in_the_lanes_saved_selection_too(glue):
    """A stalled lane's fallback runs the saved selection: a faulted expert must be masked
    there as well, or the fallback would read its absent home (table_bad)."""
    from store_kit import FailingReader

    home, ec, lib = glue
    moe = 5
    home.route(moe, torch.tensor([[1, 2]]), True, {}, torch.full((1, 2), 0.5, dtype=torch.half))
    reader = home.tier.source.reader
    home.tier.source.reader = FailingReader(reader, [(moe * EXPERTS + 9) * RECORD + 4096])
    home.row_keys = lambda: ["a", "b"]
    layer = MockLaneLayer([[1, 9], [2, 3]], lane_experts=[1])
    home.route(moe, layer.selected, True, {}, layer.weights, lane=layer)
    assert layer.orig_sel[:4].tolist() == [1, -1, 2, 3]
    assert layer.orig_w[:4].tolist() == [0.5, 0.0, 0.5, 0.5]
    assert layer.selected.tolist() == [[-1, -1], [2, 3]]
    assert [(f.expert, f.keys) for f in home.take_faults()] == [(9, ("a",))]
