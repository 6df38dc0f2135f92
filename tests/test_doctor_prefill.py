"""The planner's prefill prediction per prompt length (glm53.doctor.prefill): the touched-expert
model, chunk-major against the layer-major path, the one-pass stream bound, and the
doctor's report (text and JSON) that carries them."""

import json
import math
from pathlib import Path

import msgspec
import pytest

from glm53.cli import main
from glm53.doctor.costmodel import CostInputs, Mode, _pick_rates, hit_fraction, vram_slots
from glm53.doctor.geometry import GLM53_FLASH, Geometry
from glm53.doctor.prefill import (
    LAYER_MAJOR_STATUS,
    PREFILL_PROMPTS,
    PrefillRow,
    predict_prefill,
    touched,
)

REF = Path(__file__).parent / "fixtures" / "doctor" / "reference-3090-epyc-raid0"
EB = 9_437_184
# the slice preset's geometry (tests/test_doctor_costmodel.py's _plan_geometry(SLICE))
SLICE = Geometry("slice", 8, 6, 288, 8, EB, 1_318_372_068, 3, 4096, 4)
DEEP = Geometry("deep", 45, 42, 64, 8, EB, 3_529_850_884, 3, 4096, 4)
# the seed's 3090 (24,233 MiB free, 700 tok/s of compute) and an H200 with 24 GiB free
RTX3090 = CostInputs(vram_slots=vram_slots(24_233, Mode.EXACT), pcie_gbps=25.0)
H200 = CostInputs(
    vram_slots=vram_slots(24 * 1024, Mode.EXACT), pcie_gbps=50.0, vram_gbps=4800.0,
    gpu_fp16_tflops=989.0,
)  # fmt: skip


def test_one_token_touches_top_k_experts_and_long_prompts_touch_them_all():
    rates = _pick_rates(GLM53_FLASH)
    assert sum(touched(rates, 1)) == pytest.approx(8.0)
    assert touched([1.0, 0.25, 0.0], 2) == [1.0, 1.0 - 0.75**2, 0.0]
    # the coldest expert's rate is the curve's last step: 8 x (hit(1) - hit(287/288))
    cold = 8 * (hit_fraction(1.0) - hit_fraction(287 / 288))
    assert rates[-1] == pytest.approx(cold)
    assert touched(rates, 512)[-1] == pytest.approx(1 - (1 - cold) ** 512)
    assert 0.35 < touched(rates, 512)[-1] < 0.37 and 0.83 < touched(rates, 2048)[-1] < 0.84
    assert 287.99 < sum(touched(rates, 8192)) < 288


@pytest.mark.parametrize("tokens", [512, 2048])
def test_a_prompt_of_one_chunk_predicts_the_same_both_ways(tokens):
    row = predict_prefill(H200, GLM53_FLASH, tokens)
    assert row.num_chunks == 1 and row.states_placement == "normal path"
    assert row.layer_major_tok_s == row.chunk_major_tok_s
    assert row.touched_per_layer_chunk == row.touched_per_layer_prompt


@pytest.mark.parametrize("geo", [GLM53_FLASH, SLICE, DEEP], ids=lambda g: g.name)
@pytest.mark.parametrize("x", [RTX3090, H200], ids=["3090", "h200"])
def test_layer_major_is_never_slower_than_chunk_major_and_never_above_compute(geo, x):
    rows = [predict_prefill(x, geo, n) for n in PREFILL_PROMPTS]
    for r in rows:
        assert r.chunk_major_tok_s <= r.layer_major_tok_s <= r.compute_tok_s, r
    longer = [r for r in rows if r.num_chunks > 1]
    # chunk-major streams the same experts every chunk: its rate does not grow with the prompt
    assert len({r.chunk_major_tok_s for r in longer}) == 1
    assert [r.layer_major_tok_s for r in longer] == sorted(r.layer_major_tok_s for r in longer)


def test_layer_major_lifts_the_full_model_to_its_compute_bound_on_the_reference_host():
    # seed-project.md §6.5: the 3090 computes 700 tok/s; chunk-major at 2,048 streams the
    # experts not in VRAM four times an 8k prompt, layer-major once
    row = predict_prefill(RTX3090, GLM53_FLASH, 8192)
    assert row.compute_tok_s == 700.0 and row.layer_major_tok_s == 700.0
    assert row.chunk_major_tok_s < 500.0
    assert (row.states_bytes, row.states_placement, row.states_pcie_bytes) == (
        512 << 20,
        "vram",
        0,
    )


