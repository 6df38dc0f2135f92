"""nvme-exact's prefill staging on the CPU (glm53.tiers.prefill_ahead, the staged path of
glm53.exl3.nvme_device.NvmeHome.route): the real RAM tier over a real packed store with real
O_DIRECT reads; the GPU is played by named mocks (test_nvme_device_glue's MockExpertCache and
MockCudaLib, and MockStager here, which records what the device's stager would do and checks
the bytes it would copy). The kernels and streams themselves run only on a GPU
(tests/gpu/test_nvme_exact_gpu.py)."""

import errno
import types

import numpy as np
import pytest
import torch
from test_nvme_device_glue import EXPERTS, LAYERS, POISON, RECORD, mock_nvme_home

from glm53._odirect import aligned_empty
from glm53.tiers.prefill_ahead import AheadReads
from glm53.tiers.ram_tier import ReadFault


class RecordingReader:
    """The store's real O_DIRECT reader, with each submit and wait recorded (no fault, no
    timing): shows when a wave's reads are queued and when they are collected."""

    def __init__(self, reader):
        self.reader, self.log = reader, []

    def submit(self, offset, length, buf, tag, *args, **kwargs):
        self.log.append(("submit", offset // RECORD))
        self.reader.submit(offset, length, buf, tag, *args, **kwargs)

    def wait(self, tags=None, timeout=None):
        self.log.append(("wait", len(list(tags))))
        return self.reader.wait(tags, timeout)

    def __getattr__(self, name):
        return getattr(self.reader, name)


class MockEvent:
    def __init__(self, log, layer):
        self.log, self.layer = log, layer

    def synchronize(self):
        self.log.append(("event_sync", self.layer))


class MockStager:
    """Stands in for glm53.tiers.vram_cache.PrefillStager (CUDA streams and the stage kernel):
    `stage_ahead` records the layer and checks, as the stage kernel would read them, that the
    home table entry of every expert the host trusts as staged points at that expert's record."""

    def __init__(self, home, ec, calls, buf_slots=16, min_rows=4, prefill_layers=LAYERS):
        self.home, self.ec, self.calls = home, ec, calls
        self.buf_slots, self.min_rows, self.hold = buf_slots, min_rows, False
        self.prefill_layers = prefill_layers  # PrefillStager's: the MoE layers a prefill runs
        self.pending: dict = {}
        self.side = types.SimpleNamespace(synchronize=lambda: calls.append(("side_sync",)))
        self.copied: dict = {}
        self.owner, self.held = [-1, -1], set()  # a layer-major pass's stages (stage_held)

    def is_held(self, layer):
        return self.hold and layer in self.held and self.owner[layer % 2] == layer

    def stage_held(self, layer):
        """As the stage kernel would run it now (main stream, in order): the records of the
        first buf_slots uncached experts (the mock VRAM cache holds none) copied from their
        homes; those the host trusts (resident now) must be their experts' records."""
        assert self.hold, "stage_held outside a pass"
        table = self.ec._t["home"].numpy()
        copies = {}
        for e in range(min(self.buf_slots, EXPERTS)):
            addr = int(table[layer * EXPERTS + e])
            if addr == POISON:
                continue  # a copy of the absent record: the host must not trust it
            slot = (addr - self.home.home.arena_address) // RECORD
            assert self.home.tier.clock.key_of(slot) == layer * EXPERTS + e
            copies[e] = self.home.tier.record(slot)[:RECORD].copy()
        self.copied[layer] = copies
        self.owner[layer % 2] = layer
        self.held.add(layer)
        self.calls.append(("stage_held", layer, sorted(copies)))

    def wait_staged(self, layer):
        ev = self.pending.pop(layer, None)
        self.calls.append(("wait_staged", layer, ev is not None))
        return ev

    def stage_ahead(self, layer):
        table = self.ec._t["home"].numpy()
        trusted = self.home.ahead.staged(layer)
        copies = {}
        for e in trusted.tolist():
            addr = int(table[layer * EXPERTS + e])
            assert addr != POISON, f"layer {layer} expert {e} staged with no home"
            slot = (addr - self.home.home.arena_address) // RECORD
            assert self.home.tier.clock.pin_count(slot) > 0, "a staged record is not pinned"
            copies[e] = self.home.tier.record(slot)[:RECORD].copy()
        self.copied[layer] = copies
        self.calls.append(("stage_ahead", layer, sorted(copies)))
        self.pending[layer] = MockEvent(self.calls, layer)


def check_table(home, ec):
    """The device home table as the RAM tier holds it, except that the records of a wave still
    out are absent (no entry points at a slot being read into) until their wave is collected."""
    table, want = ec._t["home"].numpy(), home.home.expected()
    for layer, wave in home.ahead.out.items():
        out = layer * EXPERTS + wave.experts[wave.num_hits :].astype(np.int64)
        assert (table[out] == POISON).all()
        want[out] = POISON
    assert np.array_equal(table, want)


def store_record(store, moe_index, expert):
    buf = aligned_empty(RECORD)
    store.read([(store.moe_layers[moe_index], expert, buf)])
    return np.frombuffer(buf, np.uint8)[:RECORD].copy()


@pytest.fixture
def staged(demo, good_store, monkeypatch):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 120, RecordingReader)
    stager = MockStager(home, ec, lib.calls)
    home.stager, home.ahead = stager, AheadReads(home.home, stager.buf_slots, working_set=32)
    yield home, ec, lib, stager
    home.close()


def prefill(rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, EXPERTS, (rows, 2), generator=g, dtype=torch.int64)


def test_a_wave_is_queued_on_the_reader_at_begin_and_collected_at_finish(staged):
    home, ec, lib, stager = staged
    ahead, log = home.ahead, home.tier.source.reader.log
    assert ahead.begin(3, np.full(EXPERTS, -1))
    assert [k for k, _ in log] == ["submit"] * len(log) and log  # queued, nobody waited
    wave = ahead.out[3]
    assert all(home.tier.clock.pin_count(int(s)) == 1 for s in wave.slots)
    update = ahead.finish(3)
    assert log[-1][0] == "wait"
    assert sorted(ahead.staged(3).tolist()) == list(range(16))  # the first buf_slots uncached
    for e, slot in zip(wave.experts.tolist(), wave.slots.tolist(), strict=True):
        assert np.array_equal(home.tier.record(slot)[:RECORD], store_record(home.tier.source, 3, e))
        key = 3 * EXPERTS + e
        assert update.addresses[update.keys.tolist().index(key)] == home.home.address(slot)
    ahead.release(3)
    assert all(home.tier.clock.pin_count(int(s)) == 0 for s in wave.slots)


def test_the_wave_skips_what_the_vram_cache_holds_and_is_cut_to_leave_a_working_set(staged):
    home, ec, lib, stager = staged
    ahead = home.ahead
    row = np.full(EXPERTS, -1)
    row[[0, 2]] = 5  # in VRAM: the stage kernel skips them, so does the wave
    assert ahead.choose(row).tolist() == [1] + list(range(3, 18))
    ahead.hold_picks(0, [])  # nothing held yet: 120 slots - 32 working set = 88 to pin
    for layer in range(5):  # 16 each: the sixth would need 96 pinned
        assert ahead.begin(layer, np.full(EXPERTS, -1))
    assert ahead.pinned() == 80 and ahead.budget() == 8
    assert ahead.begin(5, np.full(EXPERTS, -1)) and len(ahead.out[5].slots) == 8
    assert ahead.counters["cut"] == 1 and ahead.budget() == 0
    assert ahead.begin(1, row) and ahead.counters["waves"] == 6  # already out: not begun again
    # a synchronous resolve still finds a layer's working set of unpinned slots
    got = home.home.resolve(home.tier.source.moe_layers[0], np.arange(32), np.zeros(32, bool))
    assert got.ram_hits + got.ram_reads == 32
    home._write(got)
    home._write(home.ahead.drain())
    assert all(home.tier.clock.pin_count(s) == 0 for s in range(home.tier.num_slots))
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())


