"""nvme-exact's host side (glm53.tiers.gpu_home.RamHome) with the real RAM tier over a real
packed store, real O_DIRECT reads and the real fault paths. The GPU's part is played by named
mocks: `MockDeviceTable` (the device home table the host writes) and `MockVramCache` (the
VRAM cache's resident set, admitting misses from their homes as the route kernel does, and
counting `table_bad` where cuda/ec.cu's check_homes would)."""

import errno
import hashlib

import numpy as np
import pytest
from serving_kit import Server
from store_kit import FailingReader, StallingReader, flip_byte, make_checkpoint

from glm53.models.checkpoint import Checkpoint
from glm53.store.errors import StoreMismatchError
from glm53.store.reader import ExpertStore
from glm53.tiers.expert_source import SafetensorsSource
from glm53.tiers.gpu_home import (
    HomeCapError,
    RamHome,
    check_home_cap,
    layer_working_set,
    open_home_source,
    verify_home,
)
from glm53.tiers.ram_tier import RamTier, ReadFault, TierError

RECORD = 77_824  # demo record bytes
EXPERTS, LAYERS, TOP_K = 32, 6, 4
ABSENT = 0x7F00_0000_0000  # stands for the poison record's address on the GPU


class MockDeviceTable:
    """Mock of the device's home table (DeviceExpertCache's `home` tensor): applies the host's
    writes as the scatter in glm53.exl3.nvme_device does."""

    def __init__(self, num_keys: int):
        self.home = np.full(num_keys, ABSENT, dtype=np.int64)
        self.writes = 0

    def apply(self, update) -> None:
        assert len(np.unique(update.keys)) == len(update.keys), "a scatter needs distinct keys"
        self.home[update.keys] = update.addresses
        self.writes += len(update)


class MockVramCache:
    """Mock of the device VRAM cache's resident set: `slots` keys, LRU; a miss is admitted
    only from a present home (else it counts table_bad, as check_homes does on the device),
    and what it copies is the home's leading slot bytes at that moment."""

    def __init__(self, home: RamHome, table: MockDeviceTable, slots: int):
        self.home, self.table, self.slots = home, table, slots
        self.resident: dict[int, bytes] = {}  # key -> bytes copied at admission
        self.table_bad = 0

    def in_vram(self, layer_index: int, picks: np.ndarray) -> np.ndarray:
        return np.array([layer_index * EXPERTS + int(e) in self.resident for e in picks])

    def route(self, layer_index: int, picks: np.ndarray) -> dict[int, bytes]:
        """What the MoE kernel reads for each distinct pick: its slot's or its home's bytes."""
        read = {}
        for e in dict.fromkeys(int(p) for p in picks):
            key = layer_index * EXPERTS + e
            if key in self.resident:
                self.resident[key] = self.resident.pop(key)  # LRU touch
                read[e] = self.resident[key]
                continue
            addr = int(self.table.home[key])
            if addr == ABSENT:
                self.table_bad += 1
                continue
            got = bytes(home_bytes(self.home, addr))
            read[e] = got
            if len(self.resident) >= self.slots:
                self.resident.pop(next(iter(self.resident)))
            self.resident[key] = got
        return read


def home_bytes(home: RamHome, addr: int) -> np.ndarray:
    """The slot bytes at a home address (the arena is host memory here: address = offset)."""
    off = addr - home.arena_address
    assert off % home.tier.slot_bytes == 0
    return home.tier.arena[off : off + home.slot_bytes]


def make_home(good_store, demo, records: int):
    store = ExpertStore(good_store, Checkpoint(demo))
    tier = RamTier(store, records * RECORD, read_timeout_s=None)
    return RamHome(tier, tier.arena.ctypes.data, ABSENT)


def store_slot_bytes(store_path) -> dict[int, bytes]:
    """Every record's leading slot bytes, read plainly (no O_DIRECT, no glm53 reader)."""
    with ExpertStore(store_path) as s:
        slot = s.layout.slot_bytes
    data = (store_path / "experts.bin").read_bytes()
    return {r: data[r * RECORD : r * RECORD + slot] for r in range(LAYERS * EXPERTS)}


class CountingReader:
    """Wraps the real reader; counts wait() calls (one per read batch)."""

    def __init__(self, reader):
        self.reader, self.waits = reader, 0

    def wait(self, tags=None, timeout=None):
        self.waits += 1
        return self.reader.wait(tags, timeout)

    def __getattr__(self, name):
        return getattr(self.reader, name)


