"""The device-side expert cache (cuda/ec.cu) against a Python model of the same policy
(CLOCK, with or without the frequency admission filter): same slots, same victims, same
counters, and every table entry pointing at a byte-exact copy of its expert after every step."""

import numpy as np
import pytest
import torch

_cuda = pytest.importorskip("glm53._cuda")

from glm53.tiers.vram_cache import CacheGeometry, DeviceExpertCache  # noqa: E402


class ClockModel:
    def __init__(self, n_slots, n_keys=4096, window=0):
        self.n = n_slots
        self.slot_key = [-1] * n_slots
        self.key_slot = {}
        self.ref = [0] * n_slots
        self.stamp = [0] * n_slots
        self.hand = self.cur = self.used = 0
        self.window, self.events, self.freq = window, 0, [0] * n_keys
        self.c = dict(hits=0, misses=0, admits=0, evictions=0, pinned_skips=0, rejected=0)

    def route(self, keys, admit=True):
        self.cur += 1
        uniq = list(dict.fromkeys(keys))
        misses = []
        for k in uniq:
            if self.window:
                self.freq[k] += 1
            s = self.key_slot.get(k)
            if s is None:
                misses.append(k)
            else:
                self.ref[s] = 1
                self.stamp[s] = self.cur
        self.c["hits"] += len(uniq) - len(misses)
        self.c["misses"] += len(misses)
        if self.window:
            self.events += len(uniq)
            if self.events >= self.window:
                self.freq = [f >> 1 for f in self.freq]
                self.events >>= 1
        if not admit:
            return
        for k in misses:
            took_free = self.used < self.n
            if took_free:
                v = self.slot_key.index(-1)
                self.used += 1
            else:
                while True:
                    s = self.hand
                    self.hand = (self.hand + 1) % self.n
                    if self.stamp[s] == self.cur:
                        self.c["pinned_skips"] += 1
                    elif self.ref[s]:
                        self.ref[s] = 0
                    else:
                        v = s
                        break
            old = self.slot_key[v]
            if self.window and not took_free and self.freq[k] <= self.freq[old]:
                self.c["rejected"] += 1
                continue
            if old >= 0:
                del self.key_slot[old]
                self.c["evictions"] += 1
            self.slot_key[v] = k
            self.key_slot[k] = v
            self.ref[v] = 0
            self.stamp[v] = self.cur
            self.c["admits"] += 1


def make_setup(n_layers, n_experts, parts, n_slots, seed=0, freq_window=0):
    geo = CacheGeometry(n_layers, n_experts, parts)
    rb = geo.record_bytes
    g = torch.Generator().manual_seed(seed)
    home = torch.randint(0, 256, (geo.n_keys * rb,), dtype=torch.uint8, generator=g).pin_memory()
    base = _cuda.host_device_pointer(home.data_ptr())
    home_addr = base + np.arange(geo.n_keys, dtype=np.int64) * rb
    tables = torch.empty((n_layers, 3, n_experts), dtype=torch.int64, device="cuda")
    for p, off in enumerate(geo.part_off):
        tables[:, p, :] = torch.from_numpy(home_addr.reshape(n_layers, n_experts) + off).cuda()
    addrs = [tables[layer, p].data_ptr() for layer in range(n_layers) for p in range(3)]
    cache = DeviceExpertCache(geo, n_slots, home_addr, addrs, "cuda", freq_window=freq_window)
    return geo, home, home_addr, tables, cache


def check_tables(geo, home, home_addr, tables, cache, model):
    torch.cuda.synchronize()
    slots = cache._t["slots"]
    assert cache.slot_keys().tolist() == model.slot_key
    slot_base = slots.data_ptr()
    t = tables.cpu().numpy()
    for key in range(geo.n_keys):
        layer, e = divmod(key, geo.n_experts)
        s = model.key_slot.get(key)
        base = slot_base + s * geo.record_bytes if s is not None else home_addr[key]
        assert [t[layer, p, e] for p in range(3)] == [base + o for o in geo.part_off]
    rb = geo.record_bytes
    for s, key in enumerate(model.slot_key):
        if key >= 0:
            got = slots[s * rb : (s + 1) * rb].cpu()
            assert torch.equal(got, home[key * rb : (key + 1) * rb])


