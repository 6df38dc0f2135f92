"""The GPU engine's settings checks run without a GPU (creating an engine loads nothing)."""

import argparse

import pytest

from glm53.config import ConfigurationError, add_arguments, resolve
from glm53.engine.gpu import GpuEngine
from glm53.engine.gpu_create import create
from glm53.engine.gpu_options import EngineOptions


def settings(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ={})[0]


def test_exact_mode_maps_every_setting(tmp_path):
    s = settings("--mode", "exact", "--ec-max-slots", "100", "--ec-reserve-gb", "2",
                 "--ec-stage-gb", "1.5", "--context", "4096", "--max-batch", "2")  # fmt: skip
    e = create(s, tmp_path)
    assert isinstance(e, GpuEngine)
    o = e.options
    assert (e.mode, o.ec_max_slots, o.ec_reserve_gb, o.ec_stage_gb) == ("exact", 100, 2.0, 1.5)
    assert (e.context_length, e.num_slots) == (4096, 2)
    # what exllamav3's load takes, built once with the engine's options
    assert (o.load.mode, o.load.max_chunk, o.load.max_batch, o.load.ec_max_slots) == (
        "exact",
        2048,
        2,
        100,
    )


def test_nvme_mode_is_served_and_maps_store_and_lane_settings(tmp_path):
    """nvme (nvme-exact + the lane over the RAM tier) passed its GPU tests on an H200 on
    2026-12-05: served without --allow-unrun-modes; nvme-exact's settings and fast mode's lane
    settings reach it, and its load is nvme-exact's (glm53.modes' table)."""
    with pytest.raises(ConfigurationError, match="--mode nvme .*pass --store DIR"):
        create(settings("--mode", "nvme"), tmp_path)
    e = create(
        settings("--mode", "nvme", "--store", str(tmp_path),
                 "--ram-cap", "8G", "--read-timeout", "5", "--cpus", "0", "--cpu-threads", "1",
                 "--ct-precision", "exact", "--ct-b", "0.2"),
        tmp_path,
    )  # fmt: skip
    o = e.options
    assert (e.mode, o.store, o.ram_cap, o.read_timeout_s) == ("nvme", str(tmp_path), 8 << 30, 5.0)
    assert (o.lane_cpus, o.lane_threads, o.lane_precision, o.ct_b) == ("0", 1, "exact", 0.2)
    assert o.load.mode == "nvme-exact"
    assert e.fast is None and "not yet run" not in e.description
    auto = create(settings("--mode", "nvme", "--store", "/x"), tmp_path)
    assert auto.options.lane_precision == "fast"  # auto beside the GPU, as fast mode
    for argv, match in (
        (["--gpus", "0,1"], "nvme mode runs on one GPU"),
        (["--cpus", "100000"], "outside this process's affinity mask"),
        (["--chunk-size", "300"], "multiple of 256"),
    ):
        with pytest.raises(ConfigurationError, match=match):
            create(settings("--mode", "nvme", "--store", "/x", *argv),
                   tmp_path)  # fmt: skip


def test_fast_mode_has_run_on_a_gpu_and_is_served_without_the_flag(tmp_path):
    """fast passed its GPU tests on the H200 (2026-12-02): served without --allow-unrun-modes."""
    e = create(settings("--mode", "fast"), tmp_path)
    assert isinstance(e, GpuEngine) and e.mode == "fast" and e.fast is None  # nothing loaded
    assert "not yet run" not in e.description
    # exact mode's tiers, and the lane at auto precision: fast beside the GPU (lane_precision)
    o = e.options
    assert (o.lane_cpus, o.lane_threads, o.lane_precision, o.ct_b) == (None, None, "fast", None)
    assert o.load.mode == "exact"


