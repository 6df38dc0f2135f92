"""Exact mode against stock exllamav3 1.6.5's own Generator: greedy tokens and the logits they
were sampled from are identical (torch.equal), in-process and through the real server.

The reference runs in a subprocess (tools/exl3_reference.py) that never imports glm53: stock
exllamav3 with every expert in VRAM, ArgmaxSampler, no stop tokens, each prompt alone at
max_batch_size 1 (and, for batch parity, the same jobs enqueued together at max_batch_size N).
glm53 serves the same checkpoint in exact mode with the VRAM expert cache at the 24 GB card's
11.4 % share. Checkpoints: the slice with glm53's routing skew as `glm53 synth` writes it
(GLM53_TEST_SLICE) and a slice with uniform routing rewritten by tools/reshard_checkpoint.py in
other shards and tensor order (GLM53_TEST_SLICE_RESHARDED). Prompt lengths sit at page (256) and
chunk (2,048) edges.
"""

from __future__ import annotations

import pytest

pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")
httpx = pytest.importorskip("httpx")

from gpu_kit import (  # noqa: E402
    BATCH,
    CHUNK,
    LENGTHS,
    N_NEW,
    assert_same,
    batch_prompts,
    checkpoint_dir,
    copy_first_uncached,
    expert_slots,
    random_ids,
    reference_spec,
    run_engine,
    single_prompts,
    stock_reference,
    text_config,
    together_generator,
)
from serving_kit import Server  # noqa: E402

from glm53.engine.gpu import GpuEngine  # noqa: E402
from glm53.engine.gpu_options import EngineOptions  # noqa: E402
from glm53.exl3 import standard_region  # noqa: E402

CHECKPOINTS = {"slice": "GLM53_TEST_SLICE", "resharded": "GLM53_TEST_SLICE_RESHARDED"}
CONTEXT = 8192
SHARE = 0.114  # the 24 GB RTX 3090's share of the experts: 1,376 of 12,096


def _prompts(vocab):
    single = single_prompts(vocab)
    a = single[5000]
    follow = {
        # shares 4,500 tokens with the 5,000-token prompt: its standard region reuses 4,096
        "shared4500": a[:4500] + random_ids(vocab, 700, 7),
        # exactly two chunks shared plus one token: reuse 4,096, prefill nothing, decode
        "shared4096_plus1": a[:4096] + random_ids(vocab, 1, 8),
        # one token short of two chunks: reuse only 2,048
        "shared4095": a[:4095] + random_ids(vocab, 300, 9),
        "repeat5000": list(a),
    }
    return single, follow, batch_prompts(vocab)


def _spec(path):
    single, follow, batch = _prompts(text_config(path)["vocab_size"])
    return reference_spec(path, [
        {"prompts": [single[n] for n in LENGTHS]},
        {"prompts": list(follow.values())},
        {"prompts": batch, "together": True, "generator": together_generator()},
    ])  # fmt: skip


def reference_specs():
    """The stock runs this file asks for (conftest.py declares them: one reference process per
    checkpoint for the session)."""
    return [_spec(p) for p in map(checkpoint_dir, CHECKPOINTS.values()) if p]


def _checkpoint(name):
    path = checkpoint_dir(CHECKPOINTS[name])
    if path is None:
        pytest.skip(f"no {name} checkpoint ({CHECKPOINTS[name]})")
    return path


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def case(request, tmp_path_factory):
    path = _checkpoint(request.param)
    single, follow, batch = _prompts(text_config(path)["vocab_size"])
    assert len(batch) == len(BATCH)
    tmp = tmp_path_factory.mktemp(f"ref-{request.param}")
    ref = stock_reference(_spec(path), tmp)
    return {
        "name": request.param,
        "path": path,
        "single": dict(zip(LENGTHS, ref[0], strict=True)),
        "follow": dict(zip(follow, ref[1], strict=True)),
        "batch": ref[2],
        "prompts": (single, follow, batch),
        "tmp": tmp,
    }


@pytest.fixture(scope="module")
def engine(case):
    e = GpuEngine(case["path"], EngineOptions(
        mode="exact", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=expert_slots(case["path"], SHARE), heat_file=str(case["tmp"] / "heat.json"),
    ))  # fmt: skip
    e.load()
    yield e
    e.close()


def test_batch1_every_length_matches_the_generator(case, engine):
    single = case["prompts"][0]
    for n in LENGTHS:
        (got,) = run_engine(engine, [single[n]], N_NEW)
        assert_same(got, case["single"][n], f"{case['name']} prompt of {n}")


def test_prefix_hits_change_no_output(case, engine):
    """The 5,000-token prompt ran above; follow-ups reuse its standard region only, and give what
    a cold Generator gives."""
    single, follow, _ = case["prompts"]
    run_engine(engine, [single[5000]], N_NEW)  # make sure it is cached, whatever ran before
    for name, prompt in follow.items():
        (got,) = run_engine(engine, [prompt], N_NEW)
        assert_same(got, case["follow"][name], f"{case['name']} {name}")
        shared = next(
            (i for i, (x, y) in enumerate(zip(prompt, single[5000], strict=False)) if x != y),
            min(len(prompt), 5000),
        )
        expect = min(shared, standard_region(len(prompt), CHUNK), standard_region(5000, CHUNK))
        expect = expect // CHUNK * CHUNK
        assert got["cached"] == expect, f"{name}: reused {got['cached']}, expected {expect}"


