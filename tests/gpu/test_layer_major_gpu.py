"""Layer-major prefill (glm53.exl3.layer_major, --prefill layer-major) against stock
exllamav3 1.6.5's own Generator prefilling the same prompt at the same chunk size, chunk-major:
the logits of the prompt's last position (the first decode row) and every decoded token and
its logits are torch.equal, on the slice (GLM53_TEST_SLICE) in exact mode at the 24 GB card's
11.4 % expert share. Then: each MoE layer is staged once per pass, the recurrent checkpoints a
pass publishes serve a later prompt's prefix exactly, a cancel mid-prefill frees the pass within
one layer and the same prompt then prefills to the Generator's output, and a decoding stream keeps
getting tokens between the layers of a long prefill.

Each test that needs a pass has a prompt no earlier test ran: the prefix cache would serve a
repeated prompt up to its last checkpoint and leave less than a chunk to prefill, so no pass would
start (on the H200 on 2026-12-05 the staging test saw no pass, and the cancel test, waiting for a
pass to reach its third step, looped until the group's deadline).

The chunk is 1,024 tokens so that the 2,049-token prompt (2,048 prefilled, its last token
decoded) takes two chunks; 8,192 and 32,768 take 9 and 33 forwards (the Generator cuts the
chunk that holds the last page boundary there and runs the 255 tokens after it as a forward
of its own)."""

from __future__ import annotations

import pytest

pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")

from gpu_kit import (  # noqa: E402
    assert_same,
    bounded,
    checkpoint_dir,
    copy_first_uncached,
    expert_slots,
    iteration_limit,
    random_ids,
    reference_spec,
    run_engine,
    stock_reference,
    text_config,
)

from glm53.engine.gpu import GpuEngine  # noqa: E402
from glm53.engine.gpu_options import EngineOptions  # noqa: E402
from glm53.exl3 import standard_region  # noqa: E402

ENV = "GLM53_TEST_SLICE"
CHUNK = 1024
LENGTHS = (2049, 8192, 32768)
SHORT = 300  # one chunk: the Generator's own path, and the stream that decodes alongside
N_NEW = 32
CONTEXT = 32768 + 256  # the longest prompt and its new tokens
CACHE_TOKENS = 2 * CONTEXT
SHARE = 0.114


FRESH = {"staged": 8192, "cancel": 32768, "stream": 32768}  # one prompt each, run first there
REFERENCED = [*LENGTHS, SHORT, "follow", "staged", "cancel"]  # "stream": only its companion's


def _prompts(vocab: int) -> dict:
    out = {n: random_ids(vocab, n, 3000 + n) for n in (*LENGTHS, SHORT)}
    # shares 5,000 tokens with the 8,192-token prompt: its pass's checkpoint at 4,096 serves it
    out["follow"] = out[8192][:5000] + random_ids(vocab, 300, 3001)
    for i, (key, n) in enumerate(FRESH.items()):
        out[key] = random_ids(vocab, n, 4000 + i)
    return out


def _spec(path) -> dict:
    p = _prompts(text_config(path)["vocab_size"])
    runs = [{"prompts": [p[k] for k in REFERENCED]}]
    return dict(reference_spec(path, runs, N_NEW), cache_tokens=CACHE_TOKENS,
                max_chunk_size=CHUNK)  # fmt: skip


def reference_specs():
    path = checkpoint_dir(ENV)
    return [_spec(path)] if path else []


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = checkpoint_dir(ENV)
    if path is None:
        pytest.skip(f"no slice checkpoint ({ENV})")
    tmp = tmp_path_factory.mktemp("layer-major")
    (ref,) = stock_reference(_spec(path), tmp)
    return {"path": path, "tmp": tmp, "prompts": _prompts(text_config(path)["vocab_size"]),
            "ref": dict(zip(REFERENCED, ref, strict=True))}  # fmt: skip


