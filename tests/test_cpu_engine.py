"""The CPU engine against transformers' own glm5_next model with every expert dense.

Tolerance of the parity test: the two models share every non-expert weight (the same dense fp32
decode) and the same torch ops, so they differ only in rounding: (1) the routed experts: the
lane runs y = had(had(x * suh) @ Wq) * svh in fp32 straight from the trellis, transformers runs
one fp32 GEMM with W = diag(suh) H Wq H diag(svh) rounded once to fp32, and the two sum each
row's picks in different orders; (2) KDA prefill: the engine runs transformers' chunked form in
chunks of 16 tokens, the reference in its default 64 (the form is exact in exact arithmetic;
against the fp64 token-by-token recurrence chunk 16 is the closer of the two, see
glm53/engine/cpu.py); (3) DSA keys/values: the engine expands each latent once, the reference
re-expands the whole cache per step (the same rows of one GEMM). Each of those is a few fp32
roundings (2^-24 relative) per value; carried through 8 layers, the mHC mixes and the head they
stay within a few 1e-6 of the logits' scale (measured on this machine: 2.9e-6 over the prompt's
positions, 1.6e-6 over 16 decode steps; 1.2e-6 before (2) and (3)). The test allows 2e-5 of the
largest logit, ~170 fp32 ulps, far below what a wrong expert, weight or pick would change
(order 1e-1).
"""

import pytest
import torch

from glm53.engine.base import EngineError, StreamWork
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions
from glm53.models import hf_expand, hf_text
from glm53.models.checkpoint import Checkpoint
from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint

PROMPT = (
    "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>How far away is the moon, and why does "
    "the sky look blue?<|assistant|><think>"
)
REL_TOL = 2e-5
FAST_LOGIT_TOL = 2e-3  # median over positions, --ct-precision fast (see its test)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


@pytest.fixture(scope="module")
def engine(demo):
    eng = CpuEngine(demo, CpuEngineOptions(max_batch=2, cpu_threads=1))
    eng.load()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(demo):
    ckpt = Checkpoint(demo)
    return hf_text.build_text_model(ckpt), hf_text.lm_head_weight(ckpt)


def _ref_logits(reference, ids, cache=None):
    model, head = reference
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=cache is not None)
    return hidden.last_hidden_state[0] @ head.T


def test_prefill_logits_match_transformers_with_dense_experts(engine, reference):
    ids = engine.tokenizer.encode(PROMPT)
    ours = engine.forward_all(ids)
    ref = _ref_logits(reference, ids)
    assert ours.shape == ref.shape == (len(ids), 2048)
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_decode_with_caches_matches_transformers(engine, reference):
    from transformers import DynamicCache

    ids = engine.tokenizer.encode(PROMPT)
    ours_cache, ref_cache = engine.new_cache(), DynamicCache(config=reference[0].config)
    ours = engine.forward(ids, ours_cache)
    ref = _ref_logits(reference, ids, ref_cache)[-1]
    for _ in range(4):
        assert (ours - ref).abs().max() <= REL_TOL * ref.abs().max()
        token = int(ref.argmax())
        ours = engine.forward([token], ours_cache)
        ref = _ref_logits(reference, [token], ref_cache)[-1]
    assert (ours - ref).abs().max() <= REL_TOL * ref.abs().max()


def test_a_ram_cap_below_all_experts_gives_the_same_logits(demo, engine):
    record = engine.tier.slot_bytes
    # 10 records: more than one decode step's working set at 2 streams (top-4 x 2), far fewer
    # than a prefill touches, which runs in waves
    small = CpuEngine(demo, CpuEngineOptions(max_batch=2, cpu_threads=1, ram_cap=10 * record))
    small.load()
    try:
        assert small.tier.num_slots == 10 < engine.tier.num_slots == 6 * 32
        ids = engine.tokenizer.encode(PROMPT)
        assert torch.equal(small.forward_all(ids), engine.forward_all(ids))
        layers = small.stats()["tiers"]["layers"]
        assert sum(c["misses"] for c in layers.values()) > 10
        assert small.stats()["tiers"]["ram"]["evictions"] > 0
    finally:
        small.close()


def test_greedy_decoding_has_spread_and_does_not_collapse(engine):
    cache = engine.new_cache()
    logits = engine.forward(engine.tokenizer.encode(PROMPT), cache)
    tokens = []
    for _ in range(24):
        assert torch.isfinite(logits).all() and logits.std() > 0.3
        tokens.append(int(logits.argmax()))
        logits = engine.forward([tokens[-1]], cache)
    assert len(set(tokens)) >= 12