def test_layer_major_pays_each_chunks_fixed_compute_cost():
    """Layer-major runs every chunk through a layer as its own forward, so with a measured
    fixed cost per chunk (the H200's: 8.56 ms a layer a chunk, 4.22 us a token) an 8k prompt
    at 2,048-token chunks computes four chunks' fixed costs, not one: on the slice that floor
    is what stock exllamav3 with every expert in VRAM measured at 8k in four chunks
    (13,805 and 15,062 tok/s, bench/results/h200-gpu_slice-2026-11-30*.json), below the
    one-pass stream bound, so the link is not the limit there."""
    x = CostInputs(vram_slots=197, pcie_gbps=50.0, prefill_chunk_ms=8.56, prefill_token_us=4.22,
                   stage_records=288)  # fmt: skip
    row = predict_prefill(x, SLICE, 8192)
    per_layer_s = 4 * (8.56e-3 + 2048 * 4.22e-6)
    assert row.compute_tok_s == pytest.approx(8192 / (8 * per_layer_s), rel=1e-4)
    assert row.layer_major_tok_s == row.compute_tok_s  # compute-bound at 2,048-token chunks
    assert 13_805 / 1.15 < row.compute_tok_s < 15_062 * 1.15
    assert row.layer_major_tok_s < 0.6 * row.stream_once_tok_s
    one_chunk = predict_prefill(x, SLICE, 8192, chunk_tokens=8192)
    assert one_chunk.compute_tok_s == pytest.approx(
        8192 / (8 * (8.56e-3 + 8192 * 4.22e-6)), rel=1e-4
    )


def _link_bound(slots: int) -> CostInputs:
    return CostInputs(vram_slots=slots, pcie_gbps=50.0, gpu_fp16_tflops=1e12)  # compute ~ 0


def test_link_bound_layer_major_meets_the_one_pass_bound_when_the_cache_only_holds_the_states():
    # an 8k prompt's 512 MiB of states take ceil(2^29 / 9,437,184) = 57 slots: with 57 slots
    # nothing else is resident, so each touched expert crosses exactly once
    row = predict_prefill(_link_bound(57), SLICE, 8192)
    assert row.states_placement == "vram"
    assert row.layer_major_tok_s == pytest.approx(row.stream_once_tok_s, rel=1e-4)


def test_pinned_states_add_one_read_and_one_write_per_layer():
    # 32k: 2 GiB of states, 29 slots (two 2,048-token chunk buffers, 256 MiB): pinned, and
    # nothing resident. Link per layer: the slice's 2 dense layers carry the states only (layer
    # 0 writes, layer 1 reads and writes), its 6 MoE layers the experts plus the states read
    row = predict_prefill(_link_bound(29), SLICE, 32768)
    assert row.states_placement == "pinned" and row.states_bytes == 2 << 30
    assert row.states_pcie_bytes == 2 * 7 * (2 << 30)
    once_s = 32768 / row.stream_once_tok_s
    states_s = 8 * (2 << 30) / 50e9
    assert 32768 / row.layer_major_tok_s == pytest.approx(once_s + states_s, rel=1e-4)


def test_without_room_for_the_chunk_buffers_layer_major_is_not_predicted():
    row = predict_prefill(_link_bound(10), SLICE, 32768)
    assert row.layer_major_tok_s is None and row.states_placement == "no VRAM room"
    assert row.states_bytes == 2 << 30 and row.chunk_major_tok_s > 0


