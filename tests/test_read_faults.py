"""Read faults in the nvme modes fail only the requests whose picks needed the record
(glm53.tiers.read_faults, glm53.exl3.nvme_device, glm53.engine.gpu_tiers), on the CPU.

The RAM tier, the store and the O_DIRECT reads are real; a read fails through store_kit's
FailingReader (fault injection on the read path). The GPU is played by named mocks:
test_nvme_device_glue's `MockExpertCache` / `MockCudaLib` (the device cache's tensors on the CPU,
the launches recorded) and `MockDecodeGenerator` here, which stands in for exllamav3's Generator
running one decode step: it builds the step's picks, calls the routing hook's nvme route as the
forward would, and returns each job's token. tests/gpu/test_nvme_mode_gpu.py runs the real thing.
"""

from __future__ import annotations

import errno
import types

import numpy as np
import pytest
import torch
from store_kit import FailingReader
from test_nvme_device_glue import EXPERTS, POISON, RECORD, mock_nvme_home

from glm53.models.checkpoint import Checkpoint
from glm53.store.reader import ExpertStore
from glm53.tiers.gpu_home import RamHome
from glm53.tiers.ram_tier import RamTier, ReadFault
from glm53.tiers.read_faults import (
    FaultRecord,
    fault_message,
    fault_record,
    jobs_to_fail,
    resolve_isolating,
)

LAYERS, TOP_K = 6, 2


def fail_reads(tier, *keys, code=errno.EIO):
    """Make the reads of these keys' store records fail (the rest are read)."""
    tier.source.reader = FailingReader(tier.source.reader, [k * RECORD + 4096 for k in keys], code)


# --- the pure part -------------------------------------------------------------------------


def test_a_fault_masks_its_expert_and_the_rest_of_the_layer_is_read(demo, good_store):
    tier = RamTier(ExpertStore(good_store, Checkpoint(demo)), 40 * RECORD)
    home = RamHome(tier, tier.arena.ctypes.data, POISON)
    moe, layer = 2, tier.source.moe_layers[2]
    fail_reads(tier, moe * EXPERTS + 9)
    picks = np.array([[3, 9], [4, 5], [9, 6]])  # rows 0 and 2 picked expert 9
    update, faults, kept = resolve_isolating(home, layer, picks, np.zeros(6, bool), 3)
    assert [(f.layer, f.expert, f.rows) for f in faults] == [(layer, 9, (0, 2))]
    assert "picked by 2 rows (0, 2) of this forward's 3" in str(faults[0])
    assert kept.tolist() == [3, -1, 4, 5, -1, 6]
    for e in (3, 4, 5, 6):  # read, and their homes written
        key = moe * EXPERTS + e
        assert tier.clock.contains(key)
        i = np.flatnonzero(update.keys == key)
        assert update.addresses[i].tolist() == [home.address(tier.clock.slot_of(key))]
    assert not tier.clock.contains(moe * EXPERTS + 9) and tier.faults["read_errors"] == 1
    np.testing.assert_array_equal(home.home_of, home.expected())
    tier.close()


def test_two_faults_in_one_layer_are_both_isolated_and_an_unpicked_fault_is_raised(
    demo, good_store
):
    tier = RamTier(ExpertStore(good_store, Checkpoint(demo)), 40 * RECORD)
    home = RamHome(tier, tier.arena.ctypes.data, POISON)
    layer = tier.source.moe_layers[0]
    fail_reads(tier, 7, 8, code=errno.ENODATA)
    picks = np.array([[7, 1], [8, 2], [1, 2]])
    _, faults, kept = resolve_isolating(home, layer, picks, np.zeros(6, bool), 3)
    assert sorted((f.expert, f.rows) for f in faults) == [(7, (0,)), (8, (1,))]
    assert kept.tolist() == [-1, 1, -1, 2, 1, 2] and tier.faults["short_reads"] == 2
    # a fault of an expert no pick names cannot be isolated: it is raised as it is
    home.resolve = lambda *a: (_ for _ in ()).throw(ReadFault("elsewhere", layer, 30))
    with pytest.raises(ReadFault, match="elsewhere"):
        resolve_isolating(home, layer, picks, np.zeros(6, bool), 3)
    tier.close()