@pytest.mark.parametrize("n_slots", [5, 37, 100])
@pytest.mark.parametrize("freq_window", [0, 40, None])  # off, halving often, the default
def test_device_clock_matches_model(n_slots, freq_window):
    geo, home, home_addr, tables, cache = make_setup(
        4, 24, (1024, 1024, 2048), n_slots, freq_window=freq_window
    )
    model = ClockModel(n_slots, geo.n_keys, cache.freq_window)
    rng = np.random.default_rng(n_slots)
    popularity = rng.dirichlet(np.full(geo.n_experts, 0.3), size=geo.n_layers)
    for step in range(300):
        layer = step % geo.n_layers
        rows = int(rng.integers(1, 5))
        picks = np.stack([
            rng.choice(geo.n_experts, size=4, replace=False, p=popularity[layer]) for _ in range(rows)
        ])  # fmt: skip
        if n_slots == 5:
            picks = picks[:1]  # never more unique picks than slots
        sel = torch.from_numpy(picks.astype(np.int64)).cuda()
        cache.route(layer, sel, admit=True)
        model.route([layer * geo.n_experts + int(e) for e in picks.reshape(-1)])
        if step % 25 == 0 or step == 299:
            check_tables(geo, home, home_addr, tables, cache, model)
    st = cache.state()
    for k, v in model.c.items():
        assert st[k] == v, k
    assert st["no_victim"] == 0
    assert st["bytes_copied"] == model.c["admits"] * geo.record_bytes
    if cache.freq_window:
        assert cache.key_freq().tolist() == model.freq


def test_filter_keeps_the_hot_set_against_one_off_misses():
    geo, home, home_addr, tables, cache = make_setup(1, 64, (512, 512, 1024), 4, freq_window=1000)
    hot = torch.arange(4, dtype=torch.int64, device="cuda")
    for _ in range(3):
        cache.route(0, hot)
    for e in range(4, 64):  # every cold expert once: colder than any resident
        cache.route(0, torch.tensor([e], dtype=torch.int64, device="cuda"))
    st = cache.state()
    assert (st["admits"], st["evictions"], st["rejected"]) == (4, 0, 60)
    assert sorted(cache.slot_keys().tolist()) == [0, 1, 2, 3]
    # an expert that turns hot gets in once it has been looked up more often than a victim
    for _ in range(4):
        cache.route(0, torch.tensor([40], dtype=torch.int64, device="cuda"))
    assert 40 in cache.slot_keys().tolist()
    assert cache.heat_list()[0] == 40  # 5 lookups against the residents' 3


def test_count_only_route_leaves_tables_alone():
    geo, home, home_addr, tables, cache = make_setup(2, 16, (512, 512, 1024), 8)
    before = tables.clone()
    cache.route(1, torch.arange(8, dtype=torch.int64, device="cuda"), admit=False)
    torch.cuda.synchronize()
    assert torch.equal(before, tables)
    st = cache.state()
    assert (st["hits"], st["misses"], st["admits"]) == (0, 8, 0)


def test_all_slots_pinned_leaves_misses_zero_copy():
    geo, home, home_addr, tables, cache = make_setup(1, 32, (512, 512, 1024), 4)
    model = ClockModel(4)
    sel = torch.arange(10, dtype=torch.int64, device="cuda")  # 10 unique picks, 4 slots
    cache.route(0, sel, admit=True)
    torch.cuda.synchronize()
    st = cache.state()
    assert st["admits"] == 4 and st["no_victim"] == 6
    model.route(list(range(4)))
    check_tables(geo, home, home_addr, tables, cache, model)


def test_masked_and_out_of_range_picks_are_skipped():
    geo, home, home_addr, tables, cache = make_setup(1, 8, (512, 512, 1024), 4)
    cache.route(0, torch.tensor([-1, 3, 99, 3], dtype=torch.int64, device="cuda"))
    st = cache.state()
    assert (st["misses"], st["admits"]) == (1, 1)


def test_seed_fills_slots_in_priority_order():
    geo, home, home_addr, tables, cache = make_setup(2, 8, (512, 512, 1024), 4)
    assert cache.seed([9, 3, 12]) == 3  # hottest first
    assert cache.heat_list() == [9, 3, 12]  # what save_heat writes round-trips
    model = ClockModel(4)
    model.slot_key[:3] = [12, 3, 9]  # hottest in the highest seeded slot, as glm53._clock
    model.key_slot = {12: 0, 3: 1, 9: 2}
    model.used = 3
    check_tables(geo, home, home_addr, tables, cache, model)


def test_seed_gives_the_filter_counts_in_heat_order():
    geo, home, home_addr, tables, cache = make_setup(2, 8, (512, 512, 1024), 4, freq_window=None)
    assert cache.seed([9, 3, 12]) == 3
    freq = cache.key_freq()
    assert (freq[12], freq[3], freq[9]) == (1, 4, 8)  # coldest 1 .. hottest 8
    assert cache.heat_list() == [9, 3, 12]


