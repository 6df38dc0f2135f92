"""The planner's cost model against the seed's published geometry and measurements."""

import pytest

from glm53.doctor.costmodel import (
    GIB,
    POPULARITY_LAMBDA,
    POPULARITY_POINTS,
    TOTAL_EXPERTS,
    CostInputs,
    Mode,
    expert_trellis_bytes,
    hit_fraction,
    nvme_process_bytes,
    predict,
    ram_tier_slots,
    store_record_bytes,
    store_total_bytes,
    vram_slots,
)

# ---- inputs of the reference-host predictions, all from ../shared (facts and seeds) ------------
# The seed's reference host: RTX 3090 on PCIe 4.0 x16, EPYC 7443P (24 cores), 8-channel DDR4,
# 4x Samsung 9100 PRO in md RAID0 (seed-project.md §1.8).
REF_FREE_VRAM_MIB = 24_233  # an idle headless 24 GiB RTX 3090 (nvidia-smi memory.free)
PCIE_GBPS = (
    25.0  # seeds/001-readme-english.md: "on the measured link, cache misses use about 25 GB/s"
)
FAST_LANE = (0.11, 0.104)  # seed-project.md §3.5: GLM53_CT_A, GLM53_CT_B at 22 threads
NVME_LANE = (0.145, 0.165)  # seed-project.md §3.6: GLM53_NV_POL ca, cb (in-place lane)
STORE_GBPS = 9_437_184 / 0.395e6  # §3.6: nvdeep, 0.395 ms per record in a deep queue
STORE_LATENCY_MS = 1.3  # §4.3: mean record read latency under load, 1.2-1.4 ms
CAP_55_GIB = 55 * GIB  # §6.5 N129: nvme at a 55 GiB memory cap
# targets, seed-project.md §6.5 (and the seed README): decode tok/s at concurrency 1
TARGETS = {Mode.EXACT: 12.57, Mode.FAST: 28.15, Mode.NVME: 17.27}


def reference_inputs(mode: Mode) -> CostInputs:
    lane = FAST_LANE if mode == Mode.FAST else NVME_LANE
    return CostInputs(
        vram_slots=vram_slots(REF_FREE_VRAM_MIB, mode),
        pcie_gbps=PCIE_GBPS,
        lane_a_ms=lane[0],
        lane_b_ms=lane[1],
        ram_tier_slots=ram_tier_slots(CAP_55_GIB),
        store_gbps=STORE_GBPS,
        store_latency_ms=STORE_LATENCY_MS,
    )


@pytest.mark.parametrize("mode", list(TARGETS))
def test_reference_host_prediction_within_25_percent_of_the_seed(mode):
    got = predict(mode, reference_inputs(mode)).decode_tok_s
    assert abs(got / TARGETS[mode] - 1) <= 0.25, (mode, got, TARGETS[mode])


def test_reference_prefill_is_gpu_bound_at_the_seeds_700_tok_s():
    # §6.5: exact 697, fast 709.7 tok/s at 8k; nvme 583-662 at 55 GiB
    assert predict(Mode.EXACT, reference_inputs(Mode.EXACT)).prefill_tok_s == 700.0
    nvme = predict(Mode.NVME, reference_inputs(Mode.NVME)).prefill_tok_s
    assert 583 * 0.9 <= nvme <= 662


def test_fast_mode_sends_about_the_seeds_share_of_misses_to_the_cpu():
    # §3.5 C052e at C1: 3.84 CPU experts per layer call
    got = predict(Mode.FAST, reference_inputs(Mode.FAST)).cpu_experts_per_layer
    assert got == pytest.approx(3.84, rel=0.1)


def test_expert_and_store_geometry_match_the_seed():
    assert expert_trellis_bytes(3) == 9_437_184  # §2.1
    assert store_record_bytes(3) == 9_474_048  # §4.1
    assert store_total_bytes(3) == 117_326_610_432  # §4.1: 12,384 records
    assert TOTAL_EXPERTS * expert_trellis_bytes(3) == 114_152_177_664  # §2.1: 114.2 GB


def test_popularity_curve_fits_the_published_points():
    for capacity, share in POPULARITY_POINTS:
        assert hit_fraction(capacity) == pytest.approx(share, abs=0.025)
    assert hit_fraction(0.0) == 0.0 and hit_fraction(1.0) == pytest.approx(1.0)

    def sse(lam):
        import math

        f = lambda c: (1 - math.exp(-lam * c)) / (1 - math.exp(-lam))  # noqa: E731
        return sum((f(c) - v) ** 2 for c, v in POPULARITY_POINTS)

    assert sse(POPULARITY_LAMBDA) < sse(POPULARITY_LAMBDA - 0.01)
    assert sse(POPULARITY_LAMBDA) < sse(POPULARITY_LAMBDA + 0.01)


def test_ram_tier_sizing_matches_the_seeds_logs():
    assert ram_tier_slots(55 * GIB) == 4832  # §4.2: 4,830-4,832 slots at 55 GiB
    assert ram_tier_slots(58 * GIB) == 5173  # §4.2: 5,172 slots at 58 GiB
    assert 955 <= ram_tier_slots(16 * GIB) <= 971  # §4.2: 955-970 at 16 GiB (small host)
    for cap in (16, 23, 30, 55):
        slots = ram_tier_slots(cap * GIB)
        assert ram_tier_slots(nvme_process_bytes(slots)) == slots


def test_vram_slots_match_the_seeds_headless_count():
    assert vram_slots(REF_FREE_VRAM_MIB, Mode.NVME) == 1315  # §2.3: 1,312 headless
    assert vram_slots(REF_FREE_VRAM_MIB, Mode.NVME, max_slots=1000) == 1000
    assert vram_slots(11_000, Mode.EXACT) == 0  # 10.6 GiB of model + 1 GiB reserve


