"""The eviction contract of nvme-exact's routing hook (glm53.exl3.nvme_device.NvmeHome.route), with
prefill staging (glm53.tiers.prefill_ahead), decode prefetch (glm53.tiers.decode_prefetch) and
nvme mode's lane (glm53.tiers.nvme_lane) all on, driven as exllamav3's Generator drives them:
per iteration maybe a prefill forward of one job (marked NO_LANE, any size, staged from the
stager's min_rows), then a decode forward of 1-4 rows whose hooks hand over the next layer's
predicted picks (right or wrong), then `end_forward`. Seeded random picks over a full tier.

Real: the RAM tier, the store, O_DIRECT reads (waves on the reader's threads). Mocks, named:
test_nvme_device_glue's MockExpertCache / MockCudaLib (the device), test_prefill_ahead's
MockStager, test_nvme_lane's MockLaneLayer (a FastLayer after its publish). After every hook:
- every pick it pointed at a RAM home (what the MoE kernel reads zero-copy until the next hook's
  sync) has a home, in a slot holding that key, not being read into, holding the store's
  record, and pinned while any wave could still admit (check_pointed);
- in nvme mode, before each decode hook (the publish), every key key_lane gives a slot is
  that slot's key with the store's bytes and the same home in the home table, and the records
  the lane took stay that key's, byte for byte, through the hook (pinned while a wave is out).
At the end every pin is dropped and the home table is the tier's.
"""

import numpy as np
import pytest
import torch
from test_decode_prefetch import KeyReader
from test_nvme_device_glue import EXPERTS, LAYERS, POISON, RECORD, mock_nvme_home
from test_nvme_lane import MockLaneLayer
from test_prefill_ahead import MockStager, store_record

from glm53.exl3.hooks import NO_LANE
from glm53.tiers.decode_prefetch import DecodePrefetch
from glm53.tiers.prefill_ahead import AheadReads


class Records:
    """The store's record of each (MoE layer, expert), read once."""

    def __init__(self, store):
        self.store, self.got = store, {}

    def __call__(self, layer, expert):
        if (layer, expert) not in self.got:
            self.got[layer, expert] = store_record(self.store, layer, expert)
        return self.got[layer, expert]


def reading_into(home) -> set:
    """Slots a wave's reads may still be writing (its misses, until it is collected)."""
    out = set()
    pf = home.prefetch
    if pf.wave is not None and pf.wave.batch is not None:
        out |= set(pf.wave.slots[pf.wave.num_hits :].tolist())
    for wave in home.ahead.out.values():
        out |= set(wave.slots[wave.num_hits :].tolist())
    return out


def may_admit(home) -> bool:
    """Whether the tier may still admit before the next hook's sync (a wave is out or pending)."""
    return bool(reading_into(home)) or home.prefetch.wave is not None or bool(home.ahead.out)


def check_resident(home, records, layer, expert, slot, what):
    key = layer * EXPERTS + expert
    tier = home.tier
    assert tier.clock.key_of(slot) == key, f"{what}: layer {layer} expert {expert}'s slot reused"
    assert slot not in reading_into(home), f"{what}: layer {layer} expert {expert} read into"
    if may_admit(home):
        assert tier.clock.pin_count(slot) > 0, f"{what}: layer {layer} expert {expert} unpinned"
    assert np.array_equal(tier.record(slot)[:RECORD], records(layer, expert)), what


def check_pointed(home, ec, lib, records, layer, since):
    """The picks the hook pointed (its point_picks call among lib.calls[since:]; none when it had
    none to point) are resident where the device table says."""
    calls = [c[2] for c in lib.calls[since:] if c[0] == "point_picks" and c[1] == layer]
    assert len(calls) <= 1, calls
    pointed = calls[0] if calls else []
    table = ec._t["home"].numpy()
    for e in {e for e in pointed if 0 <= e < EXPERTS}:
        key = layer * EXPERTS + e
        if int(ec._t["key_slot"][key]) >= 0:
            continue  # a VRAM slot
        assert table[key] != POISON, f"layer {layer} expert {e} pointed with no home (table_bad)"
        slot = (int(table[key]) - home.home.arena_address) // RECORD
        check_resident(home, records, layer, e, slot, "pointed")