def test_fast_mode_maps_the_lane_and_tier_settings(tmp_path):
    e = create(
        settings("--mode", "fast", "--cpus", "0", "--cpu-threads", "1",
                 "--ct-precision", "exact", "--ct-b", "0.2", "--ec-max-slots", "64",
                 "--ec-stage-gb", "0.5", "--context", "4096", "--max-batch", "4"),
        tmp_path,
    )  # fmt: skip
    o = e.options
    assert (o.lane_cpus, o.lane_threads, o.lane_precision, o.ct_b) == ("0", 1, "exact", 0.2)
    assert (o.ec_max_slots, o.ec_stage_gb, e.context_length, e.num_slots) == (64, 0.5, 4096, 4)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--store", "/x"], "fast mode keeps every routed expert in pinned RAM"),
        (["--gpus", "0,1"], "fast mode runs on one GPU"),
        (["--cpus", "100000"], "outside this process's affinity mask"),
        (["--cpus", "0", "--cpu-threads", "2"], "--cpu-threads 2 exceeds the 1 CPUs"),
        (["--chunk-size", "300"], "multiple of 256"),
    ],
)
def test_fast_mode_refuses_what_it_cannot_run_before_loading(tmp_path, argv, match):
    with pytest.raises(ConfigurationError, match=match):
        create(settings("--mode", "fast", *argv), tmp_path)


def test_ct_b_reaches_only_fast_mode_and_is_refused_elsewhere(tmp_path):
    """--ct-b pins fast mode's router; in any other engine or mode nothing would read it."""
    from glm53.engine import create_engine

    (tmp_path / "config.json").write_text("{}")
    model = ["--model", str(tmp_path)]
    e = create_engine(settings("--engine", "gpu", *model, "--mode", "fast", "--ct-b", "0.15"))
    assert e.mode == "fast" and e.options.ct_b == 0.15
    for argv in (["--engine", "gpu", *model, "--mode", "exact"], ["--engine", "cpu"]):
        with pytest.raises(ConfigurationError, match="--ct-b 0.2: it pins .* would ignore it"):
            create_engine(settings(*argv, "--ct-b", "0.2"))


def test_nvme_exact_has_run_on_a_gpu_and_is_served_without_the_flag(tmp_path):
    """nvme-exact passed its GPU tests on the H200 (2026-12-02, 6 of 6): no flag needed."""
    with pytest.raises(ConfigurationError, match="pass --store DIR"):
        create(settings("--mode", "nvme-exact"), tmp_path)
    e = create(
        settings("--mode", "nvme-exact", "--store", str(tmp_path),
                 "--ram-cap", "8G", "--read-timeout", "5", "--ec-max-slots", "50"),
        tmp_path,
    )  # fmt: skip
    o = e.options
    assert (e.mode, o.store, o.ram_cap, o.read_timeout_s) == (
        "nvme-exact",
        str(tmp_path),
        8 << 30,
        5.0,
    )
    assert o.ec_max_slots == 50
    assert (o.load.mode, o.load.store, o.load.ram_cap) == ("nvme-exact", str(tmp_path), 8 << 30)
    with pytest.raises(ConfigurationError, match="nvme-exact runs on one GPU"):
        create(
            settings("--mode", "nvme-exact", "--allow-unrun-modes", "--store", str(tmp_path),
                     "--gpus", "0,1"),
            tmp_path,
        )  # fmt: skip


