"""glm53.exl3.nvme_device (nvme-exact's device glue) on the CPU: the real RAM tier over a real
store and real O_DIRECT reads, with the GPU played by named mocks: `MockExpertCache` (the
device cache's tensors on the CPU, recording route calls) and `MockCudaLib` (glm53._cuda's
launchers, recording their calls). What it checks is the glue's own logic (which picks reach the
host, what is written into the home table, which launches run in which order); the kernels
themselves run only on a GPU (tests/gpu/test_nvme_exact_gpu.py)."""

import sys
import types

import numpy as np
import pytest
import torch

import glm53
from glm53.models.checkpoint import Checkpoint
from glm53.store.reader import ExpertStore
from glm53.tiers.ram_tier import RamTier, ReadFault, TierError
from glm53.tiers.vram_cache import CacheGeometry

RECORD, EXPERTS, LAYERS = 77_824, 32, 6
POISON = 0x7F00_0000_0000


class MockCudaLib(types.ModuleType):
    """Stands in for glm53._cuda: records launches; host memory needs no registration here."""

    MAX_PICKS = 512

    def __init__(self):
        super().__init__("glm53._cuda")
        self.calls = []

    def host_register(self, ptr, nbytes):
        self.calls.append(("register", nbytes))

    def host_unregister(self, ptr):
        self.calls.append(("unregister",))

    def host_device_pointer(self, ptr):
        return ptr  # UVA: the same address

    # the real launchers refuse a null pointer as EINVAL (glm53._cuda raises), whatever the
    # count: an empty torch tensor's data_ptr() is 0, so the glue must not launch for none
    # (2026-12-05, H200: a staged layer whose stage covered every pick failed its request)
    def ec_check_homes(self, ec, sel, n, layer, absent, bad, stream):
        _refuse_null(sel, f"home check of MoE layer {layer}")
        self.calls.append(("check_homes", layer, _read_i64(sel, n)))

    def ec_point_picks(self, ec, sel, n, layer, absent, stream):
        _refuse_null(sel, f"pointing MoE layer {layer}'s picks at their homes")
        self.calls.append(("point_picks", layer, _read_i64(sel, n)))


def _refuse_null(ptr, what):
    if not ptr:
        raise RuntimeError(f"{what} failed: invalid argument (code -1)")


def _read_i64(addr, n):
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * n).from_address(addr)).tolist()


class MockExpertCache:
    """The device cache's tensors on the CPU; `route` records (the route kernel is not run)."""

    def __init__(self, geo: CacheGeometry, slots: int, calls: list):
        from glm53.tiers.vram_cache import EC_FIELDS

        self.geo, self.n_slots, self.device, self.calls = geo, slots, torch.device("cpu"), calls
        self._t = {
            "key_slot": torch.full((geo.n_keys,), -1, dtype=torch.int32),
            "slot_key": torch.full((slots,), -1, dtype=torch.int32),
            "slot_ref": torch.zeros(slots, dtype=torch.uint8),
            "home": torch.full((geo.n_keys,), POISON, dtype=torch.int64),
            "slots": torch.zeros(slots * geo.record_bytes, dtype=torch.uint8),
        }
        self._dtype = np.dtype(
            [(n, f, (c,)) if c > 1 else (n, f) for n, f, c in EC_FIELDS], align=True
        )
        self._struct = torch.full((self._dtype.itemsize,), 7, dtype=torch.uint8)
        self._ptr = 1

    def route(self, layer, selected, admit=True):
        self.calls.append(("route", layer, selected.tolist()))

    def reset_tables(self):
        self.calls.append(("reset_tables",))

    def empty(self, forget=False):  # the real one: tests/gpu/test_expert_cache.py
        self.calls.append(("empty", forget))

    def slot_keys(self):
        return self._t["slot_key"].numpy()

    def seed(self, keys):
        self.calls.append(("seed", list(keys)))
        return len(keys)


def mock_nvme_home(demo, store_dir, monkeypatch, ram_slots: int, reader=None):
    """nvme-exact's device glue (glm53.exl3.nvme_device.NvmeHome) over a real RAM tier of
    `ram_slots` records on the real store at `store_dir`, with the device as named mocks
    (MockCudaLib, MockExpertCache of 8 VRAM slots); `reader` wraps the store's reader. Returns
    (home, ec, lib); the caller closes home."""
    from glm53.exl3 import nvme_device

    lib = MockCudaLib()
    monkeypatch.setitem(sys.modules, "glm53._cuda", lib)
    monkeypatch.setattr(glm53, "_cuda", lib, raising=False)  # once imported, the package has it
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    store = ExpertStore(store_dir, Checkpoint(demo))
    if reader is not None:
        store.reader = reader(store.reader)
    geo = CacheGeometry(LAYERS, EXPERTS, tuple(store.manifest.trellis_bytes))
    ec = MockExpertCache(geo, 8, lib.calls)
    home = nvme_device.NvmeHome(ec, RamTier(store, ram_slots * RECORD), POISON, "cpu")
    return home, ec, lib


@pytest.fixture
def glue(demo, good_store, monkeypatch):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 40)
    yield home, ec, lib
    home.close()