def test_prefill_waves_go_through_frequency_admission_and_leave_the_hot_set(staged):
    home, ec, lib, stager = staged
    hot = np.arange(8)
    layer0 = home.tier.source.moe_layers[0]
    for _ in range(4):  # layer 0's experts 0-7 picked again and again
        home._write(home.home.resolve(layer0, hot, np.zeros(8, bool)))
    home.ahead.buf_slots = 32
    for _round in range(3):  # three long prompts: every other layer read once per chunk
        for layer in range(1, LAYERS):
            home.ahead.begin(layer, np.full(EXPERTS, -1))
            home._write(home.ahead.finish(layer))
            home.ahead.release(layer)
    assert all(home.tier.clock.contains(int(e)) for e in hot), "prefill flushed the hot set"
    home._write(home.home.take_pending())
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())


def test_a_staged_forward_reads_ahead_stages_ahead_and_points_only_what_was_not_staged(staged):
    home, ec, lib, stager = staged
    log = home.tier.source.reader.log
    picks = {layer: prefill(seed=layer) for layer in range(LAYERS)}
    marks = []
    for layer in range(LAYERS):
        log.clear()
        home.route(layer, picks[layer].clone(), decode=False, params={})
        marks.append(list(log))
        check_table(home, ec)
    ops = [c for c in lib.calls if c[0] in ("stage_ahead", "wait_staged", "point_picks")]
    # hook 0: layer 1's wave read then staged ahead; hook L: wait for L's stage, stage L + 1
    assert ops[0] == ("wait_staged", 0, False) and ops[1][:2] == ("stage_ahead", 1)
    for layer in range(1, LAYERS):
        assert ("wait_staged", layer, True) in ops
    assert [c[1] for c in ops if c[0] == "stage_ahead"] == list(range(1, LAYERS))
    # what each stage copied is the store's record of each trusted expert
    for layer, copies in stager.copied.items():
        assert sorted(copies) == list(range(16))
        for e, got in copies.items():
            assert np.array_equal(got, store_record(home.tier.source, layer, e))
    # every pick is either staged (its trusted copy) or pointed at its slot or RAM home
    for layer in range(LAYERS):
        pointed = next(c[2] for c in lib.calls if c[0] == "point_picks" and c[1] == layer)
        distinct = set(np.unique(picks[layer].numpy()).tolist())
        staged_set = set(range(16)) if layer > 0 else set()
        assert set(pointed) == distinct - staged_set
        assert all(home.tier.clock.contains(layer * EXPERTS + e) for e in pointed)
    # the wave of L + 2 is queued at hook L and collected at hook L + 1
    assert marks[1][-1][0] == "submit" and any(k == "wait" for k, _ in marks[2])
    assert home.staging_stats()["stage_layers"] == LAYERS - 1
    ahead_reads = home.staging_stats()["stage_reads"]
    assert ahead_reads > 0 and home.stats()["ram_reads"] >= ahead_reads  # totals count both
    check_table(home, ec)