@pytest.mark.parametrize("mode", ["nvme-exact", "nvme"])
def test_staging_from_the_store_follows_exact_modes_default_without_the_unrun_flag(tmp_path, mode):
    """Prefill staging in the store modes reads ahead from the store (glm53.tiers.
    prefill_ahead), whose GPU tests passed on an H100 on 2026-12-05 (in-process, served, the
    store's read faults): on by default there (exact mode's default size, None), a size for it
    and 0 (off) reach the load, all without --allow-unrun-modes and the same with it; exact
    mode keeps its own."""
    base = ["--mode", mode, "--store", str(tmp_path)]
    on = create(settings(*base), tmp_path).options
    assert on.ec_stage_gb is None and on.load.ec_stage_gb is None
    sized = create(settings(*base, "--ec-stage-gb", "2"), tmp_path).options
    assert sized.ec_stage_gb == 2.0 and sized.load.ec_stage_gb == 2.0
    off = create(settings(*base, "--ec-stage-gb", "0"), tmp_path).options
    assert off.ec_stage_gb == 0.0 and off.load.ec_stage_gb == 0.0
    for extra, want in (([], None), (["--ec-stage-gb", "2"], 2.0)):  # the flag changes nothing
        flagged = create(settings(*base, *extra, "--allow-unrun-modes"), tmp_path).options
        assert flagged.ec_stage_gb == want and flagged.load.ec_stage_gb == want
    assert create(settings("--mode", "exact"), tmp_path).options.ec_stage_gb is None


def test_a_store_is_refused_in_exact_mode(tmp_path):
    with pytest.raises(ConfigurationError, match="leave --store out"):
        create(settings("--store", str(tmp_path)), tmp_path)


def test_an_unloaded_gpu_engine_has_every_protocol_attribute_the_server_reads(tmp_path):
    """The API reads generation_defaults (and the rest) of whatever engine it serves; the GPU
    engine once lacked it, and every request through `glm53 serve --engine gpu` got a 500."""
    from glm53.engine.base import JobEngine

    e = create(settings("--mode", "exact"), tmp_path)
    e.tokenizer = None  # set by load(); everything else must exist from the start
    assert isinstance(e, JobEngine) and e.drives_jobs
    assert e.generation_defaults == {}