def test_a_layer_s_vram_misses_are_read_in_one_batch_and_their_homes_hold_the_store_bytes(
    demo, good_store
):
    home = make_home(good_store, demo, 64)
    table = MockDeviceTable(home.tier.num_keys)
    counting = CountingReader(home.tier.source.reader)
    home.tier.source.reader = counting
    picks = np.array([[3, 9, 17, 30], [9, 2, 3, 31]])  # two decode rows, top-4
    in_vram = np.isin(picks, [2, 31])  # the VRAM cache holds experts 2 and 31
    layer = home.tier.source.moe_layers[1]
    update = home.resolve(layer, picks, in_vram)
    assert counting.waits == 1  # one batch for the layer
    assert (update.vram_hits, update.ram_hits, update.ram_reads) == (2, 0, 4)
    assert update.bytes_read == 4 * RECORD
    table.apply(update)
    want = store_slot_bytes(good_store)
    for e in (3, 9, 17, 30):
        key = 1 * EXPERTS + e
        assert bytes(home_bytes(home, int(table.home[key]))) == want[key]
    assert table.home[EXPERTS + 2] == ABSENT and table.home[EXPERTS + 31] == ABSENT
    # the same picks again: RAM hits, nothing read, nothing to write
    again = home.resolve(layer, picks, in_vram)
    assert (again.ram_hits, again.ram_reads, len(again), counting.waits) == (4, 0, 0, 1)
    # a masked pick (-1, as exllamav3 pads) is skipped as the route kernel skips it
    masked = home.resolve(layer, np.array([-1, 3, EXPERTS]), np.zeros(3, bool))
    assert (masked.ram_hits, masked.ram_reads) == (1, 0)
    home.tier.close()


def test_under_a_small_cap_every_pick_reads_the_store_bytes_and_no_home_is_ever_absent(
    demo, good_store
):
    """Decode-like traffic over every layer, skewed, through a 40-record tier (21 % of the
    experts) under a 12-slot mock VRAM cache: every byte the MoE kernel would read equals the
    store's, the device table always equals where the tier holds each key, and no pick ever
    finds its home absent (table_bad stays 0)."""
    home = make_home(good_store, demo, 40)
    table = MockDeviceTable(home.tier.num_keys)
    vram = MockVramCache(home, table, slots=12)
    want = store_slot_bytes(good_store)
    rng = np.random.default_rng(17)
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 1.1
    weights /= weights.sum()
    evicted_writes = 0
    for step in range(30):
        rows = 1 + step % 4
        for li, layer in enumerate(home.tier.source.moe_layers):
            picks = np.stack(
                [rng.choice(EXPERTS, TOP_K, replace=False, p=weights) for _ in range(rows)]
            )
            update = home.resolve(layer, picks, vram.in_vram(li, picks.reshape(-1)))
            evicted_writes += int(np.sum(update.addresses == ABSENT))
            table.apply(update)
            read = vram.route(li, picks.reshape(-1))
            assert set(read) == set(picks.reshape(-1).tolist())
            for e, got in read.items():
                assert got == want[li * EXPERTS + e], (step, layer, e)
    assert vram.table_bad == 0
    assert evicted_writes > 0  # the cap forced evictions, and each one was written absent
    assert np.array_equal(table.home, home.expected())
    result = verify_home(home, 64, table.home, seed=0)
    assert result.is_ok, result.summary()
    assert result.ram_checked == 64 and result.table_checked == 40 + LAYERS * EXPERTS
    home.tier.close()


def test_a_read_error_or_short_read_names_the_layer_and_expert_and_the_table_stays_exact(
    demo, good_store
):
    home = make_home(good_store, demo, 16)
    table = MockDeviceTable(home.tier.num_keys)
    layer0, layer1 = home.tier.source.moe_layers[:2]
    table.apply(home.resolve(layer0, np.arange(16), np.zeros(16, bool)))  # the tier is full
    real = home.tier.source.reader
    faults = ((errno.EIO, "read_errors", [7, 8]), (errno.ENODATA, "short_reads", [9, 10]))
    for code, counter, others in faults:
        bad = 1 * EXPERTS + 5  # layer 1, expert 5
        home.tier.source.reader = FailingReader(real, [bad * RECORD + 4096], code)
        with pytest.raises(ReadFault, match=f"layer {layer1} expert 5") as info:
            home.resolve(layer1, np.array([4, 5, 6]), np.zeros(3, bool))
        assert (info.value.layer, info.value.expert) == (layer1, 5)
        assert home.tier.faults[counter] == 1
        # the misses were taken back and the keys they evicted are gone: the pending writes
        # bring the device table in line before anything reads it
        table.apply(home.take_pending())
        assert np.array_equal(table.home, home.expected())
        assert table.home[bad] == ABSENT
        home.tier.source.reader = real
        ok = home.resolve(layer1, np.array(others), np.zeros(2, bool))  # the others go on
        table.apply(ok)
        assert ok.ram_reads == 2 and verify_home(home, 8, table.home, seed=1).is_ok
    home.tier.close()