def test_a_layer_whose_stage_covered_every_pick_points_nothing_and_goes_on(staged):
    """Every pick of layers 1.. among the experts their stage covers (0-15): nothing is left to
    point, so no launch is made for none (an empty tensor's pointer is null, which the real
    launcher refuses: on the H200 on 2026-12-05 such a layer failed its request with "pointing
    MoE layer 3's picks at their homes failed: invalid argument")."""
    home, ec, lib, stager = staged
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        hi = EXPERTS if layer == 0 else 16
        picks = torch.randint(0, hi, (8, 2), generator=g, dtype=torch.int64)
        home.route(layer, picks, decode=False, params={})
        check_table(home, ec)
    pointed = {c[1]: c[2] for c in lib.calls if c[0] == "point_picks"}
    assert pointed[0] and all(layer not in pointed for layer in range(1, LAYERS)), pointed
    assert home.staging_stats()["stage_layers"] == LAYERS - 1
    assert [c[1] for c in lib.calls if c[0] == "stage_ahead"] == list(range(1, LAYERS))


def test_the_last_moe_layer_is_neither_read_ahead_nor_staged_when_no_prefill_runs_it(staged):
    """exllamav3's prefill stops in the last KV block after its attention, so the last MoE
    layer's hook never runs in a prefill (PrefillStager.prefill_layers, LAYERS - 1 here): the
    forward's waves stop at the layer before it, no record of the last layer is read from the
    store, and nothing stages it."""
    home, ec, lib, stager = staged
    stager.prefill_layers = LAYERS - 1
    log = home.tier.source.reader.log
    log.clear()
    for layer in range(LAYERS - 1):  # the hooks a prefill forward runs
        home.route(layer, prefill(seed=layer), decode=False, params={})
        check_table(home, ec)
    assert [c[1] for c in lib.calls if c[0] == "stage_ahead"] == list(range(1, LAYERS - 1))
    source = home.tier.source
    last = {source.offset(source.moe_layers[LAYERS - 1], e) // RECORD for e in range(EXPERTS)}
    read = {r for kind, r in log if kind == "submit"}
    assert read and not read & last, sorted(read & last)
    assert home.ahead.idle() or LAYERS - 1 not in home.ahead.out
    assert home.staging_stats()["stage_layers"] == LAYERS - 2


def test_a_decode_step_after_a_staged_forward_drains_every_pin(staged):
    home, ec, lib, stager = staged
    for layer in range(LAYERS):
        home.route(layer, prefill(seed=layer), decode=False, params={})
    assert not home.ahead.idle()  # the last layer's zero-copy picks are still held
    home.route(0, torch.tensor([[3, 4]]), decode=True, params={})
    assert ("side_sync",) in lib.calls and home.ahead.idle()
    assert all(home.tier.clock.pin_count(s) == 0 for s in range(home.tier.num_slots))
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())
    # a new prefill forward restarts the pipeline from its first layer
    lib.calls.clear()
    home.route(0, prefill(seed=9), decode=False, params={})
    assert ("wait_staged", 0, False) in lib.calls