def test_default_staging_takes_whole_layers_when_they_fit_a_quarter_else_the_quarter():
    from glm53.plan.vram import MIN_STAGE_SLOTS, staging_slots
    from glm53.units import GIB

    rb = 9_437_184  # one GLM-5.3-Flash expert record at 3 bpw
    # an H200: two whole layers of 288 are far below a quarter of 130 GiB
    assert staging_slots(130 * GIB, GIB, 288, rb, None) == 288
    # 10 GiB left after the model and a 1 GiB reserve: a quarter of 9 GiB over two buffers
    assert staging_slots(10 * GIB, GIB, 288, rb, None) == int(0.25 * 9 * GIB // (2 * rb)) == 128
    # too little for MIN_STAGE_SLOTS records per buffer: off rather than a token buffer
    tight = 2 * MIN_STAGE_SLOTS * rb * 4 - 1 + GIB
    assert staging_slots(tight, GIB, 288, rb, None) == 0
    assert staging_slots(GIB // 2, GIB, 288, rb, None) == 0  # less free than the reserve
    # an explicit size is taken as given (capped at a whole layer); 0 turns staging off
    assert staging_slots(10 * GIB, GIB, 288, rb, 2.6) == int(2.6 * GIB // (2 * rb)) == 147
    assert staging_slots(10 * GIB, GIB, 288, rb, 100.0) == 288
    assert staging_slots(130 * GIB, GIB, 288, rb, 0.0) == 0


MIB = 1 << 20


def _inputs(**over):
    from glm53.plan.vram import VramInputs

    # fixed part 3 GiB model + 224 MiB KV + 4 x 136 MiB state + 256 MiB activations = 4 GiB
    base = dict(
        budget_bytes=24 << 30, model_bytes=3 << 30, record_bytes=9 * MIB, num_experts=64,
        num_moe_layers=42, kv_bytes_per_token=14 << 10, context_tokens=16384,
        state_bytes_per_sequence=136 * MIB, batch=4, activation_bytes=256 * MIB,
        reserve_bytes=1 << 30,
    )  # fmt: skip
    return VramInputs(**(base | over))


def test_vram_plan_splits_a_24_gib_budget_as_on_a_card_that_size():
    from glm53.plan.vram import plan_vram

    p = plan_vram(_inputs())
    # 20 GiB left; staging: a quarter of 19 GiB holds 270 record pairs, capped at the 64 experts
    # of a layer (1,152 MiB); then (20,480 - 1,152 - 1,024) MiB // 9 MiB = 2,033 slots
    assert (p.kv_bytes, p.state_bytes) == (224 * MIB, 544 * MIB)
    assert (p.stage_slots, p.stage_bytes, p.cache_slots) == (64, 1152 * MIB, 2033)
    assert p.free_bytes == 7 * MIB
    parts = p.model_bytes + p.kv_bytes + p.state_bytes + p.activation_bytes + p.stage_bytes
    assert parts + p.cache_bytes + p.reserve_bytes + p.free_bytes == 24 << 30


def test_vram_plan_caps_slots_at_max_slots_and_at_the_checkpoints_experts():
    from glm53.plan.vram import plan_vram

    assert plan_vram(_inputs(max_slots=197)).cache_slots == 197
    assert plan_vram(_inputs(budget_bytes=140 << 30)).cache_slots == 42 * 64
    assert plan_vram(_inputs(stage_gb=0.0)).stage_slots == 0


def test_vram_plan_names_the_shortfall_when_no_slot_fits():
    from glm53.plan.vram import plan_vram

    with pytest.raises(ValueError) as err:
        plan_vram(_inputs(budget_bytes=5 << 30))
    assert str(err.value) == (
        "a VRAM budget of 5.00 GiB holds no expert slot: model 3.00 + KV 0.22 + recurrent "
        "state 0.53 + activations 0.25 + staging 0.00 + reserve 1.00 GiB leave less than one "
        "9.0 MiB expert; raise --vram-budget or lower --context / --max-batch"
    )


def test_cache_geometry_of_the_deep_preset_matches_the_architecture_facts():
    from glm53.models.tokenizer import token_ids
    from glm53.plan.vram import cache_geometry
    from glm53.synth.layout import text_config
    from glm53.synth.shapes import preset

    kv, state = cache_geometry(text_config(preset("deep"), token_ids()))
    # glm53-architecture.md §1.3: 11 DSA layers of a 512-wide fp16 latent (1,024 B) plus the
    # 128-wide indexer key; 34 KDA layers of a 64 x 128 x 128 fp32 state (4 MiB) plus the
    # last 3 conv inputs of q, k and v (3 x 3 x 8,192 fp16)
    assert kv == 11 * (1024 + 256)
    assert state == 34 * (4 * MIB + 3 * 3 * 8192 * 2)


def test_vram_budget_is_a_size_flag_with_an_environment_twin():
    assert settings("--vram-budget", "24G").vram_budget == 24 << 30
    s, sources = resolve({}, environ={"GLM53_VRAM_BUDGET": "23.5GiB"})
    assert (s.vram_budget, sources["vram_budget"]) == (int(23.5 * (1 << 30)), "env")


def test_load_takes_an_optional_vram_budget_that_defaults_to_none():
    from glm53.exl3.options import LoadOptions

    assert LoadOptions().vram_budget is None


def test_the_standard_region_ends_where_a_cold_prefill_first_cuts_short():
    """exllamav3 prefills [0, n - 1), cutting a forward at the last page boundary; whole chunks
    before that are the same for every prompt sharing their tokens."""
    from glm53.exl3 import standard_region

    c = 2048
    assert standard_region(1, c) == 0
    assert standard_region(2048, c) == 0  # last page boundary 1792: no whole chunk before it
    assert standard_region(2049, c) == 2048  # boundary 2048 = one whole chunk
    assert standard_region(4097, c) == 4096
    assert standard_region(5000, c) == 4096  # boundary 4864
    assert standard_region(6144, c) == 4096  # boundary 5888
    assert standard_region(6145, c) == 6144
    with pytest.raises(ValueError, match="multiple of the page size"):
        standard_region(100, 1000)


def test_chunk_size_must_be_whole_pages(tmp_path):
    with pytest.raises(ConfigurationError, match="--chunk-size 1000: .* multiple of 256.* 768"):
        create(settings("--chunk-size", "1000"), tmp_path)
    with pytest.raises(ValueError, match="multiple of 256"):
        GpuEngine(str(tmp_path), EngineOptions(mode="exact", chunk_size=1000))


def test_the_gpu_engine_takes_the_vram_budget(tmp_path):
    e = create(settings("--vram-budget", "24G"), tmp_path)
    assert e.options.vram_budget == e.options.load.vram_budget == 24 << 30
    assert create(settings(), tmp_path).options.vram_budget is None


def test_a_split_over_distinct_gpus_is_refused_until_its_gpu_tests_have_run(tmp_path):
    """Two or more distinct devices never ran (UNRUN["split"]): refused without
    --allow-unrun-modes, the message saying where it stands and that the flag is for distinct
    GPUs; served with it."""
    for gpus in ("0,1", "0,0,1"):
        with pytest.raises(
            ConfigurationError,
            match=f"--gpus {gpus}: the layer split over two or more distinct GPUs .* has run "
            "only with every --gpus entry on one GPU",
        ) as info:
            create(settings("--gpus", gpus), tmp_path)
        assert "never over two distinct devices" in str(info.value)
        assert "--allow-unrun-modes runs it anyway" in str(info.value)
        assert "The flag is needed for two or more distinct GPUs." in str(info.value)
        want = tuple(int(g) for g in gpus.split(","))
        assert create(settings("--gpus", gpus, "--allow-unrun-modes"), tmp_path).gpus == want
    one = create(settings("--gpus", "1"), tmp_path)  # one entry: the one-GPU path on that GPU
    assert (one.gpus, one.device) == (None, "cuda:1")


def test_a_split_with_every_entry_on_one_gpu_is_served_without_the_unrun_flag(tmp_path):
    """--gpus 0,0 (both layer ranges on GPU 0, the split's code path) passed its GPU tests on
    an H200 and on an H100 (2026-12-05): served without --allow-unrun-modes, the split reaching
    the load and the description as with the flag; any one device repeated likewise."""
    for gpus, want in (("0,0", (0, 0)), ("1,1", (1, 1)), ("0,0,0", (0, 0, 0))):
        e = create(settings("--gpus", gpus), tmp_path)
        assert e.gpus == e.options.gpus == e.options.load.gpus == want
        assert f"layers split over GPUs {gpus}" in e.description
        flagged = create(settings("--gpus", gpus, "--allow-unrun-modes"), tmp_path)
        assert flagged.options.load.gpus == want and flagged.description == e.description
    # a mode that runs on one GPU refuses it as such, flag or not
    for flag in ([], ["--allow-unrun-modes"]):
        with pytest.raises(ConfigurationError, match="--gpus 0,0: fast mode runs on one GPU"):
            create(settings("--mode", "fast", "--gpus", "0,0", *flag), tmp_path)


def test_prefill_is_chunk_major_unless_asked_for(tmp_path):
    e = create(settings("--mode", "exact"), tmp_path)
    assert e.prefill == "chunk" and e.layer_major is None
    assert "layer-major" not in e.description


def test_layer_major_prefill_is_served_without_the_unrun_flag(tmp_path):
    """layer-major passed its 6 GPU tests on an H200 (2026-12-05): no --allow-unrun-modes, and
    the engine's description says what ran."""
    for auto in ([], ["--mode", "auto"]):  # auto is exact on the GPU engine
        e = create(settings(*auto, "--prefill", "layer-major"), tmp_path)
        assert e.prefill == "layer-major" and e.layer_major is None  # nothing loaded yet
    e = create(settings("--mode", "exact", "--prefill", "layer-major"), tmp_path)
    assert e.prefill == "layer-major" and e.layer_major is None
    assert "layer-major prefill (6 of 6 GPU tests passed, H200, 2026-12-05)" in e.description
    flagged = create(
        settings("--mode", "exact", "--prefill", "layer-major", "--allow-unrun-modes"), tmp_path
    )
    assert flagged.prefill == "layer-major" and flagged.description == e.description


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--mode", "fast"], "--prefill layer-major runs in exact, nvme-exact and nvme mode"),
        # the split over distinct GPUs needs the flag (UNRUN["split"]); layer-major is refused
        # with it, and over 0,0 (served without the flag) too
        (
            ["--mode", "exact", "--gpus", "0,1", "--allow-unrun-modes"],
            "--prefill layer-major runs on one GPU",
        ),
        (["--mode", "exact", "--gpus", "0,0"], "--prefill layer-major runs on one GPU"),
    ],
)
def test_layer_major_prefill_runs_in_exact_and_the_store_modes_on_one_gpu(tmp_path, argv, match):
    with pytest.raises(ConfigurationError, match=match):
        create(settings(*argv, "--prefill", "layer-major"), tmp_path)


@pytest.mark.parametrize("mode", ["nvme-exact", "nvme"])
def test_layer_major_prefill_in_the_store_modes_is_served_without_the_unrun_flag(tmp_path, mode):
    """Over the RAM tier: its GPU test passed on an H100 (2026-12-05, nvme-exact at RAM
    40 %, each chunk reading its picks zero-copy), so no --allow-unrun-modes; it reaches the
    engine over the store modes' load and the description says what ran. The flag adds only
    the pass staging each layer once (UNRUN["store-pass-staging"], not yet run on a GPU), and
    the description says which of the two runs."""
    argv = ["--mode", mode, "--store", str(tmp_path), "--prefill", "layer-major"]
    e = create(settings(*argv), tmp_path)
    assert e.prefill == e.options.prefill == "layer-major" and e.layer_major is None
    assert e.options.load.mode == "nvme-exact"
    assert (
        "layer-major prefill over the RAM tier (its GPU test passed in nvme-exact at RAM 40 %, "
        "H100, 2026-12-05" in e.description
    )
    assert e.options.store_pass_staging is False
    assert "each chunk of a pass reading its picks zero-copy" in e.description
    flagged = create(settings(*argv, "--allow-unrun-modes"), tmp_path)
    assert flagged.prefill == "layer-major" and flagged.options.store_pass_staging is True
    assert "each layer staged once per pass (was written on 2026-12-05" in flagged.description
    assert "zero-copy (staging" not in flagged.description


def test_layer_major_prefill_is_refused_off_the_gpu_engine():
    from glm53.engine import create_engine

    with pytest.raises(ConfigurationError, match="only the GPU engine .* the cpu engine would"):
        create_engine(settings("--engine", "cpu", "--prefill", "layer-major"))


def test_the_engine_takes_layer_major_only_in_exact_and_the_store_modes(tmp_path):
    for mode in ("stock", "fast"):
        with pytest.raises(ValueError, match="layer-major runs in exact, nvme-exact and nvme"):
            GpuEngine(str(tmp_path), EngineOptions(mode=mode, prefill="layer-major"))
    for mode in ("nvme-exact", "nvme"):
        e = GpuEngine(str(tmp_path), EngineOptions(mode=mode, store=str(tmp_path),
                                                   prefill="layer-major"))  # fmt: skip
        assert e.prefill == "layer-major"
    with pytest.raises(ValueError, match="chunk, or layer-major"):
        GpuEngine(str(tmp_path), EngineOptions(mode="exact", prefill="layers"))


# --- the load's VRAM accounting (exl3_load.held_vram_bytes) -------------------------------------


def test_resident_bytes_count_what_the_load_holds_after_moving_experts_out_of_vram():
    """Made-up allocator counts, as a fast-mode load gives them: 2 GB held by an earlier load,
    12 GB at the peak while exllamav3 loaded experts into VRAM before the home hook moved them
    out, 5 GB held at the end (weights, KV cache, expert cache). The driver's free count gave
    -6.2 GB for such a load (issue #26); the allocator's live bytes give the 5 GB."""
    from glm53.exl3.loader import VramUse, held_vram_bytes

    before = VramUse(allocated=2_000_000_000, peak=2_000_000_000)
    after = VramUse(allocated=7_000_000_000, peak=14_000_000_000)
    assert held_vram_bytes(before, after) == (5_000_000_000, 12_000_000_000)
    # a peak that was reset after the load began is at least what the load still holds
    assert held_vram_bytes(before, VramUse(7_000_000_000, 0)) == (5_000_000_000, 5_000_000_000)
    assert held_vram_bytes(before, before) == (0, 0)


def test_resident_bytes_are_unknown_when_tensors_freed_during_the_load_made_them_negative():
    """Not a negative count and not a failed load: None, which the load logs with both numbers
    and /stats shows as null."""
    from glm53.exl3.loader import VramUse, held_vram_bytes

    assert held_vram_bytes(VramUse(9_000, 9_000), VramUse(4_000, 9_000)) is None


@pytest.mark.parametrize(
    "argv",
    [["--mode", "exact"], ["--mode", "nvme-exact", "--store", "/x"]],
)
def test_the_gpu_engine_keeps_its_heat_lists_under_cache_dir(tmp_path, argv):
    """--cache-dir reaches the GPU engine, which names its heat lists under it (the CPU engine
    already did; the GPU engine used the default directory)."""
    from glm53.tiers.heat import heat_path

    (tmp_path / "config.json").write_text("{}")
    e = create(settings(*argv, "--cache-dir", str(tmp_path / "cache")), tmp_path)
    assert e.cache_dir == str(tmp_path / "cache")
    assert heat_path(str(tmp_path), cache_dir=e.cache_dir).startswith(str(tmp_path / "cache"))
    default = create(settings(*argv), tmp_path)
    assert default.cache_dir != e.cache_dir


@pytest.mark.parametrize("installed", ["1.6.4", "1.7.0", "1.6.5"])
def test_another_exllamav3_release_is_refused_before_binding(monkeypatch, installed):
    """The GPU engine hooks exllamav3 1.6.5's insides: another installed release is one of the
    reasons refuse_unservable names (exllamav3 is found by its metadata, never imported).
    A MOCK stands in for the installed package's spec and metadata (none is installed here)."""
    import importlib.metadata
    import importlib.util

    import glm53.engine as engine

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "exllamav3" else real_find_spec(name, *a),
    )
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: installed if name == "exllamav3" else real_version(name),
    )
    problems = engine._gpu_host_problems(num_devices=1)
    refusal = (
        f"exllamav3 {installed} is installed, and the GPU engine hooks exllamav3 1.6.5's "
        "insides, exactly that release"
    )
    assert problems == ([] if installed == "1.6.5" else [refusal])


