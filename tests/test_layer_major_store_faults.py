"""Layer-major prefill in the store modes (glm53.engine.gpu_tiers.step_layer_major_nvme through
GpuEngine.iterate) on the CPU: a store read fault in a pass's step fails the pass's job alone,
with the fault's message naming the layer, the expert and the store check, and the other job
decodes on in the same iteration; the pass's step runs under the tiers' lock, and the table
check follows it. The GPU, exllamav3's Generator and the pass are played by named mocks
(MockNvme, MockGenerator, MockLayerMajor): what runs for real is the engine's wiring. The pass
itself over the RAM tier runs only on a GPU (tests/gpu/test_nvme_exact_gpu.py)."""

import threading
from types import SimpleNamespace

import torch

from glm53.engine.base import FinishReason
from glm53.engine.gpu import GpuEngine
from glm53.engine.gpu_options import EngineOptions
from glm53.tiers.ram_tier import ReadFault


class MockNvme:
    """The tiers' owner as GpuEngine.iterate sees it: its lock, the table check, the faults."""

    def __init__(self):
        self.lock = threading.Lock()
        self.row_keys = None
        self.checks = []  # whether the lock was held at each table check

    def check_table_bad(self):
        self.checks.append(self.lock.locked())

    def end_forward(self):
        pass

    def take_faults(self):
        return []


class MockGenerator:
    """Generator.iterate: one token for each job named in `decoding`; cancel recorded."""

    def __init__(self, decoding):
        self.decoding, self.cancelled, self.active_jobs = decoding, [], []

    def iterate(self):
        return [{"stage": "streaming", "identifier": k, "token_ids": torch.tensor([[7]])}
                for k in self.decoding]  # fmt: skip

    def cancel(self, job):
        self.cancelled.append(job)


class MockLayerMajor:
    """LayerMajorPrefill as the engine drives it: `step` raises `fault` (or runs), with the
    tiers' lock held or not recorded; cancel drops the pass."""

    def __init__(self, job, nvme, fault=None):
        self.active = SimpleNamespace(job=job)
        self.nvme, self.fault = nvme, fault
        self.locked_steps, self.cancelled = [], []

    def step(self):
        self.locked_steps.append(self.nvme.lock.locked())
        if self.fault is not None:
            raise self.fault

    def cancel(self, job):
        self.cancelled.append(job)
        self.active = None
        return True

    def after_iterate(self, decoded):
        pass


def engine(tmp_path, fault):
    e = GpuEngine(str(tmp_path), EngineOptions(mode="nvme-exact", store=str(tmp_path / "store"),
                                               prefill="layer-major"))  # fmt: skip
    nvme = MockNvme()
    prefilling = SimpleNamespace(identifier="a", sampler=None)
    decoding = SimpleNamespace(identifier="b", sampler=None)
    e.loaded = SimpleNamespace(nvme=nvme)
    e.generator = MockGenerator(decoding=["b"])
    e.tokenizer = SimpleNamespace(vocab_size=16)
    e._jobs = {"a": prefilling, "b": decoding}
    e.layer_major = MockLayerMajor(prefilling, nvme, fault)
    return e, nvme, prefilling


def test_a_read_fault_in_a_pass_fails_its_job_alone_and_the_others_decode_on(tmp_path):
    fault = ReadFault("short read at offset 4096 (EIO)", 3, 17).picked_by([0, 5], 2048)
    e, nvme, prefilling = engine(tmp_path, fault)
    outs = {o.key: o for o in e.iterate()}
    assert outs["a"].finish == FinishReason.ERROR and outs["a"].token_ids == []
    msg = outs["a"].error
    assert "reading layer 3 expert 17 from the expert store failed" in msg, msg
    assert "short read at offset 4096" in msg and "glm53 store verify --store" in msg, msg
    assert outs["b"].token_ids == [7] and outs["b"].finish is None  # decoded on
    assert e.layer_major.cancelled == [prefilling] and e.generator.cancelled == [prefilling]
    assert "a" not in e._jobs and "b" in e._jobs
    assert e.layer_major.locked_steps == [True]  # the step ran under the tiers' lock


def test_a_pass_step_runs_under_the_tiers_lock_and_is_table_checked(tmp_path):
    e, nvme, _ = engine(tmp_path, None)
    outs = {o.key: o for o in e.iterate()}
    assert set(outs) == {"b"} and outs["b"].token_ids == [7]
    assert e.layer_major.locked_steps == [True] and e.layer_major.cancelled == []
    assert nvme.checks[0] is True  # the check after the step, lock held
    assert set(e._jobs) == {"a", "b"}