def test_a_read_fault_ahead_skips_the_stage_and_fails_the_request_at_its_layer(staged):
    from store_kit import FailingReader

    home, ec, lib, stager = staged
    real = home.tier.source.reader
    home.tier.source.reader = FailingReader(real, [(2 * EXPERTS + 4) * RECORD + 4096], errno.EIO)
    sel = torch.tensor([[4, 1]] * 3 + [[2, 3]] * 5, dtype=torch.int64)  # rows 0-2 pick 4
    home.route(0, prefill(seed=0), decode=False, params={})
    home.route(1, prefill(seed=1), decode=False, params={})  # collects layer 2's wave: fails
    assert home.ahead.counters["faults"] == 1
    assert not any(c[:2] == ("stage_ahead", 2) for c in lib.calls)  # layer 2 is not staged
    check_table(home, ec)
    layer = home.tier.source.moe_layers[2]
    with pytest.raises(ReadFault) as info:
        home.route(2, sel, decode=False, params={})
    assert (info.value.layer, info.value.expert, info.value.rows) == (layer, 4, (0, 1, 2))
    home.tier.source.reader = real
    assert home.ahead.out  # the forward was cut short with layer 3's wave still out
    result = home.verify(16, seed=0)  # drains first: the check sees no wave in flight
    assert result.is_ok, result.summary()
    assert home.ahead.idle()
    home.route(0, prefill(seed=3), decode=False, params={})  # the next forward starts afresh
    check_table(home, ec)


