"""The tier check (glm53.tiers.check): RAM-tier records against fresh O_DIRECT reads of the
store and the manifest's sha256, and the slot tables, on the CPU engine over a packed store of
the demo checkpoint. In process first (the damage is placed exactly), then through the real
server: GET /admin/verify, /stats, and a refusal to serve at start."""

import shutil

import httpx
import numpy as np
import pytest
from serving_kit import Server
from store_kit import direct_dir, flip_byte

from glm53.engine.base import StreamWork
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions
from glm53.store.reader import ExpertStore
from glm53.tiers.check import BadRecord, TierCheck, check_tiers, check_vram
from glm53.tiers.expert_source import record_views

PROMPT_IDS = list(range(5, 37))
RECORD = 77_824  # demo record bytes
NUM_RECORDS = 192  # 6 MoE layers x 32 experts


@pytest.fixture(scope="module")
def served_store(good_store, tmp_path_factory):
    """The in-process engine's store copy: tests that damage it undo the damage."""
    dst = direct_dir(tmp_path_factory.mktemp("check-served")) / "store"
    shutil.copytree(good_store, dst)
    yield dst
    shutil.rmtree(dst, ignore_errors=True)


@pytest.fixture(scope="module")
def started(demo, served_store):
    """(an engine with room for 40 records over the store, the tier check it ran at start)."""
    engine = CpuEngine(
        demo, CpuEngineOptions(max_batch=1, cpu_threads=1, ram_cap=40 * RECORD, store=served_store)
    )
    engine.load()
    yield engine, engine.tier_check
    engine.close()


@pytest.fixture
def engine(started):
    """The engine, cold, after one prefill: records resident."""
    engine = started[0]
    engine.release(0)
    engine.tier.clock.clear()
    engine.step([StreamWork(0, PROMPT_IDS, 0, True)])
    return engine


