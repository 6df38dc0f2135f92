"""The order of a prefill stage's work on its stream (glm53.tiers.vram_cache.PrefillStager._stage).
The real stager needs CUDA; here its library, streams, events and buffers are mocks that record
the calls, in order, with the stream each was queued on. PrefillStager.copy_first (the copy
queued first) is off until its GPU side has run: tests/gpu/test_generator_parity.py's copy-first
case (torch.equal to stock exllamav3's Generator) and bench/gpu_slice.py's exact_copy_first row
(whether the copy then runs beside the MoE kernel)."""

from types import SimpleNamespace

import pytest

from glm53.tiers.vram_cache import PrefillStager

RECORD = 1000  # bytes of a mock record


class MockLib:
    """Mock of glm53._cuda's staging calls: each call is recorded as (name, stream)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name not in ("memcpy_async", "ec_unstage", "ec_stage_layer", "ec_stage", "copy_jobs"):
            raise AttributeError(name)
        return lambda *a: self.calls.append((name, a[-1]))


class MockEvent:
    """Mock of torch.cuda.Event: records where it was recorded."""

    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("event", stream.cuda_stream))


def make_stager(monkeypatch, dma: bool, n_experts: int = 8, buf_slots: int = 8):
    import torch

    lib = MockLib()
    monkeypatch.setattr(torch.cuda, "Event", lambda: MockEvent(lib.calls))
    geo = SimpleNamespace(record_bytes=RECORD, n_layers=4, n_experts=n_experts)
    cache = SimpleNamespace(_cuda=lib, _ptr=7, geo=geo, copy_blocks=1, device="cuda:0")
    st = PrefillStager.__new__(PrefillStager)  # __init__ allocates on a GPU
    st.cache, st.buf_slots, st.loan = cache, buf_slots, None
    st.bufs = [SimpleNamespace(data_ptr=lambda b=b: 10_000 * (b + 1)) for b in range(2)]
    zeros = SimpleNamespace(data_ptr=lambda: 0)
    st.job_src = st.job_dst = st.n_jobs = [zeros, zeros]
    st.owner, st.dma, st.dma_count = [-1, -1], dma, min(buf_slots, n_experts)
    st.layer_home = [100_000 * (layer + 1) for layer in range(geo.n_layers)]
    st.side = SimpleNamespace(cuda_stream="side")
    st.stages, st.hold, st.held, st.unstaged, st.pending = 0, False, set(), None, {}
    st.copy_first = True  # the order under test (the class default is off until its GPU test)
    return st, lib


def test_a_dma_stage_queues_its_copy_before_the_unstage_kernel(monkeypatch):
    """Copy-engine staging on the side stream: the copy comes first, so that it is not queued
    behind a kernel waiting for the computing MoE kernel's SMs; then the old layer's unstage
    (and the event order_unstage waits for), then the kernel pointing the new layer there."""
    st, lib = make_stager(monkeypatch, dma=True)
    st._stage(0, st.side)  # an empty buffer: nothing to unstage
    assert lib.calls == [("memcpy_async", "side"), ("ec_stage_layer", "side")]
    lib.calls.clear()
    st._stage(2, st.side)  # buffer 0 held layer 0
    assert lib.calls == [
        ("memcpy_async", "side"), ("ec_unstage", "side"), ("event", "side"),
        ("ec_stage_layer", "side"),
    ]  # fmt: skip
    assert st.owner == [2, -1] and st.unstaged is not None and st.stages == 2


def test_a_main_stream_stage_keeps_everything_on_the_main_stream(monkeypatch):
    st, lib = make_stager(monkeypatch, dma=True)
    main = SimpleNamespace(cuda_stream="main")
    st._stage(1, main)
    st._stage(3, main)
    assert lib.calls == [
        ("memcpy_async", "main"), ("ec_stage_layer", "main"),
        ("memcpy_async", "main"), ("ec_unstage", "main"), ("ec_stage_layer", "main"),
    ]  # fmt: skip
    assert st.unstaged is None  # order_unstage is for the side stream's unstages only


@pytest.mark.parametrize("stream", ["side", "main"])
def test_a_gather_stage_unstages_before_its_copy_kernels(monkeypatch, stream):
    """A gather stage (nvme-exact's RAM-tier homes, or no contiguous arena) copies with SM
    kernels that read the table the unstage rewrites: it keeps unstage, gather, copy."""
    st, lib = make_stager(monkeypatch, dma=False)
    s = st.side if stream == "side" else SimpleNamespace(cuda_stream="main")
    st._stage(0, s)
    st._stage(2, s)
    names = [name for name, _ in lib.calls if name != "event"]
    assert names == ["ec_stage", "copy_jobs", "ec_unstage", "ec_stage", "copy_jobs"]


def test_the_default_order_queues_the_copy_after_the_unstage(monkeypatch):
    """copy_first is off until its GPU test passes: the order every GPU test has run."""
    assert PrefillStager.copy_first is False
    st, lib = make_stager(monkeypatch, dma=True)
    del st.copy_first  # the class's default
    st._stage(0, st.side)
    st._stage(2, st.side)
    assert [name for name, _ in lib.calls] == [
        "memcpy_async", "ec_stage_layer",
        "ec_unstage", "event", "memcpy_async", "ec_stage_layer",
    ]  # fmt: skip