def test_a_wave_whose_read_fails_holds_no_pin_and_leaves_the_tier_consistent(staged):
    from store_kit import FailingReader

    home, ec, lib, stager = staged
    real = home.tier.source.reader
    home.tier.source.reader = FailingReader(real, [(1 * EXPERTS + 7) * RECORD + 4096], errno.EIO)
    assert home.ahead.begin(1, np.full(EXPERTS, -1))
    assert home.ahead.finish(1) is None
    home.tier.source.reader = real
    assert home.tier.faults["read_errors"] == 1 and home.ahead.idle()
    assert all(home.tier.clock.pin_count(s) == 0 for s in range(home.tier.num_slots))
    home._write(home.home.take_pending())
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())
    assert not home.tier.clock.contains(1 * EXPERTS + 7)


def test_a_staged_chunk_counts_each_access_once_as_an_unstaged_one_does(staged):
    home, ec, lib, stager = staged
    picks = {layer: prefill(seed=layer) for layer in range(LAYERS)}
    for layer in range(LAYERS):
        home.route(layer, picks[layer], decode=False, params={})
    counts = np.asarray(home.tier.clock.freq_counts())
    for layer in range(1, LAYERS):  # layer 0 is resolved, not staged
        picked = set(np.unique(picks[layer].numpy()).tolist())
        for e in range(EXPERTS):
            # the wave's experts (0-15) once, picked or not; the other picks once, at the hook
            want = 1 if e < 16 or e in picked else 0
            assert counts[layer * EXPERTS + e] == want, (layer, e)


def test_a_wave_past_the_read_timeout_keeps_only_the_stuck_slots_pinned(staged):
    from store_kit import StallingReader

    home, ec, lib, stager = staged
    home.tier.read_timeout_s = 0.2
    real = home.tier.source.reader
    stall = StallingReader(real, [(2 * EXPERTS + 5) * RECORD + 4096])
    home.tier.source.reader = stall
    assert home.ahead.begin(2, np.full(EXPERTS, -1))
    assert home.ahead.finish(2) is None and home.ahead.idle()
    assert home.tier.faults["read_timeouts"] == 1
    stuck = home.tier.stuck_keys()
    assert 2 * EXPERTS + 5 in stuck
    pinned = {s for s in range(home.tier.num_slots) if home.tier.clock.pin_count(s)}
    assert pinned == {home.tier.clock.slot_of(k) for k in stuck}  # the stuck reads' slots only
    home._write(home.home.take_pending())
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())
    layer = home.tier.source.moe_layers[2]
    with pytest.raises(ReadFault, match=f"layer {layer} expert 5: its read .* has not finished"):
        home.home.resolve(layer, np.array([5]), np.zeros(1, bool))
    stall.release()
    home.tier.source.reader = real


def check_pointed(home, ec, lib, layer, since, pinned=True):
    """What the device's MoE kernel of `layer` reads zero-copy once the hook returned: every pick
    the hook pointed (its point_picks call among lib.calls[since:], none when its stage covered
    every pick; the mock VRAM cache holds nothing) has a home in the device table, that home is
    a RAM slot holding the expert's record, and the slot is pinned (the eviction contract: held
    from hook L until hook L + 1; `pinned` False: an unstaged hook, whose picks are safe by the
    order of the host's sync instead, glm53.tiers.gpu_home)."""
    calls = [c[2] for c in lib.calls[since:] if c[0] == "point_picks" and c[1] == layer]
    assert len(calls) <= 1, calls
    pointed = calls[0] if calls else []
    table, tier = ec._t["home"].numpy(), home.tier
    for e in pointed:
        key = layer * EXPERTS + e
        addr = int(table[key])
        assert addr != POISON, f"layer {layer} expert {e} pointed with no home (table_bad)"
        slot = (addr - home.home.arena_address) // RECORD
        assert tier.clock.key_of(slot) == key, f"layer {layer} expert {e}: its slot was reused"
        if pinned:
            assert tier.clock.pin_count(slot) > 0, f"layer {layer} expert {e}: slot not pinned"
        assert np.array_equal(tier.record(slot)[:RECORD], store_record(tier.source, layer, e))