def run_json(capsys, *args) -> dict:
    assert main(["doctor", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_json_gives_every_mode_its_prefill_outlook(capsys):
    doc = run_json(capsys, "--replay", str(REF))
    feasible = [o for o in doc["plan"]["options"] if o["feasible"]]
    assert {o["mode"] for o in feasible} == {"exact", "fast", "nvme", "nvme-exact"}
    for o in feasible:
        outlook = o["prefill"]
        assert outlook["chunk_tokens"] == 2048
        assert outlook["layer_major"] == LAYER_MAJOR_STATUS
        assert "6 GPU tests passed (H200, 2026-12-05)" in outlook["layer_major"]
        assert "no --allow-unrun-modes needed" in outlook["layer_major"]
        assert "in exact, nvme-exact or nvme mode" in outlook["layer_major"]
        assert "needs the flag" not in outlook["layer_major"]
        assert [r["prompt_tokens"] for r in outlook["rows"]] == [512, 2048, 8192, 32768, 131072]
        assert set(outlook["rows"][0]) == set(PrefillRow.__struct_fields__)
    exact = next(o for o in feasible if o["mode"] == "exact")
    row8k = exact["prefill"]["rows"][2]
    assert row8k["layer_major_tok_s"] > row8k["chunk_major_tok_s"]
    assert row8k["states_placement"] == "vram" and row8k["states_bytes"] == 512 << 20


def test_doctor_report_labels_layer_major_with_its_status(capsys):
    assert main(["doctor", "--replay", str(REF)]) == 0
    out = capsys.readouterr().out
    assert "Prefill of fast by prompt length (predicted tok/s, 2,048-token chunks)" in out
    assert "layer-major*" in out
    text = " ".join(out.split())
    assert "its 6 GPU tests passed (H200, 2026-12-05)" in text
    assert "--prefill layer-major on one GPU in exact, nvme-exact or nvme mode" in text


def test_nvme_prefill_reads_the_store_once_per_layer_in_layer_major_order():
    x = CostInputs(
        vram_slots=1205, pcie_gbps=25.0, ram_tier_slots=3819, store_gbps=6.7, store_latency_ms=1.3
    )
    row = predict_prefill(x, GLM53_FLASH, 32768)
    # the same tier with a store that costs nothing: what the store adds, apart
    free = predict_prefill(msgspec.structs.replace(x, store_gbps=1e12, store_latency_ms=0.0),
                           GLM53_FLASH, 32768)  # fmt: skip
    ram = predict_prefill(CostInputs(vram_slots=1205, pcie_gbps=25.0), GLM53_FLASH, 32768)
    # the store adds to both orders; chunk-major pays it sixteen times, layer-major once
    assert (
        row.chunk_major_tok_s < free.chunk_major_tok_s
        and row.layer_major_tok_s < free.layer_major_tok_s
    )
    chunk_extra = 32768 / row.chunk_major_tok_s - 32768 / free.chunk_major_tok_s
    layer_extra = 32768 / row.layer_major_tok_s - 32768 / free.layer_major_tok_s
    assert chunk_extra == pytest.approx(16 * layer_extra, rel=0.05)
    # in the store modes a pass reads each chunk's picks zero-copy (unstaged): the link is
    # paid per chunk, as chunk-major pays it, not once as exact mode's staged pass does
    assert free.layer_major_tok_s < ram.layer_major_tok_s
    assert free.layer_major_tok_s == pytest.approx(free.chunk_major_tok_s, rel=0.15)
    assert math.isfinite(row.stream_once_tok_s)


# the H200 as docs/layer-major.md's table has it: its compute measured (h200-test.toml's
# prefill_chunk_ms and prefill_token_us) and its copy-engine stage of whole layers
H200_MEASURED = msgspec.structs.replace(
    H200, prefill_chunk_ms=8.56, prefill_token_us=4.22, stage_records=288
)


def test_the_docs_prediction_table_is_what_the_planner_predicts():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "layer-major.md").read_text()
    table = doc[doc.index("Predicted tok/s, full model") :]
    assert (RTX3090.vram_slots, H200.vram_slots) == (1372, 1410)
    import tomllib

    root = Path(__file__).resolve().parents[1]
    host = tomllib.loads((root / "glm53/doctor/hosts/h200-test.toml").read_text())
    gpu = host["gpu"]
    assert (gpu["prefill_chunk_ms"]["value"], gpu["prefill_token_us"]["value"]) == (
        H200_MEASURED.prefill_chunk_ms,
        H200_MEASURED.prefill_token_us,
    )
    for tokens in (512, 2048, 8192, 32768, 131072):
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {tokens:,} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        want = [f"{tokens:,}"]
        for x in (RTX3090, H200_MEASURED):
            r = predict_prefill(x, GLM53_FLASH, tokens)
            if x is RTX3090:
                want.append(f"{r.touched_per_layer_chunk:.1f} / {r.touched_per_layer_prompt:.1f}")
            rates = (r.chunk_major_tok_s, r.layer_major_tok_s, r.stream_once_tok_s, r.compute_tok_s)
            want += [f"{v:,.0f}" for v in rates]
        assert cells == want, tokens