def resident(engine) -> list[tuple[int, int, int]]:
    """(layer, expert, slot) of every resident RAM-tier record."""
    tier, out = engine.tier, []
    for slot in range(tier.num_slots):
        key = tier.clock.key_of(slot)
        if key >= 0:
            layer = tier.source.moe_layers[key // tier.num_experts]
            out.append((layer, key % tier.num_experts, slot))
    return out


def test_a_clean_engine_checks_every_sampled_record_with_nothing_bad(started, engine):
    at_start = started[1]
    assert at_start.counts() == {"ram_bad": 0, "vram_bad": 0, "table_bad": 0}
    # at start nothing was resident: the 64 samples were store-only reads
    assert (at_start.ram_checked, at_start.ram_resident_checked) == (64, 0)
    result = engine.verify_tiers(NUM_RECORDS)
    num_resident = len(resident(engine))
    assert 0 < num_resident <= 40
    assert (result.ram_bad, result.vram_bad, result.table_bad, result.bad) == (0, 0, 0, [])
    assert (result.ram_checked, result.ram_resident_checked) == (NUM_RECORDS, num_resident)
    assert (result.table_checked, result.has_manifest) == (40, True)
    assert engine.stats()["tiers"]["check"] == {
        "ram_bad": 0,
        "vram_bad": 0,
        "table_bad": 0,
        "ram_checked": NUM_RECORDS,
        "table_checked": 40,
    }


def test_a_flipped_byte_in_the_ram_copy_is_reported_by_layer_and_expert(engine):
    layer, expert, slot = resident(engine)[3]
    engine.tier.record(slot)[1000] ^= 0x40
    result = engine.verify_tiers(NUM_RECORDS)
    assert result.counts() == {"ram_bad": 1, "vram_bad": 0, "table_bad": 0}
    assert result.bad == [
        BadRecord(
            "ram",
            layer,
            expert,
            slot,
            "the RAM copy differs from the store record (which matches the manifest)",
        )
    ]


def test_a_flipped_store_byte_is_reported_for_resident_and_cold_records(engine, served_store):
    data = served_store / "experts.bin"
    source = engine.tier.source
    layer, expert, slot = resident(engine)[0]
    cold = next(k for k in range(engine.tier.num_keys) if not engine.tier.clock.contains(k))
    cold_layer, cold_expert = source.moe_layers[cold // 32], cold % 32
    flips = [
        source.record_index(layer, expert) * RECORD + 77,
        source.record_index(cold_layer, cold_expert) * RECORD + 5000,
    ]
    for offset in flips:
        flip_byte(data, offset)
    try:
        result = engine.verify_tiers(NUM_RECORDS)
    finally:
        for offset in flips:
            flip_byte(data, offset)  # flipped back: the store is whole again
    changed = (
        "the store record's sha256 no longer matches the manifest (the RAM copy still does): "
        "the store file changed"
    )
    assert result.counts() == {"ram_bad": 2, "vram_bad": 0, "table_bad": 0}
    assert sorted(result.bad, key=lambda b: b.slot) == [
        BadRecord("ram", cold_layer, cold_expert, -1, changed),
        BadRecord("ram", layer, expert, slot, changed),
    ]
    assert engine.verify_tiers(NUM_RECORDS).is_ok


def test_a_lane_entry_pointing_at_another_slot_is_a_table_fault(engine):
    (layer, expert, slot), (other_layer, other_expert, other) = resident(engine)[:2]
    tier = engine.tier
    layout = tier.source.layouts[(other_layer, other_expert)]
    tier.table.set(slot, *record_views(tier.record(other), layout))
    result = engine.verify_tiers(8)
    assert result.counts() == {"ram_bad": 0, "vram_bad": 0, "table_bad": 1}
    assert result.bad == [
        BadRecord(
            "table",
            layer,
            expert,
            slot,
            f"the CPU lane's entry for slot {slot} does not point at its record",
        )
    ]
    tier.table.set(slot, *record_views(tier.record(slot), tier.source.layouts[(layer, expert)]))
    assert engine.verify_tiers(8).is_ok


def test_without_a_store_the_ram_copy_is_compared_with_the_shards(demo):
    engine = CpuEngine(demo, CpuEngineOptions(max_batch=1, cpu_threads=1, ram_cap=40 * RECORD))
    engine.load()
    try:
        engine.step([StreamWork(0, PROMPT_IDS, 0, True)])
        layer, expert, slot = resident(engine)[1]
        assert engine.verify_tiers(64).counts() == {"ram_bad": 0, "vram_bad": 0, "table_bad": 0}
        offset = engine.tier.source.layouts[(layer, expert)].arrays[1][0][0]  # up trellis
        engine.tier.record(slot)[offset + 3] ^= 1
        result = engine.verify_tiers(64)
        assert (result.has_manifest, result.ram_bad) == (False, 1)
        assert result.bad == [
            BadRecord(
                "ram", layer, expert, slot, "the RAM copy differs from a fresh read of the record"
            )
        ]
    finally:
        engine.close()


class HostSlots:
    """A stand-in for the GPU engine's VRAM cache (not the GPU code): slots in host memory,
    so that check_vram's comparison runs here; tests/gpu/ runs it on the real cache."""

    def __init__(self, store: ExpertStore, records: list[tuple[int, int]]):
        self.slot_bytes = store.manifest.slot_bytes
        self.records = records
        self.slots = np.zeros((len(records), self.slot_bytes), dtype=np.uint8)
        for i, (layer, expert) in enumerate(records):
            buf = np.zeros(store.record_bytes + 4096, dtype=np.uint8)
            start = -buf.ctypes.data % 4096
            rec = buf[start : start + store.record_bytes]
            store.read([(layer, expert, rec)])
            self.slots[i] = rec[: self.slot_bytes]

    def resident(self):
        return [(layer, expert, i) for i, (layer, expert) in enumerate(self.records)]

    def slot_copy(self, slot):
        return self.slots[slot]


def test_vram_slots_are_compared_with_the_leading_bytes_of_fresh_reads(good_store):
    with ExpertStore(good_store) as store:
        slots = HostSlots(store, [(2, 0), (3, 7), (5, 31)])
        # a GPU engine without a RAM tier (exact mode) checks its VRAM cache alone
        result = check_tiers(None, 64, vram=slots, source=store, seed=0)
        assert (result.vram_checked, result.vram_bad, result.ram_checked) == (3, 0, 0)
        slots.slots[1, 17] ^= 2
        result = TierCheck()
        check_vram(slots, store, 64, np.random.default_rng(0), result)
        assert result.vram_bad == 1
        assert result.bad == [
            BadRecord(
                "vram",
                3,
                7,
                1,
                "the VRAM copy differs from the store record (which matches the manifest)",
            )
        ]


# --- through the server ------------------------------------------------------------------


def serve(demo, store, tmp_path) -> Server:
    return Server(
        [
            "--model",
            str(demo),
            "--engine",
            "cpu",
            "--store",
            str(store),
            "--ram-cap",
            str(40 * 77_824),
            "--cpu-threads",
            "1",
            "-cs",
            "1024",
        ],
        log_path=tmp_path / "server.log",
    )


def test_verify_on_demand_through_the_server_catches_a_flipped_store_byte(demo, store, tmp_path):
    server = serve(demo, store, tmp_path)
    try:
        server.wait_ready()
        assert "tier check at start: ram_bad=0 vram_bad=0 table_bad=0 (64 RAM-tier records" in (
            server.log()
        )
        http = httpx.Client(base_url=server.url, timeout=60)
        r = http.post(
            "/v1/completions",
            json={"model": "glm-5.3-flash", "prompt": "The", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        clean = http.get("/admin/verify", params={"n": 192}).json()
        assert {k: clean[k] for k in ("ok", "ram_bad", "vram_bad", "table_bad", "bad")} == {
            "ok": True,
            "ram_bad": 0,
            "vram_bad": 0,
            "table_bad": 0,
            "bad": [],
        }
        assert clean["ram_checked"] == 192 and clean["ram_resident_checked"] > 0
        flip_byte(store / "experts.bin", (3 * 32 + 9) * 77_824 + 123)  # layer 5, expert 9
        found = http.get("/admin/verify?n=192").json()
        assert (found["ok"], found["ram_bad"], found["vram_bad"], found["table_bad"]) == (
            False,
            1,
            0,
            0,
        )
        assert [(b["tier"], b["layer"], b["expert"]) for b in found["bad"]] == [("ram", 5, 9)]
        assert "sha256 no longer matches the manifest" in found["bad"][0]["problem"]
        stats = http.get("/stats").json()["engine"]["tiers"]["check"]
        assert (stats["ram_bad"], stats["vram_bad"], stats["table_bad"]) == (1, 0, 0)
        metrics = http.get("/metrics").text
        assert "glm53_engine_tiers_check_ram_bad 1" in metrics.splitlines()
        assert "tier check on demand: ram_bad=1 vram_bad=0 table_bad=0" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_a_damaged_store_refuses_to_serve_at_start(demo, store, tmp_path):
    data = store / "experts.bin"
    for record in range(192):  # every record: whichever 64 the start samples, all are bad
        flip_byte(data, record * 77_824 + 64)
    server = serve(demo, store, tmp_path)
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.wait_ready()
    log = server.log()
    assert "tier check at start: ram_bad=64 vram_bad=0 table_bad=0" in log
    assert "the tier check at start failed, so glm53 does not serve" in log
    assert f"check the store with `glm53 store verify --store {store}` and repack it" in log