def test_a_forwards_first_staged_layer_keeps_its_picks_while_the_next_layers_wave_is_read(staged):
    """At a forward's first staged hook the wave of the next layer is begun after the layer's own
    resolve. Its admissions must not take the slots of the picks that the layer's MoE kernel is
    about to read zero-copy: frequency admission puts a key seen once on probation, in the slot
    of the newest probation member placed before its batch, and those are exactly the misses
    the layer's resolve has just read. A tier full of frequent keys, then a prompt's chunk."""
    home, ec, lib, stager = staged
    hot = {layer: np.r_[0:4, 16:32] for layer in range(LAYERS)}  # 20 a layer: the 120 slots
    for _ in range(4):
        for layer in range(LAYERS):
            moe = home.tier.source.moe_layers[layer]
            home._write(home.home.resolve(moe, hot[layer], np.zeros(20, bool)))
    assert home.tier.clock.n_used == home.tier.num_slots  # full of keys seen 4 times
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):  # a chunk picking experts 0-15 (4-15 seen once) everywhere
        sel = torch.randint(0, 16, (64, 2), generator=g, dtype=torch.int64)
        since = len(lib.calls)
        home.route(layer, sel, decode=False, params={})
        check_pointed(home, ec, lib, layer, since)
    check_table(home, ec)


@pytest.mark.parametrize(("ram_slots", "working_set", "buf_slots"), [(70, 16, 8), (120, 32, 32)])
def test_mixed_prompts_and_decode_steps_keep_every_pointed_pick_resident_and_pinned(
    demo, good_store, monkeypatch, ram_slots, working_set, buf_slots
):
    """Prefill chunks of random sizes and spreads, decode steps between them (seeded, no
    timing): at every staged hook each pick pointed at a RAM home is that expert's record,
    pinned; the tier check is clean at the end."""
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, ram_slots, RecordingReader)
    try:
        stager = MockStager(home, ec, lib.calls, buf_slots=buf_slots)
        home.stager, home.ahead = stager, AheadReads(home.home, buf_slots, working_set)
        rng = np.random.default_rng(0)
        for _ in range(12):
            decode = rng.integers(0, 3) == 2
            rows, hi = (
                (2, EXPERTS) if decode else (rng.integers(4, 64), rng.integers(8, EXPERTS + 1))
            )
            for layer in range(LAYERS):
                sel = torch.from_numpy(rng.integers(0, hi, (rows, 2))).long()
                since = len(lib.calls)
                home.route(layer, sel, decode=bool(decode), params={})
                if not decode:
                    check_pointed(home, ec, lib, layer, since)
        result = home.verify(16, seed=0)
        assert result.is_ok, result.summary()
    finally:
        home.close()


def test_a_staged_layers_resolve_finds_a_working_set_of_room_in_a_tier_just_above_it(
    demo, good_store, monkeypatch
):
    """--ram-cap may be as small as one layer's working set (gpu_home.check_home_cap), and a
    staged layer's resolve must then still find that many unpinned slots. The zero-copy picks
    of layer L-1 are released once the host has synced on L's router (MoE L-1 is done), before
    L's resolve: held until after it, they took the room that resolve needs (a tier of 40 slots
    for a working set of 32, every layer picking every expert: HomeCapError at MoE layer 1). Such a
    tier has no room for a wave beside one: every wave is cut to nothing, the hooks still staged."""
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 40, RecordingReader)
    stager = MockStager(home, ec, lib.calls, buf_slots=4)
    home.stager, home.ahead = stager, AheadReads(home.home, stager.buf_slots, EXPERTS)
    try:
        every = torch.arange(EXPERTS, dtype=torch.int64).view(-1, 2)  # 16 rows, every expert
        for layer in range(LAYERS):
            since = len(lib.calls)
            home.route(layer, every.clone(), decode=False, params={})
            check_pointed(home, ec, lib, layer, since)
        assert ("wait_staged", LAYERS - 1, False) in lib.calls  # the staged path ran
        assert home.ahead.counters["cut"] > 0 and home.ahead.counters["waves"] == 0
        check_table(home, ec)
    finally:
        home.close()