def test_the_jobs_to_fail_are_those_of_the_faults_rows_with_the_layer_expert_and_the_fix():
    fault = ReadFault("a read error for layer 3 expert 5: EIO", 3, 5).picked_by([0, 2], 3)
    record = fault_record(fault, ["a", "b", "a"])  # rows 0 and 2 are both job a's
    assert record == FaultRecord(3, 5, (0, 2), ("a",), str(fault))
    assert fault_record(fault, None).keys == ()
    msg = fault_message(record, "/srv/store")
    assert "reading layer 3 expert 5 from the expert store failed" in msg and "EIO" in msg
    assert "`glm53 store verify --store /srv/store`" in msg and "other requests go on" in msg
    other = FaultRecord(4, 1, (1, 2), ("b", "a"), "short read")
    failed = jobs_to_fail([record, other], "/srv/store")
    assert set(failed) == {"a", "b"}
    assert "layer 3 expert 5" in failed["a"] and "layer 4 expert 1" in failed["b"]
    assert jobs_to_fail([], None) == {}


# --- the routing hook's route (glm53.exl3.nvme_device) --------------------------------------


@pytest.fixture
def glue(demo, good_store, monkeypatch):
    home, ec, lib = mock_nvme_home(demo, good_store, monkeypatch, 40)
    yield home, ec, lib
    home.close()


def test_a_decode_fault_masks_the_expert_on_the_device_and_records_its_rows_jobs(glue):
    home, ec, lib = glue
    fail_reads(home.tier, 1 * EXPERTS + 9)
    home.row_keys = lambda: ["job-a", "job-b", "job-c"]
    selected = torch.tensor([[3, 9], [4, 5], [6, 3]], dtype=torch.int64)
    weights = torch.full((3, TOP_K), 0.5, dtype=torch.half)
    home.route(1, selected, True, {}, weights)
    assert selected.tolist() == [[3, -1], [4, 5], [6, 3]]  # rows b, c untouched
    assert weights.tolist() == [[0.5, 0.0], [0.5, 0.5], [0.5, 0.5]]
    # the kernels see the masked selection: nothing reads the faulted record's home
    assert [c for c in lib.calls if c[0] == "point_picks"][-1] == (
        "point_picks",
        1,
        [3, -1, 4, 5, 6, 3],
    )
    faults = home.take_faults()
    assert [(f.expert, f.rows, f.keys) for f in faults] == [(9, (0,), ("job-a",))]
    assert home.take_faults() == [] and home.stats()["faults_isolated"] == 1


@pytest.mark.parametrize(
    "decode, params, row_keys",
    [(False, {}, ["a"]), (True, {"g53_no_lane": True}, ["a"]), (True, {}, None)],
    ids=["prefill", "marked prefill or scoring", "outside the Generator's iterate"],
)
def test_outside_a_generator_decode_step_a_fault_is_raised_naming_its_rows(
    glue, decode, params, row_keys
):
    home, ec, lib = glue
    fail_reads(home.tier, 2 * EXPERTS + 4)
    home.row_keys = (lambda: row_keys) if row_keys else None
    selected = torch.tensor([[4, 1], [2, 4], [5, 6]], dtype=torch.int64)
    weights = torch.full((3, TOP_K), 0.5, dtype=torch.half)
    with pytest.raises(ReadFault, match="expert 4.*picked by 2 rows") as info:
        home.route(2, selected, decode, params, weights)
    assert info.value.rows == (0, 1) and home.take_faults() == []
    assert selected.tolist() == [[4, 1], [2, 4], [5, 6]]  # not masked: the forward stops


# --- the engine: only the jobs that needed the record fail -----------------------------------


class MockJob:
    """The parts of an exllamav3 Job that decode_row_keys and the engine read."""

    def __init__(self, key):
        self.identifier, self.sequences, self.sampler = key, [object()], None

    def is_prefill_done(self):
        return True


class MockDecodeGenerator:
    """A mock of exllamav3's Generator for one decode step (the real one needs a GPU): its
    forward routes one MoE layer's picks (a row per job, in job order) through the nvme route
    as the routing hook would, and each job's token is its row's first surviving pick."""

    def __init__(self, home, picks: dict):
        self.home, self.picks = home, picks
        self.active_jobs = [MockJob(k) for k in picks]
        self.cancelled, self.seen = [], None

    def iterate(self):
        selected = torch.tensor([self.picks[j.identifier] for j in self.active_jobs])
        weights = torch.full(selected.shape, 0.5, dtype=torch.half)
        self.home.route(3, selected, True, {}, weights)
        self.seen = selected.tolist()
        return [
            {"identifier": j.identifier, "stage": "streaming", "eos": False,
             "token_ids": torch.tensor([[max(row)]])}
            for j, row in zip(self.active_jobs, self.seen, strict=True)
        ]  # fmt: skip

    def cancel(self, job):
        self.cancelled.append(job.identifier)
        self.active_jobs.remove(job)


