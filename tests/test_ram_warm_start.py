"""Warm start of the RAM tier: a CPU engine over a packed store writes its resident experts,
hottest first, when it closes (glm53.tiers.heat), and the next engine on the same checkpoint
and store reads them back into the tier before serving. Real files and real O_DIRECT reads;
the outputs are those of a cold start."""

import errno
import json

import numpy as np
import torch
from store_kit import FailingReader, resident_records

from glm53.engine.base import StreamWork
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions
from glm53.tiers.heat import heat_path, read_heat

RECORD = 77_824  # demo record bytes
NUM_RECORDS = 192  # 6 MoE layers x 32 experts
PROMPT = [11, 12, 13]


def _engine(demo, store, heat, records=NUM_RECORDS):
    options = CpuEngineOptions(
        max_batch=1, cpu_threads=1, ram_cap=records * RECORD, store=store, heat_file=heat
    )
    eng = CpuEngine(demo, options)
    eng.load()
    return eng


def _run(engine):
    first = engine.step([StreamWork(0, PROMPT, 0, True)])[0]
    token = int(first.argmax())
    return first, engine.step([StreamWork(0, [token], len(PROMPT), True)])[0]


def test_a_restart_starts_warm_with_the_same_outputs(demo, good_store, tmp_path):
    heat = str(tmp_path / "heat.json")
    cold = _engine(demo, good_store, heat)
    assert cold.warm_start == {}  # no list yet
    cold_logits = _run(cold)
    resident, hottest = resident_records(cold), cold.tier.heat_list()
    assert sorted(hottest) == sorted(resident) and len(hottest) > 0
    cold.close()
    saved = json.loads(open(heat).read())
    assert saved["keys"] == hottest

    warm = _engine(demo, good_store, heat)
    try:
        w = warm.warm_start
        assert (w["wanted"], w["seeded"], w["error"]) == (len(hottest), len(hottest), "")
        assert w["bytes_read"] >= len(hottest) * RECORD
        assert resident_records(warm) == resident
        misses = warm.tier.counters()["misses"]
        warm_logits = _run(warm)
        assert warm.tier.counters()["misses"] == misses  # every expert it needed was there
        assert all(torch.equal(a, b) for a, b in zip(cold_logits, warm_logits, strict=True))
        assert warm.stats()["tiers"]["ram"]["warm_start"]["seeded"] == len(hottest)
    finally:
        warm.close()


def test_a_smaller_cap_takes_the_hottest_of_the_list(demo, good_store, tmp_path):
    heat = str(tmp_path / "heat.json")
    first = _engine(demo, good_store, heat)
    _run(first)
    hottest = first.tier.heat_list()
    first.close()
    small = _engine(demo, good_store, heat, records=8)
    try:
        assert small.warm_start["seeded"] == 8 < len(hottest)
        assert resident_records(small) == set(hottest[:8])
        # the coldest of the seeded is the first CLOCK evicts
        assert small.tier.heat_list()[-1] == hottest[7]
    finally:
        small.heat_file = None  # keep the list of the full run
        small.close()


def test_a_list_of_another_geometry_is_not_used(demo, good_store, tmp_path, caplog):
    heat = tmp_path / "heat.json"
    heat.write_text(json.dumps({"model": "x", "keys": [3, NUM_RECORDS + 5]}))
    assert read_heat(str(heat), NUM_RECORDS) == []
    assert "outside this checkpoint's 192" in caplog.text
    eng = _engine(demo, good_store, str(heat))
    try:
        assert eng.warm_start == {} and eng.tier.clock.n_used == 0
    finally:
        eng.heat_file = None
        eng.close()


def test_a_read_fault_stops_the_warm_start_and_keeps_what_was_read(demo, good_store):
    eng = _engine(demo, good_store, None)
    try:
        keys = list(range(0, 40))
        real = eng.tier.source.reader
        eng.tier.source.reader = FailingReader(real, [20 * RECORD + 4096], errno.EIO)
        eng.tier.clock.clear()
        got = eng.tier.seed(keys, batch=10)
        eng.tier.source.reader = real
        assert got["seeded"] == 20 and "layer" in got["error"] and "expert" in got["error"]
        assert resident_records(eng) == set(range(20))
        # what was read is byte for byte the store's records
        check = eng.verify_tiers(NUM_RECORDS)
        assert check.counts() == {"ram_bad": 0, "vram_bad": 0, "table_bad": 0}
        assert eng.tier.faults["read_errors"] >= 1
    finally:
        eng.close()


def test_the_list_is_kept_per_checkpoint_and_source(demo, good_store, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = heat_path(str(demo), "ram", str(good_store))
    b = heat_path(str(demo), "ram", None)
    assert a != b and a.startswith(str(tmp_path)) and a.endswith(".json")
    assert heat_path(str(demo), "vram") != a
    assert np.all([p.startswith(str(tmp_path / "glm53" / "heat")) for p in (a, b)])


def test_the_cpu_engine_keeps_its_list_in_the_cache_dir(demo, good_store, tmp_path):
    from glm53.config import Settings
    from glm53.engine.cpu import create

    settings = Settings(cache_dir=str(tmp_path / "cache"), store=str(good_store))
    eng = create(settings, demo)
    assert eng.heat_file == heat_path(str(demo), "ram", str(good_store), tmp_path / "cache")
    assert eng.heat_file.startswith(str(tmp_path / "cache" / "heat") + "/")