def test_batch_admitted_together_matches_the_generator_at_that_batch(case, engine):
    got = run_engine(engine, case["prompts"][2], N_NEW)
    for i, (g, w) in enumerate(zip(got, case["batch"], strict=True)):
        assert_same(g, w, f"{case['name']} batch job {i} ({len(case['prompts'][2][i])} tokens)")


def test_staging_with_the_copy_first_changes_no_output(case, engine):
    """PrefillStager.copy_first (not yet the default): each copy-engine stage queues its copy
    before the unstage kernel of the buffer's old layer, so the buffer is written while that
    layer's entries still point into it (nothing reads them before the unstage). Every prompt
    alone, at the page and chunk edges, then the batch, equal to the Generator."""
    with copy_first_uncached(engine) as stager:  # these prompts ran above: whole again
        stages = stager.stages
        single = case["prompts"][0]
        for n in LENGTHS:
            (got,) = run_engine(engine, [single[n]], N_NEW)
            assert_same(got, case["single"][n], f"{case['name']} copy first, prompt of {n}")
            assert got["cached"] == 0, got["cached"]
        got = run_engine(engine, case["prompts"][2], N_NEW)
        for i, (g, w) in enumerate(zip(got, case["batch"], strict=True)):
            assert_same(g, w, f"{case['name']} copy first, batch job {i}")
        assert stager.stages > stages  # the prompts staged (with the copy first)


def test_staging_loan_changes_no_output(case, engine):
    """--ec-stage-loan: the staging buffers serve as cache slots in decode and go back to the
    stager before each staged prefill chunk. Every prompt alone, then the batch, equal to the
    Generator; the buffers went to the cache and came back at least once each. The cache starts
    from the heat list the exact engine saved as it closed (a seed fills CLOCK's slots only),
    and the heat file stays in the test's directory."""
    engine.close()  # one copy of the model on the GPU at a time (the server fixture's too)
    e = GpuEngine(case["path"], EngineOptions(
        mode="exact", context=CONTEXT, max_batch=4, chunk_size=CHUNK,
        ec_max_slots=expert_slots(case["path"], SHARE), ec_stage_loan=True,
        heat_file=str(case["tmp"] / "heat.json"),
    ))  # fmt: skip
    e.load()
    try:
        single = case["prompts"][0]
        for n in LENGTHS:
            (got,) = run_engine(e, [single[n]], N_NEW)
            assert_same(got, case["single"][n], f"{case['name']} loan, prompt of {n}")
        got = run_engine(e, case["prompts"][2], N_NEW)
        for i, (g, w) in enumerate(zip(got, case["batch"], strict=True)):
            assert_same(g, w, f"{case['name']} loan, batch job {i}")
        vc = e.stats()["tiers"]["vram_cache"]
        assert vc["stage_loans"] >= 1 and vc["stage_recalls"] >= 1, vc
    finally:
        e.close()


@pytest.fixture(scope="module")
def server(case, engine):
    engine.close()  # one copy of the model on the GPU at a time
    tmp = case["tmp"]
    args = ["--engine", "gpu", "--mode", "exact", "--model", case["path"], "--context",
            str(CONTEXT), "--chunk-size", str(CHUNK), "--max-batch", "4",
            "--ec-max-slots", str(expert_slots(case["path"], SHARE))]  # fmt: skip
    srv = Server(args, env={"XDG_CACHE_HOME": str(tmp / "cache")}, log_path=tmp / "server.log")
    srv.wait_ready(timeout_s=900)
    yield srv
    assert srv.stop() == 0, srv.log()


def _generate(server, ids):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW,
                                                  "ignore_eos": True}}  # fmt: skip
    r = httpx.post(server.url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_generate_and_completions_match_the_generator(case, server):
    single, follow, _ = case["prompts"]
    for n in LENGTHS:
        got = _generate(server, single[n])["output_ids"]
        assert got == case["single"][n]["tokens"], f"{case['name']} /generate, prompt of {n}"
    for n in (257, 2049):
        body = {"model": "glm-5.3-flash", "prompt": single[n], "max_tokens": N_NEW,
                "temperature": 0}  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ref = case["single"][n]["tokens"]
        ids = httpx.post(server.url + "/tokenize", json={"prompt": choice["text"]}, timeout=60)
        # completions stop at the checkpoint's eos (the reference has none): compare the text
        # of the reference's tokens up to there
        from glm53.engine.tokenizer import CheckpointTokenizer

        tok = CheckpointTokenizer.from_dir(case["path"])
        eos = set(tok.eos_token_ids)
        cut = next((i for i, t in enumerate(ref) if t in eos), len(ref))
        assert choice["text"] == tok.decode(ref[:cut]), f"/v1/completions, prompt of {n}"
        assert ids.status_code == 200
    # a follow-up through the server after its prefix was served: same tokens as cold
    _generate(server, single[5000])
    before = httpx.get(server.url + "/stats", timeout=30).json()["engine"]["cached_tokens"]
    got = _generate(server, follow["shared4500"])["output_ids"]
    assert got == case["follow"]["shared4500"]["tokens"]
    after = httpx.get(server.url + "/stats", timeout=30).json()["engine"]["cached_tokens"]
    assert after - before == 4096