def test_the_gpus_pci_address_is_written_as_sysfs_names_it():
    """For the lane's NUMA node (glm53.tiers.cpu_lane.gpu_node_cpus); props are a MOCK of
    torch.cuda.get_device_properties (no CUDA here)."""
    from types import SimpleNamespace

    from glm53.tiers.cpu_lane import pci_address_of

    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    assert pci_address_of(props) == "0000:3b:00.0"
    assert pci_address_of(SimpleNamespace(pci_bus_id=0x3B)) is None


def test_nvme_prefetch_is_served_without_the_unrun_flag_and_reaches_the_load_in_the_store_modes(
    tmp_path,
):
    """--nvme-prefetch next-layer (glm53.tiers.decode_prefetch): its GPU tests passed on an
    H100 (2026-12-05), so no --allow-unrun-modes; off by default (not benchmarked), it reaches
    the load in nvme-exact and nvme without the flag and the same with it, and it is refused in
    every mode that reads no store, flag or not, naming the option and the fix."""
    from glm53.modes import UNRUN

    assert "nvme-prefetch" not in UNRUN
    store = ["--store", str(tmp_path)]
    for mode in ("nvme-exact", "nvme"):
        base = create(settings("--mode", mode, *store), tmp_path).options
        assert (base.nvme_prefetch, base.load.nvme_prefetch) == ("off", "off")
        argv = ("--mode", mode, *store, "--nvme-prefetch", "next-layer")
        e = create(settings(*argv), tmp_path)
        assert (e.options.nvme_prefetch, e.options.load.nvme_prefetch) == ("next-layer",) * 2
        assert (
            "decode prefetch next-layer (GPU tests passed at RAM 40 % and 70 %, H100, 2026-12-05"
            in e.description
        )
        assert "not yet run" not in e.description
        flagged = create(settings(*argv, "--allow-unrun-modes"), tmp_path)
        assert flagged.options.load.nvme_prefetch == "next-layer"
        assert flagged.description == e.description
    for mode in ("exact", "fast", "auto"):
        for flag in ([], ["--allow-unrun-modes"]):
            with pytest.raises(ConfigurationError) as info:
                create(settings("--mode", mode, "--nvme-prefetch", "next-layer", *flag), tmp_path)
            msg = str(info.value)
            assert msg.startswith("--nvme-prefetch next-layer: it reads the store ahead")
            assert "leave --nvme-prefetch out (off), or serve --mode nvme-exact or nvme" in msg
    with pytest.raises(SystemExit):  # argparse: the choices are off and next-layer
        settings("--nvme-prefetch", "two-layers")