@pytest.mark.parametrize("forget", [False, True])
def test_empty_sends_every_key_home_and_the_cache_fills_again(forget):
    """DeviceExpertCache.empty: nvme's flush after a poisoned step (forget False: the counters
    and the filter's counts stay) and the engine's after exllamav3's warm-up (forget True)."""
    geo, home, home_addr, tables, cache = make_setup(2, 16, (512, 512, 1024), 6, freq_window=None)
    for _ in range(3):
        cache.route(0, torch.arange(4, dtype=torch.int64, device="cuda"))
    before, freq = cache.state(), int(cache.key_freq().max())
    assert before["used"] == 4 and freq == 3
    cache.empty(forget)
    model = ClockModel(6, geo.n_keys, cache.freq_window)
    check_tables(geo, home, home_addr, tables, cache, model)  # every entry home, every slot free
    st = cache.state()
    assert st["used"] == 0 and st["hand"] == 0
    assert st["hits"] == (0 if forget else before["hits"])
    assert int(cache.key_freq().max()) == (0 if forget else freq)
    assert cache.seed([5, 6]) == 2  # seed needs an empty cache: it takes one now
    cache.route(1, torch.tensor([1, 2], dtype=torch.int64, device="cuda"))
    assert cache.state()["admits"] == (2 if forget else before["admits"] + 2)


def test_too_many_picks_is_a_clear_error():
    geo, home, home_addr, tables, cache = make_setup(1, 8, (512, 512, 1024), 4)
    with pytest.raises(ValueError, match="exceed the cache's limit"):
        cache.route(0, torch.zeros(_cuda.MAX_PICKS + 1, dtype=torch.int64, device="cuda"))