def test_the_engine_fails_only_the_request_whose_row_picked_the_faulted_expert(glue, demo):
    from glm53.engine.base import FinishReason
    from glm53.engine.gpu import GpuEngine
    from glm53.engine.gpu_options import EngineOptions

    home, ec, lib = glue
    engine = GpuEngine(str(demo), EngineOptions(mode="nvme-exact", store="/srv/store"))
    gen = MockDecodeGenerator(home, {"a": [10, 11], "b": [12, 13], "c": [11, 14]})
    engine.loaded = types.SimpleNamespace(nvme=home, ec=ec)
    engine.generator, engine.tokenizer = gen, types.SimpleNamespace(vocab_size=100)
    engine._jobs = {j.identifier: j for j in gen.active_jobs}
    clean = {o.key: o.token_ids for o in engine.iterate()}  # a clean step first
    assert clean == {"a": [11], "b": [13], "c": [14]}
    home.tier.clock.remove(3 * EXPERTS + 12)  # expert 12 is read again in the next step...
    fail_reads(home.tier, 3 * EXPERTS + 12)  # ... and that read fails
    outs = {o.key: o for o in engine.iterate()}
    assert outs["b"].finish == FinishReason.ERROR and outs["b"].token_ids == []
    layer = home.tier.source.moe_layers[3]
    assert f"reading layer {layer} expert 12 from the expert store failed" in outs["b"].error
    assert "glm53 store verify --store /srv/store" in outs["b"].error
    assert (outs["a"].token_ids, outs["c"].token_ids) == ([11], [14])  # as in the clean step
    assert outs["a"].finish is None and outs["c"].finish is None
    assert gen.seen == [[10, 11], [-1, 13], [11, 14]]  # only b's row lost the expert
    assert gen.cancelled == ["b"] and set(engine._jobs) == {"a", "c"}
    assert home.row_keys is None and home.take_faults() == []
    third = {o.key: o.token_ids for o in engine.iterate()}  # the others go on
    assert third == {"a": [11], "c": [14]}


class MockReapingGenerator(MockDecodeGenerator):
    """As MockDecodeGenerator, but its step is a prefill that raised for job `reaped`: exllamav3
    reaps that job (reap_failed_job) and its error result names the Job, with no identifier."""

    def __init__(self, home, picks, reaped):
        super().__init__(home, picks)
        self.reaped = reaped

    def iterate(self):
        job = next(j for j in self.active_jobs if j.identifier == self.reaped)
        self.active_jobs.remove(job)
        fault = ReadFault("a read error for layer 3 expert 5: EIO", 3, 5).picked_by([4], 9)
        return [{"job": job, "serial": 1, "stage": "error", "eos": True, "error": fault}]


def test_a_prefill_fault_fails_the_job_exllamav3_reaped_and_nothing_else(glue, demo):
    from glm53.engine.base import FinishReason
    from glm53.engine.gpu import GpuEngine
    from glm53.engine.gpu_options import EngineOptions

    home, ec, lib = glue
    engine = GpuEngine(str(demo), EngineOptions(mode="nvme-exact", store="/srv/store"))
    gen = MockReapingGenerator(home, {"a": [1, 2], "b": [3, 4]}, reaped="b")
    engine.loaded = types.SimpleNamespace(nvme=home, ec=ec)
    engine.generator, engine.tokenizer = gen, types.SimpleNamespace(vocab_size=100)
    engine._jobs = {j.identifier: j for j in gen.active_jobs}
    (out,) = engine.iterate()
    assert (out.key, out.finish) == ("b", FinishReason.ERROR)
    assert "reading layer 3 expert 5 from the expert store failed" in out.error
    assert "picked by row 4" in out.error and "glm53 store verify --store /srv/store" in out.error
    assert set(engine._jobs) == {"a"} and engine.has_work()