def test_step_runs_streams_in_their_own_slots(engine):
    ids = engine.tokenizer.encode(PROMPT)
    alone = engine.forward(ids + [100], engine.new_cache())
    logits = engine.step([StreamWork(0, ids[:10], 0, False), StreamWork(1, [5, 6, 7], 0, True)])
    assert logits.shape == (1, 2048)
    logits = engine.step([StreamWork(0, ids[10:] + [100], 10, True)])
    # chunked prefill regroups the KDA chunks and attention sums: equal up to fp32 rounding
    assert (logits[0] - alone).abs().max() <= REL_TOL * alone.abs().max()
    stats = engine.stats()
    assert set(stats["tiers"]["layers"]) == {"2", "3", "4", "5", "6", "7"}
    assert stats["tiers"]["layers"]["2"]["lane_jobs"] > 0


def test_step_rejects_a_position_the_slot_does_not_hold(engine):
    engine.step([StreamWork(1, [5, 6, 7], 0, False)])
    with pytest.raises(EngineError) as err:
        engine.step([StreamWork(1, [8], 5, True)])
    assert str(err.value) == "slot 1: work starts at position 5 but the slot holds 3 tokens"
    assert err.value.slots == (1,)


def test_experts_read_from_a_packed_store_give_the_same_logits(demo, engine, tmp_path):
    from glm53.store.pack import pack

    pack(demo, tmp_path / "store", include_mtp=False, threads=1, io_threads=2)
    options = CpuEngineOptions(
        cpu_threads=1, ram_cap=20 * engine.tier.slot_bytes, store=tmp_path / "store"
    )
    stored = CpuEngine(demo, options)
    stored.load()
    try:
        assert stored.tier.source.describe().startswith(f"expert store {tmp_path / 'store'}")
        ids = engine.tokenizer.encode(PROMPT)
        assert torch.equal(stored.forward_all(ids), engine.forward_all(ids))
    finally:
        stored.close()


def test_dsa_keys_and_values_are_expanded_once_per_position(engine):
    ids = engine.tokenizer.encode(PROMPT)
    cache = engine.new_cache()
    engine.forward(ids, cache)
    tokens = [101, 102, 103]
    for token in tokens:
        last = engine.forward([token], cache)
    dsa = [
        i for i, layer in enumerate(engine.model.layers) if layer.block_type != "linear_attention"
    ]
    assert dsa == [3, 7]
    for i in dsa:
        assert cache.layers[i]._glm53_expanded.length == len(ids) + len(tokens)
    # the same positions expanded all at once (no cache: no memo)
    whole = engine.forward_all(ids + tokens)[-1]
    assert (last - whole).abs().max() <= REL_TOL * whole.abs().max()
    # a layer whose memo would exceed its budget expands its whole cache every step instead
    attn = engine.model.layers[3].self_attn
    attn.glm53_expand_max_bytes = 0
    try:
        cache = engine.new_cache()
        engine.forward(ids, cache)
        for token in tokens:
            again = engine.forward([token], cache)
        assert cache.layers[3]._glm53_expanded is None
        assert cache.layers[7]._glm53_expanded.length == len(ids) + len(tokens)
        assert (again - whole).abs().max() <= REL_TOL * whole.abs().max()
    finally:
        attn.glm53_expand_max_bytes = hf_expand.DEFAULT_MAX_BYTES


def test_a_fast_lane_stays_near_transformers(demo, engine, reference):
    # --ct-precision fast: the lane's unrounded codebook and int16 inputs (pyx/gemv_fast.h) move
    # each MoE output by ~4e-4 of its scale (measured per layer on this checkpoint: 3.2e-4 to
    # 4.2e-4). Most positions' logits move by about as much; where a router's top-k sits on a
    # near tie the perturbation can flip a pick, and that position's logits move far more
    # (measured: median 4e-4, max 0.18, top-1 agreement 32 of 33 positions)
    fast = CpuEngine(demo, CpuEngineOptions(cpu_threads=1, lane_precision="fast"))
    fast.load()
    try:
        assert " fast, " in fast.lane.describe()
        ids = engine.tokenizer.encode(PROMPT)
        ref = _ref_logits(reference, ids)
        ours = fast.forward_all(ids)
        err = (ours - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
        top1 = (ours.argmax(dim=1) == ref.argmax(dim=1)).float().mean()
        assert float(err.median()) < FAST_LOGIT_TOL and float(top1) >= 0.9
    finally:
        fast.close()
