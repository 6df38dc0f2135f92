"""Decode prefetch in the nvme modes on the CPU (glm53.tiers.decode_prefetch, driven by
glm53.exl3.nvme_device.NvmeHome.route's `predicted`): the real RAM tier over a real packed store
with real O_DIRECT reads; the GPU is played by test_nvme_device_glue's named mocks
(MockExpertCache, MockCudaLib). The predicted picks are given as the device hook would hand
them over (glm53.exl3.hooks runs layer L+1's router on L's MoE input only on a GPU,
tests/gpu/test_nvme_exact_gpu.py)."""

import errno

import numpy as np
import pytest
import torch
from store_kit import FailingReader
from test_nvme_device_glue import EXPERTS, LAYERS, POISON, RECORD, mock_nvme_home

from glm53.tiers.decode_prefetch import DecodePrefetch
from glm53.tiers.ram_tier import ReadFault


class KeyReader:
    """The store's real O_DIRECT reader, with the records each submit covers and each wait
    recorded (no fault, no timing): shows which keys are read, how often, and when."""

    def __init__(self, reader):
        self.reader, self.log, self.reads = reader, [], []

    def submit(self, offset, length, buf, tag, *args, **kwargs):
        keys = list(range(offset // RECORD, -(-(offset + length) // RECORD)))
        self.log.append(("submit", keys))
        self.reads += keys
        self.reader.submit(offset, length, buf, tag, *args, **kwargs)

    def wait(self, tags=None, timeout=None):
        tags = list(tags)
        self.log.append(("wait", len(tags)))
        return self.reader.wait(tags, timeout)

    def __getattr__(self, name):
        return getattr(self.reader, name)


def _home(demo, store, monkeypatch, slots, reader=KeyReader):
    home, ec, lib = mock_nvme_home(demo, store, monkeypatch, slots, reader)
    home.prefetch = DecodePrefetch(home.home)
    return home, ec, lib


@pytest.fixture
def pf(demo, good_store, monkeypatch):
    home, ec, lib = _home(demo, good_store, monkeypatch, 40)
    yield home, ec, lib
    home.close()


def sel(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def check_table(home, ec):
    """The device home table as the RAM tier holds it, except the records of a wave still out
    (absent until their wave is collected)."""
    table, want = ec._t["home"].numpy(), home.home.expected()
    wave = home.prefetch.wave
    if wave is not None and not home.prefetch.ready:
        out = home.prefetch.layer * EXPERTS + wave.experts[wave.num_hits :].astype(np.int64)
        assert (table[out] == POISON).all()
        want[out] = POISON
    assert np.array_equal(table, want)


def test_a_wave_makes_the_next_layers_predicted_picks_hits_read_once(pf):
    home, ec, lib = pf
    reader, tier = home.tier.source.reader, home.tier
    ec._t["key_slot"][2 * EXPERTS + 7] = 3  # VRAM holds layer 2's expert 7
    home.route(2, sel([7, 1]), True, {}, predicted=sel([4, 5]))
    # layer 3's predicted 4 and 5 are queued, not waited for; layer 2's RAM pick (1) is pinned
    assert reader.log[-1] == ("submit", [3 * EXPERTS + 4, 3 * EXPERTS + 5])
    wave = home.prefetch.wave
    assert sorted(wave.experts.tolist()) == [4, 5] and home.prefetch.layer == 3
    assert tier.clock.pin_count(tier.clock.slot_of(2 * EXPERTS + 1)) == 1
    assert tier.clock.n_pinned == 3  # the pick and the wave's two slots
    check_table(home, ec)  # the wave's keys stay absent while their reads are out
    reads = home.stats()["ram_reads"]
    home.route(3, sel([4, 9]), True, {})  # 4 was predicted, 9 was not
    assert reader.reads.count(3 * EXPERTS + 4) == 1  # read once, by the wave
    assert reader.reads.count(3 * EXPERTS + 9) == 1
    stats = home.stats()
    assert stats["ram_reads"] == reads + 3  # the wave's two, then 9 at its turn
    assert (stats["prefetch_keys"], stats["prefetch_hits"], stats["prefetch_wasted"]) == (2, 1, 1)
    assert stats["prefetch_waves"] == 1 and stats["prefetch_faults"] == 0
    assert tier.clock.n_pinned == 0 and home.prefetch.idle()
    check_table(home, ec)
    assert lib.calls[-1] == ("point_picks", 3, [4, 9])


def test_a_hit_counts_one_access_and_the_resolve_does_not_look_it_up_again(pf):
    home, ec, lib = pf
    home.route(0, sel([1, 2]), True, {}, predicted=sel([6, 8]))
    hits = home.stats()["ram_hits"]
    home.route(1, sel([6, 8]), True, {})
    assert home.stats()["ram_hits"] == hits + 2  # both from the wave, counted as RAM hits
    assert home.tier.clock.freq_of(EXPERTS + 6) == home.tier.clock.freq_of(EXPERTS + 8)
    assert home.stats()["prefetch_hits"] == 2


def test_mispredictions_are_counted_as_wasted_and_vram_or_ram_holdings_are_not_read(pf):
    home, ec, lib = pf
    reader = home.tier.source.reader
    ec._t["key_slot"][3 * EXPERTS + 10] = 1  # VRAM holds layer 3's expert 10
    home.route(3, sel([12]), True, {})  # the RAM tier holds layer 3's expert 12
    before = list(reader.reads)
    home.route(2, sel([1, 2], [3, 4]), True, {}, predicted=sel([10, 11], [12, 13]))
    assert sorted(reader.reads[len(before) :])[-2:] == [3 * EXPERTS + 11, 3 * EXPERTS + 13]
    assert 3 * EXPERTS + 10 not in reader.reads and reader.reads.count(3 * EXPERTS + 12) == 1
    home.route(3, sel([20, 21]), True, {})
    stats = home.stats()
    assert (stats["prefetch_keys"], stats["prefetch_hits"], stats["prefetch_wasted"]) == (2, 0, 2)
    assert home.tier.clock.contains(3 * EXPERTS + 11)  # read: resident, only not picked
    check_table(home, ec)


def test_a_wave_is_cut_to_the_room_and_never_evicts_the_layers_pinned_picks(
    demo, good_store, monkeypatch
):
    home, ec, lib = _home(demo, good_store, monkeypatch, 20)
    try:
        tier = home.tier
        home.route(0, sel(*[[2 * r, 2 * r + 1] for r in range(8)]), False, {})  # fill 16 slots
        picks = sel([20, 21], [22, 23], [24, 25], [26, 27])  # 8 RAM picks, 4 rows of top-2
        home.route(1, picks, True, {}, predicted=sel(*[[2 * r, 2 * r + 1] for r in range(4)]))
        # 20 slots - 8 pinned picks - a decode working set of 8 leaves room for 4
        assert len(home.prefetch.wave.experts) == 4 and home.stats()["prefetch_cut"] == 1
        assert all(tier.clock.contains(EXPERTS + e) for e in range(20, 28))
        for e in range(20, 28):
            assert tier.clock.pin_count(tier.clock.slot_of(EXPERTS + e)) == 1
        home.route(2, sel([0, 1], [2, 3], [4, 5], [6, 7]), True, {})
        assert tier.clock.n_pinned == 0 and home.stats()["prefetch_hits"] == 4
        check_table(home, ec)
    finally:
        home.close()


def test_a_failed_prefetch_read_fails_nobody_and_the_demand_read_reports_it(
    demo, good_store, monkeypatch
):
    home, ec, lib = _home(demo, good_store, monkeypatch, 40)
    try:
        real = home.tier.source.reader
        home.tier.source.reader = FailingReader(real, [(3 * EXPERTS + 4) * RECORD], errno.EIO)
        home.route(2, sel([1, 2]), True, {}, predicted=sel([4, 30]))
        # layer 3 picks only 30: the failed read of 4 was a hint, nothing fails
        home.route(3, sel([30, 9]), True, {})
        stats = home.stats()
        assert stats["prefetch_faults"] == 1 and stats["read_errors"] == 1
        assert not home.tier.clock.contains(3 * EXPERTS + 4)
        assert home.tier.clock.n_pinned == 0
        check_table(home, ec)
        # the same fault again, and this time layer 3 picks 4: its demand read reports it
        home.route(2, sel([1, 2]), True, {}, predicted=sel([4, 31]))
        with pytest.raises(ReadFault, match="expert 4") as info:
            home.route(3, sel([9, 8], [4, 8]), True, {})
        layer = home.tier.source.moe_layers[3]
        assert (info.value.layer, info.value.expert, info.value.rows) == (layer, 4, (1,))
        assert home.stats()["prefetch_faults"] == 2
        home.end_forward()
        assert home.tier.clock.n_pinned == 0 and home.prefetch.idle()
        check_table(home, ec)
    finally:
        home.close()


def test_a_failed_prefetch_read_in_a_batched_step_fails_only_the_rows_that_pick_it(
    demo, good_store, monkeypatch
):
    home, ec, lib = _home(demo, good_store, monkeypatch, 40)
    try:
        real = home.tier.source.reader
        home.tier.source.reader = FailingReader(real, [(3 * EXPERTS + 4) * RECORD], errno.EIO)
        home.row_keys = lambda: ["job-a", "job-b"]
        w = torch.ones((2, 2), dtype=torch.float16)
        home.route(2, sel([1, 2], [3, 5]), True, {}, w, predicted=sel([4, 30], [6, 7]))
        chosen = sel([9, 8], [4, 30])
        home.route(3, chosen, True, {}, torch.ones((2, 2), dtype=torch.float16))
        [fault] = home.take_faults()
        assert (fault.expert, fault.rows, fault.keys) == (4, (1,), ("job-b",))
        assert chosen.tolist() == [[9, 8], [-1, 30]]  # masked for the step; 30 was read
        # a failed wave is taken back whole (RamTier's fault handling): 30 read at its turn
        assert home.stats()["prefetch_hits"] == 0 and home.stats()["prefetch_faults"] == 1
        assert home.tier.clock.contains(3 * EXPERTS + 30) and home.tier.clock.n_pinned == 0
        check_table(home, ec)
    finally:
        home.close()


def test_a_forward_that_ends_after_a_hook_leaves_no_pins_and_no_reads_out(pf):
    home, ec, lib = pf
    reader, tier = home.tier.source.reader, home.tier
    home.route(2, sel([1, 2], [3, 4]), True, {}, predicted=sel([5, 6]))
    assert tier.clock.n_pinned > 0 and reader.log[-1][0] == "submit"
    home.end_forward()  # the iteration ended (or failed) after layer 2's hook
    assert reader.log[-1][0] == "wait" and tier.clock.n_pinned == 0 and home.prefetch.idle()
    assert home.stats()["prefetch_wasted"] == 2
    check_table(home, ec)  # the wave's records were read: their homes are written
    assert tier.clock.contains(3 * EXPERTS + 5) and tier.clock.contains(3 * EXPERTS + 6)


@pytest.mark.parametrize("then", ["new forward", "prefill", "last layer"])
def test_a_wave_left_over_is_drained_by_the_next_hook_that_is_not_its_layer(pf, then):
    home, ec, lib = pf
    tier = home.tier
    home.route(2, sel([1, 2]), True, {}, predicted=sel([5, 6]))
    if then == "new forward":
        home.route(0, sel([1, 2]), True, {})
    elif then == "prefill":
        home.route(0, sel(*[[e, e + 1] for e in range(0, 20, 2)]), False, {})
    else:  # the last MoE layer predicts nothing and finishes what was predicted for it
        home.route(LAYERS - 2, sel([1, 2]), True, {}, predicted=sel([5, 6]))
        assert home.prefetch.layer == LAYERS - 1
        home.route(LAYERS - 1, sel([5, 9]), True, {}, predicted=sel([1, 2]))
        assert home.stats()["prefetch_hits"] == 1
    assert tier.clock.n_pinned == 0 and home.prefetch.idle()
    check_table(home, ec)


def test_prefetch_off_reports_zeros_and_reads_nothing_ahead(demo, good_store, monkeypatch):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 40, KeyReader)
    try:
        home.route(2, sel([1, 2]), True, {}, predicted=sel([5, 6]))
        assert 3 * EXPERTS + 5 not in home.tier.source.reader.reads
        assert {
            k: v for k, v in home.stats().items() if k.startswith("prefetch_")
        } == dict.fromkeys(DecodePrefetch.COUNTERS, 0)
    finally:
        home.close()


def test_predict_next_runs_the_next_routers_own_function_on_a_params_copy_and_copies_out():
    """glm53.exl3.hooks.predict_next with a named mock of the next BlockSparseMLP (its routing
    function and config, as the routing property keeps them): the prediction runs on a copy of
    the params, and its picks are copied out of the router's workspace (exllamav3's multi-row
    routers share one per device, which this layer's own routing writes next)."""
    import types

    from glm53.exl3.hooks import DECODE_MAX_ROWS, NO_LANE, predict_next

    workspace = torch.zeros((2, 2), dtype=torch.int64)  # the routers' shared output (mock)
    seen = []

    def mock_router(bsz, cfg, z, params):
        seen.append((bsz, cfg, z, dict(params)))
        params["written"] = True  # a router writing into what it was given
        workspace.copy_(torch.tensor([[3, 4], [5, 6]]))
        return workspace, torch.ones((2, 2))

    mock_next_module = types.SimpleNamespace(routing_cfg="cfg of the next layer")
    mock_next_module.__dict__["_g53_routing_fn"] = mock_router
    z, params = torch.ones((2, 8)), {"some": 1}
    got = predict_next(mock_next_module, 2, z, params)
    assert seen == [(2, "cfg of the next layer", z, {"some": 1})]
    assert params == {"some": 1}  # the live params are untouched
    assert got.tolist() == [[3, 4], [5, 6]]
    workspace.fill_(-7)  # this layer's own routing rewrites the workspace next
    assert got.tolist() == [[3, 4], [5, 6]]
    for bsz, p in ((DECODE_MAX_ROWS + 1, {}), (1, {NO_LANE: True}),
                   (1, {"activate_all_experts": True})):  # fmt: skip
        assert predict_next(mock_next_module, bsz, z, p) is None
    assert predict_next(None, 1, z, {}) is None and len(seen) == 1


def test_a_prefetch_read_past_the_timeout_fails_nobody_and_the_demand_read_reports_it(
    demo, good_store, monkeypatch
):
    """A hung disk under a wave (store_kit.StallingReader, a stand-in: a real one cannot be
    made here): the wave's wait gives up at the read timeout, nothing fails, the stuck record
    stays absent with its slot pinned (RamTier's handling), and a later pick of it reports the
    fault with its rows; once the read lands, the next read of it succeeds."""
    from store_kit import StallingReader

    home, ec, lib = _home(demo, good_store, monkeypatch, 40)
    try:
        home.tier.read_timeout_s = 0.05
        real = home.tier.source.reader
        stall = StallingReader(real, [(3 * EXPERTS + 4) * RECORD + 4096])
        home.tier.source.reader = stall
        home.route(2, sel([1, 2]), True, {}, predicted=sel([4, 30]))
        home.route(3, sel([9, 8]), True, {})  # 4 not picked: nothing fails
        stats = home.stats()
        assert stats["prefetch_faults"] == 1 and stats["read_timeouts"] == 1
        assert 3 * EXPERTS + 4 in home.tier.stuck_keys()
        check_table(home, ec)
        with pytest.raises(ReadFault, match="has not finished") as info:
            home.route(3, sel([9, 8], [4, 8]), True, {})
        assert info.value.rows == (1,)
        home.end_forward()
        stall.release()
        home.tier.source.reader = real
        for _ in range(10_000):  # the late read lands (each look waits up to 1 ms for it)
            if all(stuck.finished() for stuck, _, _ in home.tier._stuck):
                break
        home.route(3, sel([4, 8]), True, {})  # reaped, then read afresh
        assert home.tier.clock.contains(3 * EXPERTS + 4) and home.tier.clock.n_pinned == 0
        check_table(home, ec)
    finally:
        home.close()