def test_more_store_bandwidth_and_more_ram_never_slow_decode():
    base = reference_inputs(Mode.NVME)
    slower = predict(Mode.NVME, CostInputs(**{**_fields(base), "store_gbps": 7.0}))
    smaller = predict(Mode.NVME, CostInputs(**{**_fields(base), "ram_tier_slots": 970}))
    full = predict(Mode.NVME, base)
    assert slower.decode_tok_s < full.decode_tok_s
    assert smaller.decode_tok_s < full.decode_tok_s
    assert smaller.store_share > full.store_share


def test_a_mode_without_its_inputs_names_what_is_missing():
    bare = CostInputs(vram_slots=1300, pcie_gbps=25.0)
    with pytest.raises(ValueError, match="mode fast: needs the CPU lane's lane_a_ms and lane_b_ms"):
        predict(Mode.FAST, bare)
    with pytest.raises(ValueError, match="mode nvme-exact: needs ram_tier_slots, store_gbps"):
        predict(Mode.NVME_EXACT, bare)


def _fields(x: CostInputs) -> dict:
    import msgspec

    return msgspec.structs.asdict(x)


def _plan_geometry(shape):
    """A synthetic preset's geometry computed from its tensor plan (what geometry_of reads
    back from the written files)."""
    from glm53.doctor.geometry import EXPERT_TENSOR, Geometry
    from glm53.synth.layout import plan

    specs = [t for g in plan(shape) for t in g]
    non_expert = sum(
        t.nbytes
        for t in specs
        if not EXPERT_TENSOR.search(t.key) and not t.key.endswith("embed_tokens.weight")
    )
    bits, h, inner = shape.bits, shape.hidden_size, shape.moe_intermediate_size
    return Geometry(shape.name, shape.num_layers, len(shape.moe_layers), shape.num_experts,
                    shape.num_experts_per_tok, 3 * h * inner * bits // 8, non_expert, bits, h,
                    shape.hc_mult)  # fmt: skip


def test_geometry_of_a_written_checkpoint_is_its_own(tmp_path):
    from dataclasses import replace

    from glm53.doctor.geometry import geometry_of
    from glm53.synth.shapes import DEMO
    from glm53.synth.writer import SynthWriter

    shape = replace(DEMO, num_layers=5, num_dense_layers=1, num_experts=8)
    writer = SynthWriter(shape, 0, tmp_path)
    writer.write_metadata()
    writer.write_shards(1 << 20)
    geo = geometry_of(tmp_path)
    assert geo == replace_name(_plan_geometry(shape), tmp_path.name)
    assert (geo.num_layers, geo.num_moe_layers, geo.experts_per_layer, geo.top_k) == (5, 4, 8, 4)
    assert geo.expert_bytes == 3 * 256 * 256 * 3 // 8 and geo.expert_bits == 3


def replace_name(geo, name):
    import msgspec

    return msgspec.structs.replace(geo, name=name)


# bench/results/h200-gpu_slice-*.json, exact rows (197 slots of the slice's 1,728 experts)
H200_SLICE_EXACT_C1 = {"2026-11-30": 156.54543675462855, "2026-11-30-s4": 137.4036379091086}


def test_exact_decode_on_the_slice_is_predicted_within_15_percent_of_the_h200_runs():
    """The prediction uses facts only (exllamav3.md App. A: 50 GB/s UVA reads, 114 us for a
    layer's 8 VRAM experts; the H200's spec bandwidth and fp16 rate), not these runs."""
    from glm53.doctor.costmodel import exact_rows
    from glm53.synth.shapes import SLICE

    x = CostInputs(vram_slots=197, pcie_gbps=50.0, vram_gbps=4800.0, gpu_fp16_tflops=989.0)
    predicted = exact_rows(x, _plan_geometry(SLICE))["decode_c1_tok_s"]
    for run, measured in H200_SLICE_EXACT_C1.items():
        assert 0.85 <= measured / predicted <= 1.15, (run, measured, predicted)


def test_the_slice_is_no_longer_planned_as_the_full_model():
    """The issue's case: the slice with 197 slots was predicted at 16.3 tok/s, as if it had
    42 MoE layers of 288 experts; its own geometry puts it near the 137-157 tok/s measured."""
    from glm53.synth.shapes import SLICE

    x = CostInputs(vram_slots=197, pcie_gbps=50.0, vram_gbps=4800.0, gpu_fp16_tflops=989.0)
    full = predict(Mode.EXACT, x)
    own = predict(Mode.EXACT, x, _plan_geometry(SLICE))
    assert full.decode_tok_s < 20 < 120 < own.decode_tok_s
    assert own.vram_share == pytest.approx(hit_fraction(197 / 1728), abs=1e-4)


def test_exact_decode_at_batch_one_matches_the_c1_prediction():
    from glm53.doctor.costmodel import exact_decode_ms
    from glm53.synth.shapes import preset

    geo = _plan_geometry(preset("deep"))
    x = CostInputs(vram_slots=306, pcie_gbps=50.0, vram_gbps=4800.0, gpu_fp16_tflops=989.0)
    assert exact_decode_ms(x, geo, 1) == pytest.approx(
        predict(Mode.EXACT, x, geo).ms_per_token, rel=2e-3
    )
    # a batch of 4 shares its experts: more tokens per step, each step slower
    assert exact_decode_ms(x, geo, 1) < exact_decode_ms(x, geo, 4) < 4 * exact_decode_ms(x, geo, 1)