def test_nvme_prefetch_is_refused_by_the_other_engines_and_checked_in_the_load_options():
    import typing

    from glm53.config import NvmePrefetch
    from glm53.engine import create_engine
    from glm53.exl3.options import LoadMode, LoadOptions
    from glm53.modes import NVME_PREFETCH

    assert typing.get_args(NvmePrefetch) == NVME_PREFETCH  # the one list of values
    for engine in ("cpu", "scripted"):
        s = settings("--engine", engine, "--mode", "nvme-exact", "--nvme-prefetch", "next-layer")
        with pytest.raises(ConfigurationError, match=f"the {engine} engine would ignore it"):
            create_engine(s)
    assert LoadOptions(mode=LoadMode.NVME_EXACT, nvme_prefetch="next-layer").nvme_prefetch
    with pytest.raises(ConfigurationError, match="--nvme-prefetch next-layer: it reads the store"):
        LoadOptions(mode=LoadMode.EXACT, nvme_prefetch="next-layer")
    with pytest.raises(ConfigurationError, match="--nvme-prefetch 'x': one of off, next-layer"):
        LoadOptions(mode=LoadMode.NVME_EXACT, nvme_prefetch="x")
    with pytest.raises(ConfigurationError, match="--nvme-prefetch 'x': one of off, next-layer"):
        EngineOptions(mode="nvme-exact", store="/x", nvme_prefetch="x")


def test_the_staging_loan_reaches_the_load_in_exact_and_fast_modes(tmp_path):
    for mode in ("exact", "fast"):
        e = create(settings("--mode", mode, "--ec-stage-loan", "--allow-unrun-modes"), tmp_path)
        assert e.options.ec_stage_loan and e.options.load.stage_loan
    assert not create(settings("--mode", "exact"), tmp_path).options.load.stage_loan


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--mode", "nvme-exact", "--store", "/x"], "load mode nvme-exact has no such pair"),
        (["--mode", "exact", "--gpus", "0,1"], "split over --gpus has no such pair"),
        (["--mode", "exact", "--prefill", "layer-major"], "one at a time; leave one of them out"),
    ],
)
def test_the_staging_loan_is_refused_where_it_has_no_buffers_to_lend(tmp_path, argv, match):
    with pytest.raises(ConfigurationError, match=match):
        create(settings(*argv, "--ec-stage-loan", "--allow-unrun-modes"), tmp_path)
