"""The GPU engine through the Engine protocol (the scheduler's view): exact mode against
stock exllamav3 driven by the same step code, and against exllamav3's own Generator."""

import os

import pytest
import torch

pytest.importorskip("exllamav3")
pytest.importorskip("glm53._cuda")

from glm53.engine.base import StreamWork  # noqa: E402
from glm53.engine.gpu import GpuEngine  # noqa: E402

DEMO = os.environ.get("GLM53_TEST_DEMO")
pytestmark = pytest.mark.skipif(
    not DEMO or not os.path.isfile(os.path.join(DEMO, "config.json")),
    reason="GLM53_TEST_DEMO does not name a synthetic demo checkpoint",
)


def greedy(engine, prompts, n_new, chunk=300):
    """Prefill every prompt in chunks (one slot each), then decode all slots together."""
    seqs = {s: list(p) for s, p in enumerate(prompts)}
    logits_seen = {s: [] for s in seqs}
    for s, p in enumerate(prompts):
        for start in range(0, len(p), chunk):
            last = start + chunk >= len(p)
            out = engine.step([StreamWork(s, p[start : start + chunk], start, last)])
            if last:
                logits_seen[s].append(out[0])
                seqs[s].append(int(out[0].argmax()))
    for _ in range(n_new - 1):
        work = [StreamWork(s, [seq[-1]], len(seq) - 1, True) for s, seq in seqs.items()]
        out = engine.step(work)
        for row, s in enumerate(seqs):
            logits_seen[s].append(out[row])
            seqs[s].append(int(out[row].argmax()))
    return {s: seqs[s][len(prompts[s]) :] for s in seqs}, logits_seen


@pytest.fixture(scope="module")
def engines():
    stock = GpuEngine(DEMO, "stock", context=4096, max_batch=4)
    stock.load()
    n_keys = len(stock.loaded.geometry.moe_layers) * stock.loaded.geometry.n_experts
    # enough slots that a 3-stream decode step (3 x top-k picks per layer) leaves hits behind
    exact = GpuEngine(DEMO, "exact", context=4096, max_batch=4, ec_max_slots=n_keys // 2,
                      heat_file="/tmp/glm53-test-heat.json")  # fmt: skip
    if os.path.exists(exact.heat_file or ""):
        os.remove(exact.heat_file)
    exact.load()
    yield stock, exact
    exact.close()
    stock.close()


def test_exact_engine_matches_stock_bit_for_bit(engines):
    stock, exact = engines
    vocab = stock.tokenizer.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (700, 40, 130)]
    tok_a, log_a = greedy(stock, prompts, 96)
    tok_b, log_b = greedy(exact, prompts, 96)
    assert tok_a == tok_b
    for s in log_a:
        assert all(torch.equal(x, y) for x, y in zip(log_a[s], log_b[s], strict=True))
    st = exact.stats()["tiers"]["vram_cache"]
    assert st["admits"] > 0 and st["hits"] > 0
    for s in range(3):
        stock.release(s)
        exact.release(s)


def _kl_top1(p_logits, q_logits):
    """Per-position KL(p || q) of the softmaxes and whether the argmaxes agree."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl, (p_logits.argmax(-1) == q_logits.argmax(-1)).float()


def _generator_run(prompt, n_new):
    """Greedy tokens and per-step logits from exllamav3's own Generator, on a separately loaded
    copy of the model (a Generator takes over its cache, and captured graphs bake the addresses
    they were built with, so it must not share the engine's model)."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    from glm53.engine import exl3_load

    ref = exl3_load.load(DEMO, "stock", cache_tokens=4096, max_batch=1)
    try:
        gen = Generator(model=ref.model, cache=ref.cache, tokenizer=ref.tokenizer, max_batch_size=1)
        gen.enqueue(
            Job(input_ids=torch.tensor([prompt]), max_new_tokens=n_new, sampler=ArgmaxSampler(),
                stop_conditions=[], return_logits=True)
        )  # fmt: skip
        ids, logits = [], []
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if "token_ids" in r:
                    ids += r["token_ids"].reshape(-1).tolist()
                if "logits" in r:
                    logits.append(r["logits"].reshape(-1, r["logits"].shape[-1]).float().cpu())
    finally:
        ref.close()
    return ids, torch.cat(logits)


def test_engine_decode_agrees_with_exllamav3_generator_and_forward(engines, record_property):
    """The step engine (paged KV, per-slot KDA state, prefill then one-row decode steps) against
    exllamav3's own Generator on the same prompt, and both against exllamav3's cache-free forward
    over the finished sequence. Paged decode and a full forward use different kernels and round
    differently (the H200 runs measured engine-vs-forward KL 0.011 on the demo model, and the
    Generator's own logits differ from the engine's by up to 0.13 with identical tokens), so the
    engine is held to what exllamav3 itself achieves: the same tokens as the Generator, no further
    from the forward than the Generator is, and far closer to the Generator than a forward whose
    first 300 prompt tokens are redrawn (what a state lost across steps would look like)."""
    stock, _ = engines
    vocab = stock.tokenizer.vocab_size
    n_new = 24
    prompt = torch.randint(0, vocab, (500,), generator=torch.Generator().manual_seed(3)).tolist()
    toks, logits = greedy(stock, [prompt], n_new, chunk=2048)
    stock.release(0)
    eng = torch.stack(logits[0])
    gen_ids, gen = _generator_run(prompt, n_new)
    gen = gen[:, : eng.shape[-1]]
    seq = prompt + toks[0][:-1]
    other = torch.randint(0, vocab, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        fwd = stock.loaded.model.forward
        ref = fwd(torch.tensor([seq]), {})[0, len(prompt) - 1 :].float().cpu()
        alt = fwd(torch.tensor([other + seq[300:]]), {})[0, len(prompt) - 1 :].float().cpu()
    assert eng.shape == gen.shape == ref.shape == alt.shape
    kl_eng, top_eng = _kl_top1(eng, ref)
    kl_gen, top_gen = _kl_top1(gen, ref)
    kl_eg, _ = _kl_top1(eng, gen)
    kl_alt, top_alt = _kl_top1(alt, ref)
    figures = {
        "kl_engine_forward_mean": kl_eng.mean().item(),
        "kl_generator_forward_mean": kl_gen.mean().item(),
        "kl_engine_generator_mean": kl_eg.mean().item(),
        "kl_context_changed_mean": kl_alt.mean().item(),
        "max_abs_engine_generator": (eng - gen).abs().amax().item(),
        "top1_engine_forward": top_eng.mean().item(),
        "top1_generator_forward": top_gen.mean().item(),
        "top1_context_changed": top_alt.mean().item(),
        "ref_logit_std": ref.std(-1).mean().item(),
    }
    for k, v in figures.items():
        record_property(k, round(v, 6))
    assert toks[0] == gen_ids, (toks[0], gen_ids, figures)
    assert figures["kl_engine_forward_mean"] <= 2 * figures["kl_generator_forward_mean"] + 1e-4, (
        figures
    )
    assert figures["kl_engine_generator_mean"] < 0.25 * figures["kl_context_changed_mean"], figures


def test_heat_list_round_trip(engines):
    _, exact = engines
    path = exact.save_heat()
    import json

    keys = json.load(open(path))["keys"]
    assert keys and len(keys) <= exact.loaded.ec.n_slots
