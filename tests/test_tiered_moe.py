import numpy as np
import pytest

from glm53 import _odirect
from glm53.models.checkpoint import Checkpoint
from glm53.store.direct_io import ALIGN, plan_runs
from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint
from glm53.tiers.expert_source import SafetensorsSource, record_views
from glm53.tiers.moe import pack_jobs
from glm53.tiers.ram_tier import RamTier, TierError


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiers") / "demo"
    # 3 MiB shards: several shards end in the middle of a layer's experts, so some expert
    # spans run past the end of their file (the tail read)
    write_checkpoint(
        preset("demo", num_layers=4, num_dense_layers=1),
        out,
        seed=7,
        shard_bytes=3 << 20,
        routing_source="stand-in",
    )
    return Checkpoint(out)


def test_pack_jobs_puts_one_expert_in_a_job_and_at_most_8_picks():
    experts = np.array([5, 3, 5, 5, 3, 5, 5, 5, 5, 5, 5, 5, 1], dtype=np.int32)
    rows = np.arange(len(experts)) // 2
    jobs = pack_jobs(np.arange(len(experts)), experts, rows)
    assert [experts[j].tolist() for j in jobs] == [[1], [3, 3], [5] * 8, [5] * 2]
    assert jobs[2].tolist() == [0, 2, 3, 5, 6, 7, 8, 9]
    assert pack_jobs(np.array([], dtype=np.int64), experts, rows) == []


def test_every_expert_record_read_with_o_direct_holds_the_checkpoints_bytes(sharded):
    source = SafetensorsSource(sharded)
    try:
        tails = 0
        for (layer, expert), layout in source.layouts.items():
            for span in layout.spans:
                assert span.offset % ALIGN == 0 and span.length % ALIGN == 0
                tails += span.offset + span.length > source.file_bytes[span.path]
            record = _odirect.aligned_empty(source.record_bytes)
            record[:] = 0
            assert source.read([(layer, expert, record)]) == layout.record_bytes
            linears = sharded.experts(layer)[expert].linears
            for views, lin in zip(record_views(record, layout), linears, strict=True):
                for view, info in zip(views, (lin.trellis, lin.suh, lin.svh), strict=True):
                    np.testing.assert_array_equal(view, sharded.read(info.key))
        assert tails > 0
    finally:
        source.close()


def test_touching_and_overlapping_reads_are_coalesced_into_runs():
    bufs = [np.zeros(n, np.uint8) for n in (8192, 4096, 8192, 4096, 4096)]
    pieces = [(20480, 4096, bufs[3]), (0, 8192, bufs[0]), (8192, 4096, bufs[1])]
    pieces += [(4096, 8192, bufs[2]), (1 << 30, 4096, bufs[4])]
    runs = plan_runs(pieces)
    assert [(r.offset, r.length) for r in runs] == [(0, 12288), (20480, 4096), (1 << 30, 4096)]
    assert [(o, n) for o, n, _ in runs[0].pieces] == [(0, 8192), (4096, 8192), (8192, 4096)]
    assert runs[0].direct() is None and runs[1].direct() is bufs[3]


def test_a_layer_read_in_one_call_is_coalesced_and_holds_the_checkpoints_bytes(sharded):
    source = SafetensorsSource(sharded)
    try:
        for layer in sharded.moe_layers:
            experts = list(range(source.num_experts))
            arena = _odirect.aligned_empty(source.record_bytes * len(experts))
            arena[:] = 0
            records = [arena[i * source.record_bytes :][: source.record_bytes] for i in experts]
            got = source.read([(layer, e, rec) for e, rec in zip(experts, records, strict=True)])
            spans = [s for e in experts for s in source.layouts[(layer, e)].spans]
            covered = set()
            for s in spans:
                covered.update(range(s.offset // ALIGN, (s.offset + s.length) // ALIGN))
            assert got == len(covered) * ALIGN  # each block once, though neighbours share one
            for e, rec in zip(experts, records, strict=True):
                layout = source.layouts[(layer, e)]
                linears = sharded.experts(layer)[e].linears
                for views, lin in zip(record_views(rec, layout), linears, strict=True):
                    for view, info in zip(views, (lin.trellis, lin.suh, lin.svh), strict=True):
                        np.testing.assert_array_equal(view, sharded.read(info.key))
    finally:
        source.close()


def test_ram_tier_serves_more_experts_than_slots_in_waves(sharded):
    source = SafetensorsSource(sharded)
    tier = RamTier(source, ram_cap_bytes=3 * source.record_bytes)
    try:
        assert tier.num_slots == 3
        first = tier.make_resident(1, np.array([4, 9, 2, 7, 11], dtype=np.int32))
        assert first.experts.tolist() == [4, 9, 2] and first.num_admitted == 3
        assert first.bytes_read == 3 * source.record_bytes
        second = tier.make_resident(1, np.array([7, 11], dtype=np.int32))
        assert second.experts.tolist() == [7, 11] and second.num_hits == 0
        again = tier.make_resident(1, np.array([11], dtype=np.int32))
        assert (again.num_hits, again.num_admitted, again.bytes_read) == (1, 0, 0)
        assert tier.counters()["evictions"] == 2
    finally:
        tier.close()


def test_ram_cap_below_one_record_names_the_fix(sharded):
    source = SafetensorsSource(sharded)
    with pytest.raises(TierError) as err:
        RamTier(source, ram_cap_bytes=1000)
    source.close()
    assert str(err.value) == (
        f"--ram-cap 1000 bytes holds no expert record of {source.record_bytes} bytes; "
        f"raise --ram-cap to at least {source.record_bytes}"
    )