@pytest.fixture(scope="module")
def engine(case):
    e = GpuEngine(case["path"], EngineOptions(
        mode="exact", context=CONTEXT, max_batch=2, chunk_size=CHUNK, cache_tokens=CACHE_TOKENS,
        ec_max_slots=expert_slots(case["path"], SHARE),
        heat_file=str(case["tmp"] / "heat.json"), prefill="layer-major",
    ))  # fmt: skip
    e.load()
    assert e.layer_major is not None
    yield e
    e.close()


def _lm(engine) -> dict:
    return engine.stats()["layer_major"]


def _chunks(n: int) -> int:
    """The Generator's forwards for a prompt of n tokens: whole chunks up to the last page
    boundary b of n - 1, then [b, n - 1) when it is not empty."""
    end = n - 1
    b = end // 256 * 256
    return -(-b // CHUNK) + (1 if end > b else 0)


def test_layer_major_prefill_matches_the_generator(case, engine):
    for n in LENGTHS:
        before = _lm(engine)
        (got,) = run_engine(engine, [case["prompts"][n]], N_NEW)
        assert_same(got, case["ref"][n], f"layer-major prompt of {n}")
        after = _lm(engine)
        assert after["passes"] == before["passes"] + 1, n
        assert after["last_pass"]["chunks"] == _chunks(n), after["last_pass"]
        assert after["last_pass"]["tokens"] == n - 1
        assert "active" not in after
    loaded = engine.loaded
    assert loaded.ec.lent == 0 and (loaded.stager is None or not loaded.stager.hold)


def test_layer_major_prefill_with_the_copy_first_matches_the_generator(case, engine):
    """PrefillStager.copy_first (not yet the default): the pass's stages queue their copy
    before the unstage kernel of the buffer's old layer; the decode steps between the pass's
    steps wait for that unstage (order_unstage), copy included. Every length, torch.equal to
    the Generator."""
    with copy_first_uncached(engine):  # these prompts ran above: each pass runs whole again
        before = _lm(engine)["passes"]
        for n in LENGTHS:
            (got,) = run_engine(engine, [case["prompts"][n]], N_NEW)
            assert_same(got, case["ref"][n], f"layer-major, copy first, prompt of {n}")
            assert got["cached"] == 0, got["cached"]
        assert _lm(engine)["passes"] == before + len(LENGTHS)


def test_a_short_prompt_keeps_the_generators_path(case, engine):
    before = _lm(engine)["passes"]
    (got,) = run_engine(engine, [case["prompts"][SHORT]], N_NEW)
    assert_same(got, case["ref"][SHORT], f"prompt of {SHORT}")
    assert _lm(engine)["passes"] == before


def test_each_moe_layer_is_staged_once_per_pass(case, engine):
    stager = engine.loaded.stager
    if stager is None:
        pytest.skip("staging is off at this VRAM share")
    stages, skips, passes = stager.stages, stager.skips, _lm(engine)["passes"]
    (got,) = run_engine(engine, [case["prompts"]["staged"]], N_NEW)
    assert_same(got, case["ref"]["staged"], "8k, staged once per layer")
    assert _lm(engine)["passes"] == passes + 1, _lm(engine)
    # exllamav3's prefill stops in the last KV block after its attention, so the last MoE
    # layer's MLP never runs there (glm53.exl3.hooks.prefill_moe_count) and is not staged: on
    # an H100 on 2026-12-05 this test counted 35 skips, 5 layers x 7, with 6 stages (the
    # stager then staged the last layer ahead for nothing)
    ran = stager.prefill_layers
    assert ran == len(engine.loaded.moe) - 1
    # chunk-major would stage every layer for each of the 8 forwards that reach the stager
    assert stager.stages - stages == ran
    # the 8 forwards of [0, 7936) reach the stager (the 255-token one is under its 256 rows):
    # the first stages each layer, the other 7 find it staged
    assert stager.skips - skips == ran * 7


def test_a_pass_publishes_checkpoints_a_later_prefix_reuses_exactly(case, engine):
    p = case["prompts"]
    run_engine(engine, [p[8192]], N_NEW)  # its pass stashes at 1,024 .. 7,168
    (got,) = run_engine(engine, [p["follow"]], N_NEW)
    assert_same(got, case["ref"]["follow"], "follow-up of the 8k prompt")
    expect = min(5000, standard_region(len(p["follow"]), CHUNK)) // CHUNK * CHUNK
    assert got["cached"] == expect == 4096


def test_cancel_mid_prefill_frees_the_pass_within_one_layer(case, engine):
    from glm53.engine.sampling import SamplingParams
    from glm53.engine.scheduler import GenerationRequest

    p = case["prompts"]
    before = _lm(engine)
    req = GenerationRequest(prompt_ids=p["cancel"], sampling=SamplingParams(temperature=0.0))
    engine.start("long", req, N_NEW, return_logits=True)
    for _ in range(20):  # the pass starts in the first iteration or so, then one step each
        if _lm(engine).get("active", {}).get("step", 0) >= 3:
            break
        for o in engine.iterate():
            assert o.finish != "error", o.error
    else:
        raise AssertionError(f"no pass reached its third step: {_lm(engine)}")
    layers = _lm(engine)["layers_run"]
    engine.cancel("long")
    after = _lm(engine)
    assert "active" not in after and after["layers_run"] == layers
    assert after["passes_cancelled"] == before["passes_cancelled"] + 1
    assert engine.loaded.ec.lent == 0
    assert engine.loaded.stager is None or not engine.loaded.stager.hold
    assert not engine.has_work()
    # nothing it left behind changes the next prompt, the same one included: its pages were
    # hashed when recorded but hold the first layers' K/V only (LayerMajorPass.abort)
    (got,) = run_engine(engine, [p["cancel"]], N_NEW)
    assert_same(got, case["ref"]["cancel"], "the cancelled 32k prompt, run again")
    after = _lm(engine)
    assert after["passes"] == before["passes"] + 2, after
    assert after["last_pass"]["tokens"] == len(p["cancel"]) - 1, after["last_pass"]


def test_a_decoding_stream_keeps_going_during_a_long_prefill(case, engine):
    """The short stream decodes one token per layer of the 32k pass: until the long prompt
    decodes with it, its tokens are its own run's (one row a step, as alone)."""
    from glm53.engine.sampling import SamplingParams
    from glm53.engine.scheduler import GenerationRequest

    p = case["prompts"]

    def start(key, ids):
        req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(temperature=0.0))
        engine.start(key, req, N_NEW, return_logits=True)

    start("short", p[SHORT])
    got = {"short": [], "long": []}
    for _ in bounded(iteration_limit([p[SHORT]], 2), lambda: f"the short stream's 2 tokens: {got}"):
        if len(got["short"]) >= 2:
            break
        for o in engine.iterate():
            assert o.finish != "error", o.error
            got[o.key] += o.token_ids
    start("long", p["stream"])
    during, passes = 0, _lm(engine)["passes"]
    limit = iteration_limit([p[SHORT], p["stream"]], N_NEW)
    for _ in bounded(limit, lambda: f"the short and long streams: {_lm(engine)}"):
        if not engine.has_work():
            break
        outs = engine.iterate()
        for o in outs:
            assert o.finish != "error", o.error
            got[o.key] += o.token_ids
        if not got["long"]:  # the long prompt has not decoded yet: the short one ran alone
            during += sum(len(o.token_ids) for o in outs if o.key == "short")
    lm = _lm(engine)
    assert lm["passes"] == passes + 1
    want = case["ref"][SHORT]["tokens"]
    layers = text_config(case["path"])["num_hidden_layers"]
    # a token in the iteration that recorded the prompt and one per layer of the pass after
    # it (the first step also runs the embedding), unless the stream ran out of tokens first
    assert during >= min(layers - 1, len(want) - 2), (during, lm)
    n_alone = 2 + during
    assert got["short"][:n_alone] == want[:n_alone], "the short stream's tokens while alone"
    assert 0 < lm["longest_decode_pause_s"] < lm["last_pass"]["seconds"], lm