def test_stage_and_unstage_keep_every_entry_on_a_valid_copy():
    """The gather path (an SM copy kernel of the uncached experts, as many as fit)."""
    from glm53.tiers.vram_cache import PrefillStager

    geo, home, home_addr, tables, cache = make_setup(3, 16, (512, 512, 1024), 6)
    cache.route(1, torch.tensor([2, 5, 7], dtype=torch.int64, device="cuda"))  # 3 cached
    stager = PrefillStager(cache, buf_slots=10, min_rows=1, dma=False)
    assert not stager.dma
    for layer in range(3):
        stager.on_layer(layer)
    torch.cuda.synchronize()
    rb, t = geo.record_bytes, tables.cpu().numpy()
    cached = {1 * 16 + e for e in (2, 5, 7)}
    for key in range(geo.n_keys):
        layer, e = divmod(key, 16)
        addr = int(t[layer, 0, e])
        blob = _read(addr, rb)
        assert torch.equal(blob, home[key * rb : (key + 1) * rb]), key
        in_buf = any(b.data_ptr() <= addr < b.data_ptr() + b.numel() for b in stager.bufs)
        if key in cached:
            assert not in_buf
        elif layer == 1:  # 13 uncached, 10 staged, 3 left at home
            assert in_buf == (
                e not in (2, 5, 7) and sorted(set(range(16)) - {2, 5, 7}).index(e) < 10
            )
    for layer in range(3):
        _cuda.ec_unstage(cache._ptr, layer, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    model = ClockModel(6)
    model.route([16 + 2, 16 + 5, 16 + 7])
    check_tables(geo, home, home_addr, tables, cache, model)


@pytest.mark.parametrize("buf_slots", [16, 9], ids=["whole-layer", "range"])
def test_copy_engine_staging_copies_the_first_records_and_points_only_those_uncached(buf_slots):
    """One copy-engine transfer per layer of its first buf_slots records (all 16: the whole
    layer); the uncached experts among them point into the buffer, the rest of the layer stays
    where it was, and a buffer's previous layer goes back home before it is reused."""
    from glm53.tiers.vram_cache import PrefillStager

    geo, home, home_addr, tables, cache = make_setup(3, 16, (512, 512, 1024), 6)
    cache.route(1, torch.tensor([2, 5, 12], dtype=torch.int64, device="cuda"))  # 3 cached
    stager = PrefillStager(cache, buf_slots=buf_slots, min_rows=1)
    assert stager.dma and stager.dma_count == buf_slots
    assert stager.whole_layer == (buf_slots == 16)
    for layer in range(3):  # layer 2 reuses buffer 0: layer 0 is unstaged first
        stager.on_layer(layer)
    torch.cuda.synchronize()
    rb, t = geo.record_bytes, tables.cpu().numpy()
    cached = {16 + e for e in (2, 5, 12)}
    for key in range(geo.n_keys):
        layer, e = divmod(key, 16)
        for p in range(3):
            addr = int(t[layer, p, e])
            assert torch.equal(
                _read(addr, geo.part_bytes[p]),
                home[key * rb + geo.part_off[p] : key * rb + geo.part_off[p] + geo.part_bytes[p]],
            ), (key, p)
        addr = int(t[layer, 0, e])
        if key in cached:
            assert addr == cache._t["slots"].data_ptr() + cache.slot_keys().tolist().index(key) * rb
        elif layer == 0 or e >= buf_slots:  # unstaged, or beyond the copied range: at home
            assert addr == home_addr[key]
        else:
            assert addr == stager.bufs[layer % 2].data_ptr() + e * rb
    assert stager.stages == 3


def test_staging_gathers_when_asked_or_when_homes_are_not_contiguous():
    from glm53.tiers.vram_cache import PrefillStager

    geo, home, home_addr, tables, cache = make_setup(2, 16, (512, 512, 1024), 4)
    assert PrefillStager(cache, buf_slots=15, min_rows=1).dma
    assert not PrefillStager(cache, buf_slots=15, min_rows=1, dma=False).dma
    assert PrefillStager(cache, buf_slots=16, min_rows=1).whole_layer
    # the same records, listed in reverse within each layer: no longer one ascending arena
    rev = np.ascontiguousarray(home_addr.reshape(2, 16)[:, ::-1]).reshape(-1)
    tables2 = torch.empty((2, 3, 16), dtype=torch.int64, device="cuda")
    for p, off in enumerate(geo.part_off):
        tables2[:, p, :] = torch.from_numpy(rev.reshape(2, 16) + off).cuda()
    addrs = [tables2[layer, p].data_ptr() for layer in range(2) for p in range(3)]
    cache2 = DeviceExpertCache(geo, 4, rev, addrs, "cuda", freq_window=0)
    assert not PrefillStager(cache2, buf_slots=16, min_rows=1).dma
    with pytest.raises(ValueError, match="contiguous arena"):
        PrefillStager(cache2, buf_slots=16, min_rows=1, dma=True)


def test_staging_loan_moves_the_buffers_between_clock_and_the_stager():
    """--ec-stage-loan (vram_cache.StagingLoan): the buffers are the cache's last 2 x buf_slots
    slots. They start as the stager's (a seed fills only CLOCK's slots), go to CLOCK after
    LOAN_AFTER_DECODE_STEPS decode forwards in a row (decode then admits into them), and come
    back before a prefill chunk stages (their keys home); every entry points at a byte-exact
    copy of its expert throughout."""
    from glm53.tiers.vram_cache import LOAN_AFTER_DECODE_STEPS, PrefillStager

    geo, home, home_addr, tables, cache = make_setup(3, 16, (512, 512, 1024), 4 + 2 * 5)
    stager = PrefillStager(cache, buf_slots=5, min_rows=1, loan=True)
    loan, rb = stager.loan, geo.record_bytes
    tail = cache._t["slots"].data_ptr() + 4 * rb
    assert [b.data_ptr() for b in stager.bufs] == [tail, tail + 5 * rb]
    assert not loan.with_cache and cache.seed(list(range(20))) == 4  # CLOCK's 4 slots only

    def valid():
        torch.cuda.synchronize()
        t = tables.cpu().numpy()
        for key in range(geo.n_keys):
            layer, e = divmod(key, 16)
            for p in range(3):
                lo = key * rb + geo.part_off[p]
                got = _read(int(t[layer, p, e]), geo.part_bytes[p])
                assert torch.equal(got, home[lo : lo + geo.part_bytes[p]]), (key, p)

    for layer in range(3):  # a prefill chunk stages through the buffers
        stager.on_layer(layer)
    valid()
    rng = np.random.default_rng(1)
    for step in range(LOAN_AFTER_DECODE_STEPS + 6):
        loan.decode()
        for layer in range(3):
            cache.route(layer, torch.from_numpy(rng.choice(16, 4, replace=False)).cuda())
        assert loan.with_cache == (step + 1 >= LOAN_AFTER_DECODE_STEPS)
    keys = cache.slot_keys()
    assert (keys[4:] >= 0).sum() > 0, "decode admitted nothing into the lent buffers"
    valid()
    stager.on_layer(0)  # the next prefill takes the buffers back: their keys go home
    assert not loan.with_cache and (cache.slot_keys()[4:] < 0).all()
    stager.on_layer(1)
    stager.on_layer(2)
    valid()
    assert loan.stats() == {
        "stage_loan_slots": 10, "stage_loan_with_cache": False, "stage_loans": 1,
        "stage_recalls": 1,
    }  # fmt: skip
    for _ in range(LOAN_AFTER_DECODE_STEPS - 1):  # a decode step between two chunks: kept
        loan.decode()
        stager.on_layer(0)
    assert loan.stats()["stage_loans"] == 1


def _read(addr, nbytes):
    from glm53.tiers.vram_cache import _uva_tensor

    return _uva_tensor(addr, nbytes, "cuda").cpu()