def test_a_read_past_the_timeout_leaves_its_home_absent_until_it_lands(demo, good_store):
    home = make_home(good_store, demo, 16)
    home.tier.read_timeout_s = 0.2
    table = MockDeviceTable(home.tier.num_keys)
    layer = home.tier.source.moe_layers[2]
    real = home.tier.source.reader
    stall = StallingReader(real, [(2 * EXPERTS + 11) * RECORD + 4096])
    home.tier.source.reader = stall
    with pytest.raises(ReadFault, match=f"layer {layer} expert 11"):
        home.resolve(layer, np.array([20, 11]), np.zeros(2, bool))  # 20: a read of its own
    table.apply(home.take_pending())
    assert table.home[2 * EXPERTS + 11] == ABSENT  # its bytes are not trusted
    assert table.home[2 * EXPERTS + 20] == ABSENT  # read, but taken back with its wave
    assert np.array_equal(table.home, home.expected())
    with pytest.raises(ReadFault, match="has not finished"):  # still out: its request fails
        home.resolve(layer, np.array([11]), np.zeros(1, bool))
    table.apply(home.take_pending())
    stall.release()
    home.tier.source.reader = real
    for _ in range(100):  # the late read lands; the next resolve reaps it and reads afresh
        if all(stuck.finished() for stuck, _, _ in home.tier._stuck):
            break
    update = home.resolve(layer, np.array([11, 12]), np.zeros(2, bool))
    table.apply(update)
    assert table.home[2 * EXPERTS + 11] != ABSENT
    assert (
        bytes(home_bytes(home, int(table.home[2 * EXPERTS + 11])))
        == store_slot_bytes(good_store)[2 * EXPERTS + 11]
    )
    assert verify_home(home, 16, table.home, seed=2).is_ok
    home.tier.close()


def test_a_warm_started_tier_is_written_whole_into_the_table(demo, good_store):
    home = make_home(good_store, demo, 20)
    table = MockDeviceTable(home.tier.num_keys)
    keys = [150, 3, 77, 42, 5]
    assert home.tier.seed(keys)["seeded"] == 5
    update = home.sync_all()
    assert sorted(update.keys.tolist()) == sorted(keys)
    table.apply(update)
    assert np.array_equal(table.home, home.expected())
    want = store_slot_bytes(good_store)
    assert all(bytes(home_bytes(home, int(table.home[k]))) == want[k] for k in keys)
    home.tier.close()


def test_the_check_reports_a_wrong_table_entry_and_a_flipped_store_byte_by_layer_and_expert(
    demo, store
):
    home = make_home(store, demo, 32)
    table = MockDeviceTable(home.tier.num_keys)
    layer = home.tier.source.moe_layers[3]
    table.apply(home.resolve(layer, np.arange(8), np.zeros(8, bool)))
    assert verify_home(home, 64, table.home, seed=0).is_ok
    # a device entry naming another slot: table_bad, by layer and expert
    table.home[3 * EXPERTS + 2] = table.home[3 * EXPERTS + 4]
    result = verify_home(home, 64, table.home, seed=0)
    assert (result.table_bad, result.ram_bad) == (1, 0)
    (bad,) = result.bad
    assert (bad.tier, bad.layer, bad.expert) == ("table", layer, 2)
    assert "device table" in bad.problem
    table.home[3 * EXPERTS + 2] = home.home_of[3 * EXPERTS + 2]
    # a flipped byte of a resident record in the store file: ram_bad, the store named
    flip_byte(store / "experts.bin", (3 * EXPERTS + 6) * RECORD + 99)
    result = verify_home(home, 64, table.home, seed=0)
    assert result.table_bad == 0 and result.ram_bad == 1
    (bad,) = result.bad
    assert (bad.tier, bad.layer, bad.expert) == ("ram", layer, 6)
    assert "store record's sha256 no longer matches" in bad.problem
    # and a flipped byte of the RAM copy itself
    flip_byte(store / "experts.bin", (3 * EXPERTS + 6) * RECORD + 99)
    addr = int(table.home[3 * EXPERTS + 1])
    home.tier.arena[addr - home.arena_address + 7] ^= 1
    result = verify_home(home, 64, table.home, seed=0)
    (bad,) = result.bad
    assert (bad.tier, bad.expert, result.ram_bad) == ("ram", 1, 1)
    assert "RAM copy differs" in bad.problem
    home.tier.close()


