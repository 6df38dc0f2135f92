"""The GPU engine's request interface (start, iterate, cancel) on the demo checkpoint: a job
cancelled mid-prefill leaves the others' tokens unchanged, bad requests fail alone,
and the heat list round-trips. Parity with stock exllamav3 is tests/gpu/test_generator_parity.py."""

import json
import os

import pytest
import torch

pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")

from gpu_kit import bounded  # noqa: E402

from glm53.engine.base import EngineError  # noqa: E402
from glm53.engine.gpu import GpuEngine  # noqa: E402
from glm53.engine.gpu_options import EngineOptions  # noqa: E402
from glm53.engine.sampling import SamplingParams  # noqa: E402
from glm53.engine.scheduler import GenerationRequest  # noqa: E402

DEMO = os.environ.get("GLM53_TEST_DEMO")
pytestmark = pytest.mark.skipif(
    not DEMO or not os.path.isfile(os.path.join(DEMO, "config.json")),
    reason="GLM53_TEST_DEMO does not name a synthetic demo checkpoint",
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    heat = tmp_path_factory.mktemp("heat") / "heat.json"
    e = GpuEngine(DEMO, EngineOptions(
        mode="exact", context=4096, max_batch=4, chunk_size=512, ec_max_slots=64,
        heat_file=str(heat),
    ))  # fmt: skip
    e.load()
    yield e
    e.close()


def _req(ids):
    return GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0))


def _drain(engine, cancel_at=None, cached=None):
    """Iterate to the end; `cancel_at` = (key, iteration) cancels that job then; `cached` (a
    dict) receives each job's reused prompt tokens."""
    toks = {}
    it = 0
    for _ in bounded(1000, lambda: f"_drain: {toks}, {engine.stats()}"):  # ~100 needed
        if not engine.has_work():
            break
        if cancel_at and it == cancel_at[1]:
            engine.cancel(cancel_at[0])
        for o in engine.iterate():
            assert o.finish != "error", o.error
            toks.setdefault(o.key, []).extend(o.token_ids)
            if cached is not None and o.cached_tokens is not None:
                cached[o.key] = o.cached_tokens
        it += 1
    return toks


def _prompts(engine):
    g = torch.Generator().manual_seed(5)
    vocab = engine.tokenizer.vocab_size
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1500, 40, 700)]


def test_a_cancelled_job_leaves_the_others_alone(engine):
    a, b, c = _prompts(engine)
    # a first run puts a's standard region (1,024 of its 1,500 tokens at chunk 512) in the prefix
    # cache: the two measured runs below both reuse it, so both prefill a in the same chunks and
    # decode in the same batches (a cold first run would prefill a in more iterations than the
    # second, and b would decode in other batches: other rounding, other tokens)
    for i, p in enumerate((a, b)):
        engine.start(i, _req(p), 32)
    _drain(engine)
    for i, p in enumerate((a, b)):
        engine.start(i, _req(p), 32)
    cached_alone = {}
    alone = _drain(engine, cached=cached_alone)
    # the same two again with a third that is cancelled after its first prefill chunk (before
    # it decodes, so the decode batches are those of the run above)
    for i, p in enumerate((a, b, c)):
        engine.start(i, _req(p), 32)
    cached = {}
    got = _drain(engine, cancel_at=(2, 1), cached=cached)
    assert cached[0] == cached_alone[0] and cached[1] == cached_alone[1], (cached, cached_alone)
    assert got[0] == alone[0] and got[1] == alone[1]
    assert 2 not in got or len(got[2]) < 32
    assert not engine.has_work()


def test_bad_requests_fail_alone(engine):
    with pytest.raises(EngineError, match="context"):
        engine.start("long", _req([1] * 4000), 200)
    engine.start("ok", _req([1, 2, 3]), 4)
    with pytest.raises(EngineError, match="already running"):
        engine.start("ok", _req([1, 2, 3]), 4)
    assert len(_drain(engine)["ok"]) == 4


def test_heat_list_round_trip(engine):
    engine.start("h", _req(list(range(100))), 8)
    _drain(engine)
    path = engine.save_heat()
    keys = json.load(open(path))["keys"]
    assert keys and len(keys) <= engine.loaded.ec.n_slots


def test_warmup_then_a_heat_list_seeds_a_cache_emptied_of_the_warmups_picks(engine):
    """--warmup runs exllamav3's warm-up forwards through the routing hooks, which admit its
    random picks into the cache; the load then empties the cache and its counts
    (DeviceExpertCache.empty) so that the heat list seeds it (seed raised 'needs an empty cache'
    before), and serves."""
    engine.start("w", _req(list(range(100))), 8)
    _drain(engine)
    heat = engine.save_heat()
    keys = json.load(open(heat))["keys"]
    e = GpuEngine(DEMO, EngineOptions(
        mode="exact", context=4096, max_batch=4, chunk_size=512, ec_max_slots=64,
        heat_file=heat, warmup=True,
    ))  # fmt: skip
    try:
        e.load()
        st = e.stats()
        assert st["warmup"]["ran"] and not st["warmup"]["passes_that_raised"], st["warmup"]
        vc = st["tiers"]["vram_cache"]
        assert vc["used"] == min(len(keys), 64) and vc["hits"] == vc["misses"] == 0, vc
        e.start("after", _req([1, 2, 3]), 4)
        assert len(_drain(e)["after"]) == 4
    finally:
        e.close()