def test_a_decode_layer_reads_its_misses_writes_their_homes_then_checks_routes_and_points(glue):
    home, ec, lib = glue
    ec._t["key_slot"][2 * EXPERTS + 7] = 3  # the VRAM cache holds layer 2's expert 7
    selected = torch.tensor([[7, 1], [30, 1]], dtype=torch.int64)
    home.route(2, selected, decode=True, params={})
    layer = home.tier.source.moe_layers[2]
    assert home.tier.clock.contains(2 * EXPERTS + 1) and home.tier.clock.contains(2 * EXPERTS + 30)
    assert not home.tier.clock.contains(2 * EXPERTS + 7)  # in VRAM: not read
    table = ec._t["home"].numpy()
    for e in (1, 30):
        slot = home.tier.clock.slot_of(2 * EXPERTS + e)
        assert table[2 * EXPERTS + e] == home.tier.arena.ctypes.data + slot * RECORD
    assert table[2 * EXPERTS + 7] == POISON
    launches = [c[0] for c in lib.calls if c[0] != "register"]
    assert launches == ["check_homes", "route", "point_picks"]
    assert lib.calls[-1] == ("point_picks", 2, [7, 1, 30, 1])  # every pick, as exllamav3 has it
    assert home.stats()["ram_reads"] == 2 and layer in home.tier.source.moe_layers


def test_a_prefill_layer_points_its_distinct_picks_and_admits_nothing(glue):
    home, ec, lib = glue
    home.route(0, torch.tensor([[5, 3]] * 20, dtype=torch.int64), decode=False, params={})
    assert [c for c in lib.calls if c[0] == "route"] == []
    assert lib.calls[-1] == ("point_picks", 0, [3, 5])
    home.route(1, torch.zeros((1, 2), dtype=torch.int64), False, {"activate_all_experts": True})
    assert lib.calls[-1] == ("point_picks", 1, list(range(EXPERTS)))
    assert all(home.tier.clock.contains(EXPERTS + e) for e in range(EXPERTS))


def test_a_read_fault_writes_the_evictions_it_made_before_it_propagates(glue):
    import errno

    from store_kit import FailingReader

    home, ec, lib = glue
    home.route(0, torch.arange(32, dtype=torch.int64).view(8, 4), False, {})  # 32 of 40 slots
    real = home.tier.source.reader
    home.tier.source.reader = FailingReader(real, [(EXPERTS + 9) * RECORD + 4096], errno.EIO)
    with pytest.raises(ReadFault, match="expert 9") as info:
        home.route(1, torch.arange(16, dtype=torch.int64).view(4, 4), False, {})
    home.tier.source.reader = real
    layer = home.tier.source.moe_layers[1]
    assert (info.value.layer, info.value.expert, info.value.rows) == (layer, 9, (2,))
    assert str(info.value).endswith("; picked by row 2 of this forward's 4")
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())


def test_a_read_fault_names_every_row_whose_picks_needed_the_record(glue):
    import errno

    from store_kit import FailingReader

    home, ec, lib = glue
    real = home.tier.source.reader
    home.tier.source.reader = FailingReader(real, [(2 * EXPERTS + 4) * RECORD], errno.EIO)
    selected = torch.tensor([[4, 1], [2, 3], [9, 4]], dtype=torch.int64)  # rows 0 and 2 pick 4
    with pytest.raises(ReadFault) as info:
        home.route(2, selected, decode=True, params={})
    home.tier.source.reader = real
    layer = home.tier.source.moe_layers[2]
    assert (info.value.layer, info.value.expert, info.value.rows) == (layer, 4, (0, 2))
    # experts 1-4 are neighbours in the file: one read of 4 records, from expert 1's offset
    offset, run = (2 * EXPERTS + 4) * RECORD, (2 * EXPERTS + 1) * RECORD
    data = home.tier.source.data_path
    assert str(info.value) == (
        f"a read error for layer {layer} expert 4: reading layer {layer} expert 4 from the store "
        f"failed at offset {offset} of {data}: read of {4 * RECORD} bytes at offset {run} of "
        f"{data} failed at offset {offset}: Input/output error; picked by 2 rows (0, 2) of this "
        "forward's 3"
    )


def test_table_bad_fails_the_step_once_and_flushes_the_vram_cache(glue):
    home, ec, lib = glue
    home.check_table_bad()  # nothing counted: nothing happens
    ec._t["key_slot"][5] = 2
    home.bad += 3
    with pytest.raises(TierError, match="3 expert picks of this step found neither"):
        home.check_table_bad()
    assert lib.calls[-1] == ("empty", False)  # every slot emptied, the counters kept
    home.check_table_bad()  # counted once
    assert home.stats()["table_bad"] == 3


def test_warm_start_seeds_ram_then_only_the_vram_keys_now_in_ram_and_the_check_is_clean(glue):
    home, ec, lib = glue
    out = home.warm_start([40, 3, 100], [3, 150, 40])
    assert out["seeded"] == 3
    assert ("seed", [3, 40]) in lib.calls  # 150 has no home: not seeded into VRAM
    assert np.array_equal(ec._t["home"].numpy(), home.home.expected())
    result = home.verify(16, seed=0)
    assert result.is_ok, result.summary()
    assert result.table_checked == 40 + LAYERS * EXPERTS
