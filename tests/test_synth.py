import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from glm53.models.checkpoint import MUL1_MARKER, Checkpoint
from glm53.models.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS, token_ids
from glm53.synth import cli as synth_cli
from glm53.synth.layout import plan, text_config
from glm53.synth.shapes import DEMO, SLICE, preset
from glm53.synth.writer import CHAT_TEMPLATE_PATH, SynthWriter, write_checkpoint


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


def _all(groups):
    return [t for g in groups for t in g]


def test_plan_reproduces_the_layouts_exllamav3_loaded_on_the_gpu():
    # facts/exllamav3-glm5next-checkpoint.md: the two random checkpoints that loaded and
    # generated with exllamav3 1.6.5 (vocab 4096, lm_head K=3): tensor counts and data bytes
    slice_ = replace(SLICE, vocab_size=4096, head_bits=3)
    tiny = replace(
        slice_,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
    )
    for shape, count, nbytes in ((slice_, 21086, 17117825404), (tiny, 1502, 153794428)):
        specs = _all(plan(shape))
        assert (len(specs), sum(t.nbytes for t in specs)) == (count, nbytes)


def test_every_quantized_dim_of_both_presets_is_a_multiple_of_128():
    for shape in (DEMO, SLICE):
        for spec in _all(plan(shape)):
            if spec.key.endswith(".trellis"):
                assert (16 * spec.shape[0]) % 128 == 0 and (16 * spec.shape[1]) % 128 == 0, spec


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(demo_dir, tmp_path):
    again = tmp_path / "again"
    write_checkpoint(preset("demo"), again, seed=0, routing_source="stand-in")
    names = sorted(p.name for p in demo_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (demo_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = tmp_path / "other"
    write_checkpoint(
        preset("demo", num_layers=1, num_dense_layers=1), other, seed=1, routing_source="stand-in"
    )
    first = Checkpoint(demo_dir).read("model.language_model.layers.0.self_attn.qkv_proj.trellis")
    assert not np.array_equal(
        first, Checkpoint(other).read("model.language_model.layers.0.self_attn.qkv_proj.trellis")
    )


def test_transformers_reads_the_config_as_glm5_next(demo_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(demo_dir)
    assert type(config).__name__ == "Glm5NextConfig"
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.n_routed_experts) == (256, 8, 32)
    assert text.layer_types == ["linear_attention"] * 3 + ["indexed_attention"] + [
        "linear_attention"
    ] * 3 + ["indexed_attention"]
    assert text.mlp_layer_types == ["dense"] * 2 + ["sparse"] * 6
    assert (text.routed_scaling_factor, text.swiglu_limit, text.index_kpool) == (2.5, 10.0, 4)
    assert (text.linear_num_heads, text.linear_head_dim, text.linear_lower_bound) == (2, 128, -5.0)


def test_config_carries_what_exllamav3_requires(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["vision_config"]["model_type"] == "glm5_next_vision"
    assert (config["image_start_token_id"], config["image_end_token_id"]) == (10, 11)
    processor = json.loads((demo_dir / "processor_config.json").read_text())
    assert processor["image_processor"]["image_processor_type"] == "Glm5NextImageProcessor"
    text = config["text_config"]
    assert set(text["layer_types"]) == {"linear_attention", "deepseek_sparse_attention"}
    assert text["eos_token_id"] == [0, 7, 9] and text["pad_token_id"] == 0


def test_tokenizer_has_the_glm_tokens_at_fixed_ids_and_keeps_markup_when_decoding(demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert len(tok) == 2048
    for i, name in enumerate(SPECIAL_TOKENS + MARKUP_TOKENS):
        assert tok.convert_tokens_to_ids(name) == i
    text = "[gMASK]<sop><|user|>hi<|assistant|><think>ok</think><tool_call>f<arg_key>a</arg_key>"
    ids = tok(text)["input_ids"]
    assert ids[:3] == [2, 4, 7]
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "hi<think>ok</think><tool_call>f<arg_key>a</arg_key>"
    )
    assert tok.decode(ids) == text


def test_chat_template_is_the_projects_own(demo_dir):
    template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert (demo_dir / "chat_template.jinja").read_text(encoding="utf-8") == template
    assert json.loads((demo_dir / "tokenizer_config.json").read_text())["chat_template"] == template


def test_weights_follow_the_sane_random_recipe(demo_dir):
    ckpt = Checkpoint(demo_dir)
    p = "model.language_model.layers.4"
    suh = ckpt.read(f"{p}.self_attn.qkv_proj.suh").astype(np.float32)
    np.testing.assert_allclose(np.abs(suh), 256**-0.25, rtol=1e-3)
    assert 0.4 < (suh > 0).mean() < 0.6
    assert ckpt.read(f"{p}.self_attn.o_proj.mul1") == MUL1_MARKER
    base = ckpt.read(f"{p}.hc_ffn_base")
    np.testing.assert_array_equal(base, np.r_[np.zeros(8), 2 * np.eye(4).ravel()])
    a_log = ckpt.read(f"{p}.self_attn.A_log")
    assert a_log.dtype == np.float32 and a_log.min() >= 0 and a_log.max() <= np.log(16)
    assert ckpt.info(f"{p}.self_attn.q_conv1d.weight").dtype == "BF16"
    assert ckpt.info(f"{p}.mlp.gate.weight").dtype == "F16"
    assert ckpt.info(f"{p}.mlp.gate.e_score_correction_bias").dtype == "F32"
    router = ckpt.read_f32(f"{p}.mlp.gate.weight")
    assert abs(router.std() - 256**-0.5) < 0.1 * 256**-0.5


def test_tiny_slice_override_keeps_the_real_widths(tmp_path):
    shape = preset("slice", num_layers=1, num_dense_layers=0, num_experts=8)
    write_checkpoint(shape, tmp_path / "slice", seed=0, routing_mode="uniform")
    ckpt = Checkpoint(tmp_path / "slice")
    p = "model.language_model.layers.0"
    assert ckpt.info(f"{p}.self_attn.qkv_proj.trellis").shape == (256, 1536, 48)
    assert ckpt.info(f"{p}.self_attn.f_b_proj.weight").shape == (8192, 128)
    gate, up, down = ckpt.experts(0)[7].linears
    assert (gate.in_features, gate.out_features, down.in_features) == (4096, 2048, 2048)
    assert ckpt.experts(0)[7].nbytes == 9474060


def test_cli_writes_a_checkpoint_and_prints_the_routing_curve(tmp_path, capsys):
    out = tmp_path / "cli"
    parser = argparse.ArgumentParser(prog="glm53")
    synth_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "synth",
            "--preset",
            "demo",
            "--out",
            str(out),
            "--layers",
            "3",
            "--dense-layers",
            "2",
            "--seed",
            "5",
            "--routing-source",
            "stand-in",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"wrote demo checkpoint to {out}" in printed
    assert "routing glm53 measured on stand-in inputs" in printed and "layer   2:" in printed
    assert Checkpoint(out).moe_layers == [2]


def test_writer_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError) as err:
        write_checkpoint(preset("demo"), tmp_path)
    assert str(err.value) == f"{tmp_path} is not empty; pass a new or empty directory"


def test_overrides_are_validated():
    with pytest.raises(ValueError) as err:
        preset("demo", num_experts_per_tok=40)
    assert str(err.value) == "top-k 40 must lie in [1, experts 32]"


def test_demo_routing_follows_the_glm53_curve_on_its_own_greedy_decode(tmp_path):
    out = tmp_path / "demo"
    report = write_checkpoint(preset("demo"), out, seed=0)
    assert report.source == "greedy decode" and sorted(report.curves) == [2, 3, 4, 5, 6, 7]
    target = (0.735, 0.907, 0.984)
    for layer, curve in report.curves.items():
        assert curve.num_picks == 2 * 128 * 4
        assert curve.max_error(target) <= 0.05, (layer, str(curve))
    ckpt = Checkpoint(out)
    hottest = [
        set(
            np.argsort(
                ckpt.read(f"model.language_model.layers.{i}.mlp.gate.e_score_correction_bias")
            )[-8:]
        )
        for i in report.curves
    ]
    assert all(a != b for i, a in enumerate(hottest) for b in hottest[i + 1 :])


def test_uniform_routing_is_flat_on_stand_in_inputs(tmp_path):
    report = write_checkpoint(
        preset("demo", num_layers=3),
        tmp_path / "u",
        routing_mode="uniform",
        routing_source="stand-in",
    )
    # sorting an empirical distribution always tilts it a little above flat; what matters is
    # that it is nowhere near the glm53 skew (73.5 / 90.7 / 98.4 %)
    for curve in report.curves.values():
        assert curve.shares[0] < 0.45 and curve.shares[1] < 0.72 and curve.shares[2] < 0.9, str(
            curve
        )


def test_deep_plan_is_the_real_layer_cycle_at_the_fact_sheet_block_sizes():
    # facts/exllamav3-glm5next-checkpoint.md §4 "Sizes at K = 3" (vocab 4096, lm_head K=3): the
    # block sizes of the layouts that loaded on the H200, composed for 45 layers
    deep = replace(preset("deep"), vocab_size=4096, head_bits=3)
    kda, dsa, dense, router_shared, expert, norms_hc, ends = (
        57_459_464, 76_136_980, 56_721_420, 11_834_508, 9_474_060, 3_162_328, 39_870_468,
    )  # fmt: skip
    # the router row of each of the 288 -> 64 experts goes too: fp16 [E, H] + fp32 bias [E]
    router_shared -= (288 - 64) * (2 * 4096 + 4)
    want = 34 * kda + 11 * dsa + 3 * dense + 42 * (router_shared + 64 * expert)
    want += 45 * norms_hc + ends
    assert sum(t.nbytes for t in _all(plan(deep))) == want
    text = text_config(deep, token_ids())
    assert [i for i, t in enumerate(text["layer_types"]) if t != "linear_attention"] == list(
        range(3, 45, 4)
    )
    assert text["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 42
    assert (text["n_routed_experts"], text["num_experts_per_tok"]) == (64, 8)


def test_deep_preset_on_disk_at_64_and_96_experts():
    # what `glm53 synth --preset deep [--experts N]` writes: data bytes of every tensor
    sizes = {n: sum(t.nbytes for t in _all(plan(preset("deep", num_experts=n)))) for n in (64, 96)}
    assert sizes == {64: 29_012_901_380, 96: 41_757_053_444}


def test_cli_deep_preset_takes_an_expert_count(tmp_path):
    parser = argparse.ArgumentParser(prog="glm53")
    synth_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["synth", "--preset", "deep", "--out", str(tmp_path), "--experts", "96"]
    )
    shape = preset(args.preset, num_experts=args.experts)
    assert (shape.num_layers, len(shape.moe_layers), shape.num_experts) == (45, 42, 96)


def test_deep_shaped_tiny_checkpoint_reads_back_with_its_42_moe_layers(tmp_path):
    # the deep cycle at the demo's widths, router left uncalibrated (the layout is under test)
    shape = replace(DEMO, name="deep-tiny", num_layers=45, num_dense_layers=3, num_experts=8)
    (tmp_path / "d").mkdir()
    writer = SynthWriter(shape, 0, tmp_path / "d")
    writer.write_metadata()
    writer.write_shards(64 << 20)
    ckpt = Checkpoint(tmp_path / "d")
    assert ckpt.moe_layers == list(range(3, 45))
    dsa = "model.language_model.layers.43.self_attn.kv_b_proj.weight"
    assert ckpt.info(dsa).shape == (1024, 512)
    assert len(ckpt.experts(44)) == 8


def test_shards_written_by_worker_processes_have_the_same_bytes(tmp_path):
    shape = preset("demo", num_layers=3)
    for jobs in (1, 2):
        writer = SynthWriter(shape, 7, tmp_path / f"j{jobs}")
        writer.out_dir.mkdir()
        writer.overrides["model.language_model.layers.2.mlp.gate.e_score_correction_bias"] = (
            np.arange(32, dtype=np.float32)
        )
        writer.write_metadata()
        writer.write_shards(2 << 20, jobs)
    names = sorted(p.name for p in (tmp_path / "j1").iterdir() if p.suffix == ".safetensors")
    assert len(names) > 2 and names == sorted(p.name for p in (tmp_path / "j2").iterdir()
                                              if p.suffix == ".safetensors")  # fmt: skip
    for name in names:
        assert (tmp_path / "j1" / name).read_bytes() == (tmp_path / "j2" / name).read_bytes()
    bias = Checkpoint(tmp_path / "j2").read(
        "model.language_model.layers.2.mlp.gate.e_score_correction_bias"
    )
    np.testing.assert_array_equal(bias, np.arange(32, dtype=np.float32))


def test_synth_imports_only_models_and_nothing_below_imports_synth():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "glm53"

    def glm53_imports(path):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                yield node.module
            elif isinstance(node, ast.Import):
                yield from (a.name for a in node.names)

    for path in (root / "synth").glob("*.py"):
        for name in glm53_imports(path):
            if name.startswith("glm53"):
                assert name.startswith(("glm53.models", "glm53.synth")), (path.name, name)
    for below in ("models", "tiers"):
        for path in (root / below).rglob("*.py"):
            assert not any(n.startswith("glm53.synth") for n in glm53_imports(path)), path