def check_key_lane(home, ec, records):
    kl, table = home.key_lane.numpy(), ec._t["home"].numpy()
    assert ((table != POISON) == (kl >= 0)).all()
    for key in np.flatnonzero(kl >= 0).tolist():
        slot = int(kl[key])
        assert table[key] == home.home.address(slot) and key not in home.tier.stuck_keys()
        layer, e = divmod(key, EXPERTS)
        assert home.tier.clock.key_of(slot) == key, f"key_lane: key {key} is not in slot {slot}"
        assert slot not in reading_into(home)
        assert np.array_equal(home.tier.record(slot)[:RECORD], records(layer, e))


def lane_layer(home, ec, rng, layer, picks):
    """The publish: the lane takes some of the picks the VRAM cache misses and key_lane holds;
    returns the mock FastLayer and the slot of each expert it took."""
    base, kl = layer * EXPERTS, home.key_lane.numpy()
    eligible = sorted(
        {
            e
            for e in picks.reshape(-1).tolist()
            if kl[base + e] >= 0 and ec._t["key_slot"][base + e] < 0
        }
    )
    take = [e for e in eligible if rng.random() < 0.7]
    return MockLaneLayer(picks.tolist(), take), {e: int(kl[base + e]) for e in take}


CASES = [  # (RAM slots, staging buffer, most rows of a prefill chunk, nvme mode's lane, seed)
    (33, 4, 64, False, 0),  # a tier just above one working set (32)
    (40, 32, 64, True, 1),
    (64, 16, 17, False, 2),
    (64, 4, 64, True, 0),
    (100, 16, 64, True, 1),
    (100, 32, 17, False, 2),
]


@pytest.mark.parametrize(("slots", "buf", "max_rows", "lane", "seed"), CASES)
def test_no_record_a_hook_pointed_or_the_lane_took_moves_before_the_next_hook(
    demo, good_store, monkeypatch, slots, buf, max_rows, lane, seed
):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, slots, KeyReader)
    stager = MockStager(home, ec, lib.calls, buf_slots=buf, min_rows=9)
    home.stager, home.ahead = stager, AheadReads(home.home, buf, working_set=EXPERTS)
    home.prefetch = DecodePrefetch(home.home)
    rng, records = np.random.default_rng(seed), Records(home.tier.source)
    try:
        hot = np.arange(slots // LAYERS) * 2 % EXPERTS
        for _ in range(3):  # a full tier of frequent keys
            for layer in range(LAYERS):
                moe = home.tier.source.moe_layers[layer]
                home._write(home.home.resolve(moe, hot, np.zeros(len(hot), bool)))
        for key in rng.choice(LAYERS * EXPERTS, 6, replace=False).tolist():
            ec._t["key_slot"][key] = int(rng.integers(0, 8))  # a few picks in VRAM slots
        for _ in range(12):
            if rng.random() < 0.5:  # a prefill forward of one job
                rows = int(rng.integers(1, max_rows))
                for layer in range(LAYERS):
                    sel = torch.from_numpy(rng.integers(0, EXPERTS, (rows, 2)))
                    since = len(lib.calls)
                    home.route(layer, sel, rows <= 8, {NO_LANE: True}, torch.ones(rows, 2))
                    check_pointed(home, ec, lib, records, layer, since)
            rows = int(rng.integers(1, 5))  # the decode forward
            picks = [torch.from_numpy(rng.integers(0, EXPERTS, (rows, 2))) for _ in range(LAYERS)]
            for layer in range(LAYERS):
                pred = None
                if layer + 1 < LAYERS:
                    right = rng.random() < 0.6
                    pred = picks[layer + 1] if right else torch.from_numpy(
                        rng.integers(0, EXPERTS, (rows, 2))
                    )  # fmt: skip
                if lane:
                    check_key_lane(home, ec, records)
                    fast, took = lane_layer(home, ec, rng, layer, picks[layer])
                    sel, w = fast.selected, fast.weights
                else:
                    fast, took = None, {}
                    sel, w = picks[layer].clone(), torch.ones(rows, 2)
                since = len(lib.calls)
                home.route(layer, sel, True, {}, w, lane=fast, predicted=pred)
                check_pointed(home, ec, lib, records, layer, since)
                for e, slot in took.items():
                    check_resident(home, records, layer, e, slot, "the lane's")
            home.end_forward()
            assert home.prefetch.idle()
        home._write(home.ahead.drain())
        assert home.tier.clock.n_pinned == 0
        assert np.array_equal(ec._t["home"].numpy(), home.home.expected())
        stats = home.stats()
        assert stats["prefetch_waves"] > 0 and stats["table_bad"] == 0, stats
    finally:
        home.close()