def test_a_wave_refused_for_a_stuck_hit_leaves_the_home_table_in_line_with_the_tier(staged):
    """A wave whose hits include a record whose read timed out and is still out is refused
    (RamTier._refuse_stuck_hits: its misses are taken back). In a full tier those misses had
    already evicted their victims: the victims' homes must go absent, not keep pointing at slots
    that are free now and that the next read fills with another record (the device's zero-copy
    reads, and nvme mode's lane through key_lane, would read it as the victim)."""
    from store_kit import StallingReader

    home, ec, lib, stager = staged
    tier = home.tier
    for layer in range(4):  # 128 keys through 120 slots: full
        moe = tier.source.moe_layers[layer]
        home._write(home.home.resolve(moe, np.arange(EXPERTS), np.zeros(EXPERTS, bool)))
    assert tier.clock.n_used == tier.num_slots
    tier.read_timeout_s = 0.05
    real = tier.source.reader
    stall = StallingReader(real, [(4 * EXPERTS + 5) * RECORD + 4096])
    tier.source.reader = stall
    try:
        with pytest.raises(ReadFault, match="no answer within"):
            home.home.resolve(tier.source.moe_layers[4], np.array([5]), np.zeros(1, bool))
        home._write(home.home.take_pending())
        assert 4 * EXPERTS + 5 in tier.stuck_keys()
        assert not home.ahead.begin(4, np.full(EXPERTS, -1))  # expert 5 is a hit: refused
        assert home.ahead.counters["faults"] == 1 and home.ahead.idle()
        home._write(home.home.take_pending())
        check_table(home, ec)
        assert np.array_equal(home.home.home_of, home.home.expected())
    finally:
        stall.release()
        tier.source.reader = real


def _reads_in_order(demo, good_store, monkeypatch, order, hold, pass_staging=None):
    """Route one prompt's chunks (4 chunks of 24 rows, seeded picks per chunk and layer) in
    `order` ("chunk": every layer per chunk; "layer": every chunk per layer, as a layer-major
    pass runs them), the stager held (a pass) or not, over a RAM tier of 96 slots (the demo's
    192 records: half), the pass staging each layer once when `pass_staging` (default: when
    held); returns (store reads, the home, its calls)."""
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 96, RecordingReader)
    stager = MockStager(home, ec, lib.calls)
    home.stager, home.ahead = stager, AheadReads(home.home, stager.buf_slots, working_set=32)
    stager.hold = hold
    # the store modes' pass staging (the GPU engine sets it from --allow-unrun-modes)
    home.pass_staging = hold if pass_staging is None else pass_staging
    picks = {(c, layer): prefill(rows=24, seed=100 * c + layer)
             for c in range(4) for layer in range(LAYERS)}  # fmt: skip
    steps = [(c, layer) for c in range(4) for layer in range(LAYERS)]
    if order == "layer":
        steps.sort(key=lambda s: (s[1], s[0]))
    for c, layer in steps:
        since = len(lib.calls)
        home.route(layer, picks[c, layer].clone(), decode=False, params={})
        check_pointed(home, ec, lib, layer, since, pinned=not hold)
        check_table(home, ec)
        if hold and home.pass_staging:  # every pick read from the pass's stage or pointed
            check_pass_stage(home, stager, lib, layer, since, picks[c, layer])
    return home.home.counters["ram_reads"], home, lib, picks