def test_resolved_homes_match_the_manifest_sha256(demo, good_store):
    home = make_home(good_store, demo, 8)
    layer = home.tier.source.moe_layers[5]
    table = MockDeviceTable(home.tier.num_keys)
    table.apply(home.resolve(layer, np.array([0, 31, 16]), np.zeros(3, bool)))
    for e in (0, 31, 16):
        addr = int(table.home[5 * EXPERTS + e])
        record = home.tier.arena[addr - home.arena_address :][:RECORD]
        assert hashlib.sha256(record).hexdigest() == home.tier.source.record_sha256(layer, e)
    home.tier.close()


# --- refusals before anything loads ------------------------------------------------------------


def test_nvme_exact_needs_a_store_of_this_checkpoint(demo, good_store, tmp_path):
    with pytest.raises(TierError, match="pass --store DIR"):
        open_home_source(demo, None, None, rows=2048)
    other = make_checkpoint(tmp_path / "other")
    with pytest.raises(StoreMismatchError):
        open_home_source(other, good_store, None, rows=2048)
    store, working_set, top_k = open_home_source(demo, good_store, 32 * RECORD, rows=2048)
    assert (working_set, top_k) == (EXPERTS, TOP_K)
    store.close()


def test_a_cap_below_one_layer_s_working_set_is_refused_with_the_numbers(demo, good_store):
    # the GPU engine's largest forward is the prefill chunk: a whole layer's experts
    with pytest.raises(HomeCapError, match=r"holds 31 expert records.*32 records"):
        open_home_source(demo, good_store, 31 * RECORD, rows=2048)
    assert layer_working_set(TOP_K, 2, EXPERTS) == 8
    check_home_cap(8 * RECORD, RECORD, 8, TOP_K, 2)
    with pytest.raises(HomeCapError, match="raise --ram-cap to at least"):
        check_home_cap(8 * RECORD - 1, RECORD, 8, TOP_K, 2)


def test_the_home_refuses_a_source_that_is_not_a_store(demo):
    source = SafetensorsSource(Checkpoint(demo))
    tier = RamTier(source, 8 * RECORD)
    with pytest.raises(TierError, match="not one: pass --store"):
        RamHome(tier, tier.arena.ctypes.data, ABSENT)
    tier.close()


# --- through `glm53 serve` (no GPU needed: the refusals come before anything loads) -----------


def serve_nvme_exact(model, store, tmp_path, *extra, mode="nvme-exact") -> Server:
    args = ["--model", str(model), "--engine", "gpu", "--mode", mode]
    args += ["--store", str(store), *extra]
    return Server(args, log_path=tmp_path / "server.log")


@pytest.mark.parametrize("mode", ["nvme-exact", "nvme"])
def test_serve_refuses_another_checkpoint_s_store_before_loading(good_store, tmp_path, mode):
    other = make_checkpoint(tmp_path / "other")
    server = serve_nvme_exact(other, good_store, tmp_path, mode=mode)  # no flag: both are served
    with pytest.raises(RuntimeError, match="exited with"):
        server.wait_ready(timeout_s=120)
    log = server.log()
    assert "was packed from another checkpoint" in log, log
    assert "exllamav3 is not installed" not in log  # refused before the GPU stack is needed


def test_serve_refuses_a_ram_cap_below_one_layer_before_loading(demo, good_store, tmp_path):
    server = serve_nvme_exact(demo, good_store, tmp_path, "--ram-cap", str(31 * RECORD))
    with pytest.raises(RuntimeError, match="exited with"):
        server.wait_ready(timeout_s=120)
    log = server.log()
    assert "nvme-exact on the GPU needs one MoE layer's picks resident at once" in log, log
    assert "raise --ram-cap to at least" in log


def test_rows_picking_finds_the_rows_whose_top_k_holds_the_expert():
    from glm53.tiers.gpu_home import rows_picking

    picks = np.array([[4, 1], [2, 3], [9, 4], [4, 4]])
    assert rows_picking(picks, 4, 4).tolist() == [0, 2, 3]
    assert rows_picking(picks.reshape(-1), 4, 3).tolist() == [1]
    assert rows_picking(picks, 4, 7).tolist() == []


def test_a_read_fault_lists_at_most_eight_of_the_rows_that_picked_it():
    fault = ReadFault("a read error for layer 3 expert 5: EIO", 3, 5)
    one = fault.picked_by([6], 9)
    assert (str(one), one.layer, one.expert, one.rows) == (
        "a read error for layer 3 expert 5: EIO; picked by row 6 of this forward's 9",
        3,
        5,
        (6,),
    )
    many = fault.picked_by(range(10), 2048)
    assert str(many) == (
        "a read error for layer 3 expert 5: EIO; picked by 10 rows (0, 1, 2, 3, 4, 5, 6, 7, ...) "
        "of this forward's 2048"
    )
    assert many.rows == tuple(range(10))