def check_pass_stage(home, stager, lib, layer, since, chunk_picks):
    """A held hook of a pass (glm53.exl3.nvme_device's pass staging): the experts the host
    trusts in the layer's stage are exactly those whose staged copies were their records
    (MockStager.stage_held checked each copy against the tier), and every pick of the chunk is
    either one of them or pointed at its home by this hook."""
    layer_staged, covered = home._pass_staged
    assert layer_staged == layer and stager.is_held(layer)
    assert sorted(covered.tolist()) == sorted(stager.copied[layer]), (covered, stager.copied)
    pointed = [c[2] for c in lib.calls[since:] if c[0] == "point_picks" and c[1] == layer]
    pointed = set(pointed[0]) if pointed else set()
    distinct = {int(e) for e in chunk_picks.reshape(-1).tolist()}
    assert not pointed & set(covered.tolist()), "a staged pick was pointed away from its stage"
    assert distinct <= pointed | set(covered.tolist()), distinct - pointed - set(covered.tolist())


def test_a_held_stager_reads_each_layer_once_per_prompt_in_layer_major_order(
    demo, good_store, monkeypatch
):
    """A layer-major pass in the store modes (glm53.exl3.layer_major, the stager held): every
    chunk of a layer resolves its picks unstaged (nothing is read ahead or staged), each
    pointed pick is a resident, pinned record, and the store is read once per touched expert of
    the prompt: the tier keeps a layer's records across its chunks. The same chunks in
    chunk-major order over the same half-size tier read more (each chunk's pass over every
    layer evicts the layers before it)."""
    reads, home, lib, picks = _reads_in_order(demo, good_store, monkeypatch, "layer", hold=True)
    try:
        touched = {(layer, int(e)) for (c, layer), p in picks.items() for e in p.reshape(-1)}
        assert reads == len(touched), (reads, len(touched))
        assert not [c for c in lib.calls if c[0] in ("stage_ahead", "wait_staged")]
        assert home.staging_stats()["stage_waves"] == 0
        # each layer staged once, at its first chunk, on the main stream (stage_held)
        stages = [c[1] for c in lib.calls if c[0] == "stage_held"]
        assert stages == list(range(LAYERS)) and home.pass_stats()["pass_stages"] == LAYERS
        # the last layer's records stay pinned until the pass is over: a decode step between
        # its steps keeps them, the first hook after it ends (the stager's hold dropped) not
        last = home.pass_stats()
        assert last["pass_layer"] == LAYERS - 1 and last["pass_pinned"] > 0, last
        home.route(2, prefill(rows=2, seed=9), decode=True, params={})
        assert home.pass_stats() == last
        home.stager.hold = False
        home.route(2, prefill(rows=2, seed=9), decode=True, params={})
        assert home.pass_stats()["pass_pinned"] == 0 and home.tier.clock.n_pinned == 0
        check_table(home, home.ec)
    finally:
        home.close()
    chunk_major, home2, _, _ = _reads_in_order(demo, good_store, monkeypatch, "chunk", hold=True)
    home2.close()
    assert chunk_major > reads, (chunk_major, reads)


def test_a_pass_without_pass_staging_points_every_pick_and_reads_each_layer_once(
    demo, good_store, monkeypatch
):
    """The served default (--allow-unrun-modes off: UNRUN["store-pass-staging"]): the pass
    stages nothing, every chunk's picks are pointed at resident records (zero-copy), and the
    store is still read once per touched expert, as its GPU test ran on an H100."""
    reads, home, lib, picks = _reads_in_order(
        demo, good_store, monkeypatch, "layer", hold=True, pass_staging=False
    )
    try:
        touched = {(layer, int(e)) for (c, layer), p in picks.items() for e in p.reshape(-1)}
        assert reads == len(touched), (reads, len(touched))
        assert not [c for c in lib.calls if c[0] in ("stage_held", "stage_ahead")]
        assert home.pass_stats()["pass_stages"] == 0 and home._pass_staged is None
        pointed = {(c[1], e) for c in lib.calls if c[0] == "point_picks" for e in c[2]}
        assert touched <= pointed  # every pick of every chunk pointed at its home
    finally:
        home.close()
