"""The benchmarks' JSON contract (bench/README or the native-core issue): one JSON object as the
last line, with "bench", "figures", "ratios" and "config". Run at the smallest sizes; nothing here
is timed or compared against a speed."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(name: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--json", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"bench", "figures", "ratios", "config"} <= result.keys()
    assert result["bench"] == name
    return result


def combine(tmp_path, rows: dict, info) -> dict:
    """bench/gpu_slice.py --combine over MOCK row files, one per mode in `rows`, each with
    `info` (a dict, or a function of the mode that gives it)."""
    for mode, row in rows.items():
        i = info(mode) if callable(info) else info
        (tmp_path / f"row-{mode}.json").write_text(
            json.dumps({"mode": mode, "info": i, "row": row})
        )
    return run_bench("gpu_slice", "--combine", str(tmp_path))


def test_lane_latency_contract():
    """bench/lane_latency.py's JSON on a tiny shape: a point per spin, experts and gap, each
    with its anchor; the ratios from the points named (numbers here mean nothing: 2 cores)."""
    pytest.importorskip("glm53._lane")
    cpu = str(sorted(os.sched_getaffinity(0))[0])
    r = run_bench(
        "lane_latency", "--cpus", cpu, "--hidden", "256", "--inter", "256", "--pool-experts",
        "4", "--jobs", "3", "--experts", "1,2", "--gaps-us", "0,100", "--spins-us", "200,1000",
    )  # fmt: skip
    points = r["figures"]["round_trip"]
    assert sorted(points) == sorted(
        f"spin{s}_k{k}_gap{g}" for s in (200, 1000) for k in (1, 2) for g in (0, 100)
    )
    p = points["spin1000_k2_gap100"]
    assert (p["spin_us"], p["experts"], p["gap_us"]) == (1000, 2, 100)
    assert (
        0 < p["median_us"] <= p["p90_us"] and p["pool_us"] == r["figures"]["pool"]["2"]["median_us"]
    )
    want = points["spin200_k1_gap100"]["median_us"] / points["spin1000_k1_gap100"]["median_us"]
    assert r["ratios"]["asleep_vs_awake"] == want
    want = points["spin200_k1_gap0"]["median_us"] / r["figures"]["pool"]["1"]["median_us"]
    assert r["ratios"]["round_trip_vs_pool"] == want
    assert r["config"]["threads"] == 1 and r["config"]["default_spin_us"] == 5000


def test_dram_contention_contract():
    """Without a GPU (CI): the lane's rate alone, and the GPU's figures null with the reason."""
    r = run_bench("dram_contention", "--seconds", "0.2", "--pool-experts", "16", "--hidden",
                  "512", "--inter", "256")  # fmt: skip
    f = r["figures"]
    if r["config"]["gpu"] != "measured":
        assert "no CUDA device" in r["config"]["gpu"]
        assert f["gpu_zero_copy_alone_gbps"] is None and f["together_dma"] is None
        assert r["ratios"]["sum_together_vs_best_alone_zero_copy"] is None
    assert f["lane_alone_gbps"] > 0
    lane = r["config"]["lane"]
    assert lane["precision"] == "fast" and lane["experts_per_job"] == 8
    assert lane["record_bytes"] == 3 * 512 * 256 * 3 // 8  # three mul1 linears at 3 bits


def test_micro_gemv_contract():
    gemv = pytest.importorskip("glm53._gemv")
    # the fast kernel's A/B against its previous one runs where the CPU has a kept previous kernel
    ab = gemv.has_previous(gemv.best_variant(), gemv.FAST)
    r = run_bench(
        "micro_gemv", "--threads", "1", "--jobs", "1", "--pool-mb", "64", "--no-calibrate",
        "--no-exllamav3", *(("--ab", "1,2", "--ab-reps", "2") if ab else ()),
    )  # fmt: skip
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    if ab:
        assert set(f["ab"]) == {"1", "2"} and f["ab"]["2"]["pairs"] == 2
        assert ratios["fast_vs_previous_one_thread"] == f["ab"]["1"]["ratio_median"] > 0
        assert f["ab"]["1"]["new_gbps_p10"] > 0 and "alternating pairs" in cfg["ab"]
    else:
        assert f["ab"] is None and ratios["fast_vs_previous_one_thread"] is None
    assert f["max_rel_err"] <= 1e-5
    assert 1e-5 < f["fast_max_rel_err"] <= f["fast_rel_tol"]  # the fast kernels are inexact
    for key in ("trellis_gbps_per_thread", "ms_per_expert", "dram_gbps",
                "independent_gbps_per_thread", "exact_trellis_gbps_one_thread"):  # fmt: skip
        assert f[key] > 0, key
    assert {row["variant"] for row in f["table"]} == set(cfg["kernels"])
    assert cfg["fast_kernel"] in cfg["kernels"] and cfg["fast_kernel"].endswith(" fast")
    assert ratios["vs_exllamav3"] is None and "skipped" in cfg["exllamav3"]
    assert 0 < ratios["dram_share"] and 0 < ratios["pool_vs_independent"]
    assert 0 < ratios["dram_read_share"] and 0 < ratios["fast_vs_exact"]
    assert f["cost_model"] is None


def test_dram_contention_zero_copy_reduction_runs_in_torch():
    """The GPU reader's reduction (a sum into a preallocated 0-d tensor) on CPU tensors: the
    first H200 run raised TypeError there, which the CPU contract above cannot reach."""
    import importlib.util

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(
        "dram_contention", ROOT / "bench" / "dram_contention.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src, out = torch.arange(1000, dtype=torch.float32), torch.empty((), dtype=torch.float32)
    module.reduce_into(torch, src, out)
    assert out.item() == 999 * 1000 / 2


def _gpu_slice():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_slice", ROOT / "bench" / "gpu_slice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_slice_deep_budget_arguments_plan_exact_and_stock_offload_alike():
    from glm53.plan.vram import VramInputs, plan_vram

    gs = _gpu_slice()
    args = gs.parse_args(["--model", "/x/deep", "--vram-budget", "24G",
                          "--modes", "exact,stock_offload,stock_offload_arena"])  # fmt: skip
    assert (args.vram_budget, gs.cache_share(args)) == (24 << 30, None)
    assert gs.exact_kwargs(args, "exact", 64, 42) == {
        "ec_freq_window": None,
        "vram_budget": 24 << 30,
    }
    rb = 9_437_184
    plan = plan_vram(
        VramInputs(
            budget_bytes=24 << 30, model_bytes=3 << 30, record_bytes=rb, num_experts=64,
            num_moe_layers=42, kv_bytes_per_token=14080, context_tokens=16384,
            state_bytes_per_sequence=147_619_840, batch=4, activation_bytes=335_544_320,
            reserve_bytes=1 << 30,
        )
    )  # fmt: skip
    # stock offload keeps in VRAM what exact's cache and staging take, per layer
    on_gpu = (plan.cache_slots + 2 * plan.stage_slots) // 42
    assert gs.offload_split(args, 64, 42, plan, rb) == 64 - on_gpu
    capped = gs.parse_args(["--model", "/x/deep", "--vram-budget", "24G", "--share", "0.1138"])
    assert gs.exact_kwargs(capped, "exact_clock", 64, 42) == {
        "ec_freq_window": 0,
        "ec_max_slots": 306,
        "vram_budget": 24 << 30,
    }
    # with a share the row's plan caps the cache (row_vram_plan), and stock offload keeps in
    # VRAM what that cache and the staging take together; without a budget, the share's experts
    plan_capped = plan_vram(
        VramInputs(
            budget_bytes=24 << 30, model_bytes=3 << 30, record_bytes=rb, num_experts=64,
            num_moe_layers=42, kv_bytes_per_token=14080, context_tokens=16384,
            state_bytes_per_sequence=147_619_840, batch=4, activation_bytes=335_544_320,
            reserve_bytes=1 << 30, max_slots=306,
        )
    )  # fmt: skip
    assert plan_capped.cache_slots == 306
    on_gpu = (306 + 2 * plan_capped.stage_slots) // 42
    assert gs.offload_split(capped, 64, 42, plan_capped, rb) == 64 - on_gpu
    assert gs.offload_split(capped, 64, 42, None, rb) == 64 - 7
    plain = gs.parse_args(["--model", "/x/slice"])  # no budget: the 24 GB card's share
    assert gs.exact_kwargs(plain, "exact", 288, 6) == {"ec_freq_window": None, "ec_max_slots": 197}


def _deep_moe_geometry(tmp_path):
    """The deep preset's MoeGeometry (glm53.exl3.loaded.moe_geometry) and its config.json in
    tmp_path, from its tensor plan: the 29 GB checkpoint is planned, not written. The stand-in
    for exllamav3's SafetensorsCollection (a MOCK: exllamav3 needs a GPU) holds the plan's keys
    at consecutive offsets, which is all moe_geometry reads."""
    from glm53.exl3.loaded import moe_geometry
    from glm53.models.tokenizer import token_ids
    from glm53.synth.layout import plan, text_config
    from glm53.synth.shapes import preset

    deep = preset("deep")
    header, offset = {}, 0
    for spec in (t for group in plan(deep) for t in group):
        header[spec.key] = {"data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    stc = types.SimpleNamespace(
        tensor_file_map=dict.fromkeys(header, "model.safetensors"),
        file_headers={"model.safetensors": header},
        directory=str(tmp_path),
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": text_config(deep, token_ids())})
    )
    return moe_geometry(stc)


def test_gpu_slice_deep_rows_plan_records_the_share_capped_cache(tmp_path):
    """docs/synthetic.md's deep calls (--vram-budget 24G --share 0.11657): the plan a row
    records is the one it loads by, its cache capped at the share's slots (exact_kwargs'
    ec_max_slots: the share wins over the budget's 1,981), the bytes the cap leaves in the
    budget counted free; KV, state and staging as the budget plans them. Before, the recorded
    plan had 1,981 slots and 7 MB free while the run held 313."""
    from glm53.exl3.loader import vram_plan_for

    gs = _gpu_slice()
    geo = _deep_moe_geometry(tmp_path)
    rb = sum(geo.part_bytes)
    assert (geo.n_experts, len(geo.moe_layers), rb) == (64, 42, 9_437_184)
    args = gs.parse_args(["--model", str(tmp_path), "--vram-budget", "24G", "--share", "0.11657",
                          "--modes", "exact"])  # fmt: skip
    shapes, cache_tokens = gs.row_prefill(args, "exact")  # no 32k row without --long-prefill
    assert (shapes, cache_tokens) == (gs.PREFILL, gs.CACHE_TOKENS)
    cap = gs.exact_kwargs(args, "exact", 64, 42)["ec_max_slots"]
    assert cap == round(0.11657 * 42 * 64) == 313
    budget = vram_plan_for(str(tmp_path), geo, 24 << 30, cache_tokens, 4, 2048)
    plan = gs.row_vram_plan(args, geo, cache_tokens)
    assert budget.cache_slots == 1981 and plan.cache_slots == cap
    assert plan.cache_bytes == cap * rb
    assert plan.free_bytes == budget.free_bytes + (budget.cache_slots - cap) * rb
    assert (plan.stage_slots, plan.kv_bytes, plan.state_bytes) == (
        64,
        budget.kv_bytes,
        budget.state_bytes,
    )  # two whole layers of staging, KV and recurrent state as the budget plans them
    # stock offload keeps in VRAM what exact's capped cache and its staging take, per layer:
    # (313 + 2 x 64) // 42 = 10 of 64 (the share's 7 alone left exact's staging bytes uncounted)
    assert plan.stage_bytes == 2 * 64 * rb
    assert gs.offload_split(args, 64, 42, plan, rb) == 64 - (313 + 128) // 42 == 54
    plain = gs.parse_args(["--model", str(tmp_path), "--vram-budget", "24G"])  # no share
    assert gs.row_vram_plan(plain, geo, cache_tokens) == budget


def test_gpu_slice_refuses_unknown_modes_a_missing_model_and_a_bad_split(capsys):
    gs = _gpu_slice()
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--fixed-splits", "0,150"])
    assert "percentages must be in 0..100, got [150]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--modes", "exact,turbo"])
    assert "--modes: unknown ['turbo']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "", "--vram-budget", "24G"])
    assert "--model (or GLM53_TEST_SLICE) must name a checkpoint directory" in (
        capsys.readouterr().err
    )


def _mock_row(c1, c2, c4, c4_agg, p512, p8k, p8k_c8k, p32768=None, **extra):
    prefill = {"p512": p512, "p8192": p8k, "p8192_c8192": p8k_c8k}
    if p32768 is not None:  # the --long-prefill rows
        prefill["p32768"] = p32768
    return {
        "decode": {
            "c1": {"per_stream_tok_s": c1, "aggregate_tok_s": c1},
            "c2": {"per_stream_tok_s": c2, "aggregate_tok_s": 2 * c2},
            "c4": {"per_stream_tok_s": c4, "aggregate_tok_s": c4_agg},
        },
        "prefill": prefill,
        **extra,
    }


def test_gpu_slice_combine_of_deep_rows_reports_the_issue_ratios_and_predictions(tmp_path):
    """--combine measures nothing: MOCK rows (made-up figures, as no GPU runs here) in, the JSON
    contract out: the two ratios issue 14 asks for, and doctor's prediction beside each row."""
    import msgspec

    from glm53.doctor import costmodel
    from glm53.doctor.geometry import GLM53_FLASH, Geometry

    geo = Geometry("deep", 45, 42, 64, 8, 9_437_184, 3_529_850_884, 3)
    info = {"moe_layers": 42, "experts": 64, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 900.0, 3000.0, 6000.0, decode_hit_rate=0.9,
                           cache={"layer_hit_rate": [0.9] * 42}, slots=1900, freq_window=0),
        "stock_offload": _mock_row(10.0, 8.0, 6.0, 24.0, 300.0, 1500.0, 3000.0),
        "stock_offload_arena": _mock_row(16.0, 12.0, 8.0, 32.0, 400.0, 2000.0, 4000.0),
    }  # fmt: skip
    for mode, row in rows.items():
        r = {"mode": mode, "info": dict(info, split=40), "row": row}
        (tmp_path / f"row-{mode}.json").write_text(json.dumps(r))
    r = run_bench("gpu_slice", "--combine", str(tmp_path), "--vram-budget", "24G")
    ratios, figures = r["ratios"], r["figures"]
    assert ratios["exact_vs_best_stock_offload"] == 40.0 / 16.0
    assert ratios["exact_c4_aggregate_vs_c1"] == 80.0 / 40.0
    assert set(figures["predicted"]) == {"exact"}  # the offload rows are not modelled
    x = costmodel.CostInputs(vram_slots=1900, pcie_gbps=50.0, vram_gbps=4800.0,
                             gpu_fp16_tflops=989.0)  # fmt: skip
    want = costmodel.exact_rows(x, geo)
    assert figures["predicted"]["exact"] == pytest.approx(want)
    vs = ratios["measured_vs_predicted"]["exact"]
    assert vs["decode_c1_tok_s"] == pytest.approx(40.0 / want["decode_c1_tok_s"])
    assert vs["prefill_8192_tok_s"] == pytest.approx(3000.0 / want["prefill_8192_tok_s"])
    assert ratios["exact_c1_measured_vs_predicted"] == vs["decode_c1_tok_s"]
    full = figures["full_model"]
    assert full["slots"] == costmodel.vram_slots(24 * 1024, costmodel.Mode.EXACT)
    real = costmodel.exact_rows(msgspec.structs.replace(x, vram_slots=full["slots"]), GLM53_FLASH)
    assert full["scaled_by_measured"]["decode_c1_tok_s"] == pytest.approx(
        real["decode_c1_tok_s"] * vs["decode_c1_tok_s"]
    )
    assert r["config"]["vram_budget"] == 24 << 30 and r["config"]["share"] is None
    # rows recorded before the per-concurrency hit counts have none
    assert figures["exact_hit_rate_by_concurrency"] == {"c1": None, "c2": None, "c4": None}


def test_gpu_slice_hit_counts_per_concurrency(tmp_path):
    """MOCK exact row whose decode runs carry their own hit counts (bench/gpu_slice.py's
    hit_counts between two cache states): the figure keeps each concurrency's rate."""
    gs = _gpu_slice()
    got = gs.hit_counts({"hits": 10, "misses": 5}, {"hits": 40, "misses": 25})
    assert got == {"hits": 30, "misses": 20, "hit_rate": 0.6}
    assert gs.hit_counts({"hits": 1, "misses": 1}, {"hits": 1, "misses": 1})["hit_rate"] is None
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 6, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    row = _mock_row(130.0, 90.0, 60.0, 240.0, 1000.0, 5000.0, 11000.0, decode_hit_rate=0.43,
                    cache={"layer_hit_rate": [0.43] * 6}, slots=197)  # fmt: skip
    for c, rate in (("c1", 0.42), ("c2", 0.45), ("c4", 0.5)):
        row["decode"][c]["hit_rate"] = rate
    r = combine(tmp_path, {"exact": row}, info)
    assert r["figures"]["exact_hit_rate_by_concurrency"] == {"c1": 0.42, "c2": 0.45, "c4": 0.5}


def test_gpu_slice_nvme_exact_rows_need_a_store_and_give_their_ratios_against_exact(tmp_path):
    """MOCK rows (made-up figures; the real rows: H200, 2026-12-05, bench/results/README.md):
    the two ratios issue 17 asks for are each row's c1 over exact's, and the rows need
    --store."""
    gs = _gpu_slice()
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--modes", "exact,nvme_exact_ram40"])
    assert "nvme_exact_ram" not in gs.parse_args(["--model", "/x"]).modes
    assert "nvme_exact_ram40" in gs.parse_args(["--model", "/x", "--store", "/s"]).modes
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 900.0, 3000.0, 6000.0, decode_hit_rate=0.5,
                           cache={"layer_hit_rate": [0.5] * 8}, slots=262),
        "nvme_exact_ram70": _mock_row(36.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0),
        "nvme_exact_ram40": _mock_row(20.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0),
    }  # fmt: skip
    ratios = combine(tmp_path, rows, info)["ratios"]
    assert ratios["nvme_exact_vs_exact_ram70"] == 36.0 / 40.0
    assert ratios["nvme_exact_vs_exact_ram40"] == 20.0 / 40.0
    assert ratios["nvme_exact_ram70_vs_disk_bound"] is None  # rows without a read rate


def test_disk_bound_adds_the_store_reads_to_exacts_time_serial_or_overlapped():
    gs = _gpu_slice()
    # exact 100 tok/s = 10 ms a token; 20 MB a token at 2 GB/s = 10 ms of reads
    assert gs.disk_bound_tok_s(100.0, 20e6, 2e9) == {"serial": 50.0, "overlap": 100.0}
    # reads longer than compute: overlap is bound by the disk alone (40 ms -> 25 tok/s)
    assert gs.disk_bound_tok_s(100.0, 80e6, 2e9) == pytest.approx({"serial": 20.0,
                                                                   "overlap": 25.0})  # fmt: skip
    assert gs.disk_bound_tok_s(100.0, 0.0, 2e9) == {"serial": 100.0, "overlap": 100.0}
    assert gs.disk_bound_tok_s(None, 20e6, 2e9) is None
    assert gs.disk_bound_tok_s(100.0, None, 2e9) is None


def test_gpu_slice_nvme_rows_give_their_disk_bound_from_the_read_rate_beside_them(tmp_path):
    """MOCK rows (made-up figures): each nvme row's store bytes per token and read rate give
    figures.disk_bound_tok_s per phase and the decode c1 ratio against the serial bound."""
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    ram70 = _mock_row(36.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0,
                      prefill_store_bytes_per_token={"p512": 1e6, "p8192": 2e5,
                                                     "p8192_c8192": 1e5})  # fmt: skip
    ram70["decode"]["c1"]["store_bytes_per_token"] = 50e6
    ram40 = _mock_row(20.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0)
    ram40["decode"]["c1"]["store_bytes_per_token"] = 100e6
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 1000.0, 4000.0, 8000.0,
                           decode_hit_rate=0.5, cache={"layer_hit_rate": [0.5] * 8}, slots=262),
        "nvme_exact_ram70": ram70,
        "nvme_exact_ram40": ram40,
    }  # fmt: skip
    rates = {"nvme_exact_ram70": 2e9, "nvme_exact_ram40": 1e9}
    r = combine(
        tmp_path,
        rows,
        lambda mode: dict(info, store_read={"bytes_per_s": rates[mode]}) if mode in rates else info,
    )
    f, ratios = r["figures"], r["ratios"]
    assert f["store_read_bytes_per_s"] == rates
    assert f["store_bytes_per_token"]["nvme_exact_ram70"] == {
        "decode_c1": 50e6, "prefill_p512": 1e6, "prefill_p8192": 2e5, "prefill_p8192_c8192": 1e5
    }  # fmt: skip
    b70 = f["disk_bound_tok_s"]["nvme_exact_ram70"]
    # exact 25 ms a token + 50 MB / 2 GB/s = 25 ms: serial 20 tok/s, overlapped 40
    assert b70["decode_c1"] == pytest.approx({"serial": 20.0, "overlap": 40.0})
    # prefill 512: exact 1 ms a token + 1 MB / 2 GB/s = 0.5 ms
    assert b70["prefill_p512"] == pytest.approx({"serial": 1 / 1.5e-3, "overlap": 1000.0})
    assert b70["prefill_p8192"] == pytest.approx({"serial": 1 / 3.5e-4, "overlap": 4000.0})
    b40 = f["disk_bound_tok_s"]["nvme_exact_ram40"]
    # 25 ms + 100 MB / 1 GB/s = 100 ms: serial 8 tok/s, overlapped 10
    assert b40["decode_c1"] == pytest.approx({"serial": 8.0, "overlap": 10.0})
    assert b40["prefill_p512"] is None  # the row counted no prefill bytes
    assert "exact" not in f["disk_bound_tok_s"]
    assert ratios["nvme_exact_ram70_vs_disk_bound"] == pytest.approx(36.0 / 20.0)
    assert ratios["nvme_exact_ram40_vs_disk_bound"] == pytest.approx(20.0 / 8.0)


def test_gpu_slice_fast_row_gives_issue_16s_and_26s_ratios(tmp_path):
    """MOCK rows (made-up figures; the real fast row ran on the H200 on 2026-12-05,
    bench/results/h200-gpu_slice-fast-2026-12-05.json): issue 16's JSON contract,
    figures.decode_c1_tok_s.fast and the three fast ratios, and issue 26's fixed-split sweep and
    fallback share; fast runs only when asked for."""
    gs = _gpu_slice()
    assert "fast" not in gs.parse_args(["--model", "/x"]).modes.split(",")
    args = gs.parse_args(["--model", "/x", "--modes", "exact,fast"])
    assert args.modes == "exact,fast" and args.fixed_splits == [0, 10, 20, 30, 40]
    assert gs.parse_args(["--model", "/x", "--fixed-splits", ""]).fixed_splits == []
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    lane = {"jobs": 500, "fallbacks": 3, "lane_picks": 900, "lane_ms": 120.0, "layers": []}

    def split(c1, c4_agg, jobs, fallbacks):
        return {"decode": {"c1": {"per_stream_tok_s": c1, "aggregate_tok_s": c1},
                           "c4": {"per_stream_tok_s": c4_agg / 4, "aggregate_tok_s": c4_agg}},
                "lane": {"jobs": jobs, "fallbacks": fallbacks, "lane_picks": 2 * jobs}}  # fmt: skip

    fixed = {"0": split(40.0, 80.0, 0, 0), "10": split(47.0, 90.0, 200, 1),
             "20": split(54.0, 101.0, 400, 4), "30": split(50.0, 96.0, 600, 30),
             "40": split(44.0, 85.0, 800, 120)}  # fmt: skip
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 900.0, 3000.0, 6000.0, decode_hit_rate=0.5,
                           cache={"layer_hit_rate": [0.5] * 8}, slots=262),
        "stock_offload": _mock_row(10.0, 8.0, 6.0, 24.0, 300.0, 1500.0, 3000.0),
        "stock_offload_arena": _mock_row(16.0, 12.0, 8.0, 32.0, 400.0, 2000.0, 4000.0),
        "fast": _mock_row(52.0, 38.0, 25.0, 100.0, 900.0, 3000.0, 6000.0, lane=lane,
                          fixed_splits=fixed,
                          fixed_splits_by_spin={"5000": {"10": split(60.0, 95.0, 200, 0)}}),
    }  # fmt: skip
    r = combine(tmp_path, rows, dict(info, split=40))
    ratios, figures = r["ratios"], r["figures"]
    assert figures["decode_c1_tok_s"]["fast"] == 52.0
    assert ratios["fast_vs_exact"] == 52.0 / 40.0
    assert ratios["fast_vs_best_stock_offload"] == 52.0 / 16.0
    assert ratios["fast_c4_aggregate_vs_exact"] == 100.0 / 80.0
    assert figures["fast_lane"] == {"jobs": 500, "fallbacks": 3, "lane_picks": 900,
                                    "lane_ms": 120.0}  # fmt: skip
    # issue 26: fallbacks per lane job, and the router against the best of the fixed splits
    assert ratios["fast_lane_fallback_share"] == 3 / 500
    assert figures["fast_fixed_split_c1_tok_s"] == {"0": 40.0, "10": 47.0, "20": 54.0,
                                                    "30": 50.0, "40": 44.0}  # fmt: skip
    assert figures["fast_fixed_split_c4_aggregate_tok_s"]["20"] == 101.0
    assert figures["fast_fixed_split_lane"]["30"] == {"jobs": 600, "fallbacks": 30,
                                                      "lane_picks": 1200}  # fmt: skip
    assert ratios["fast_router_vs_best_fixed_split"] == 52.0 / 54.0
    assert figures["fast_lane_time"]["lane_ms_per_job"] == 120.0 / 500
    assert figures["fast_fixed_split_c1_tok_s_by_spin"] == {"5000": {"10": 60.0}}
    assert figures["fast_fixed_split_lane_by_spin"]["5000"]["10"]["jobs"] == 200
    assert figures["fast_lane_time"]["wait_ms_per_timed_call"] is None  # no timed layers
    assert "fast" not in figures["predicted"]  # the cost model has no fast row here
    assert figures["fast_router_after_sweep"] is None  # an older row: its own c1 above
    # a row that measured the router again right after the sweep: that is what the ratio takes
    rows["fast"]["router_after_sweep"] = split(57.0, 110.0, 300, 0)
    r = combine(tmp_path, rows, dict(info, split=40))
    assert r["ratios"]["fast_router_vs_best_fixed_split"] == 57.0 / 54.0
    assert r["figures"]["fast_router_after_sweep"]["decode"]["c1"]["per_stream_tok_s"] == 57.0
    assert r["ratios"]["fast_vs_exact"] == 52.0 / 40.0  # the row's own c1 still


def test_gpu_slice_sweeps_the_lanes_idle_spin_and_puts_the_default_back(monkeypatch):
    """--lane-spin-us: the fixed-split sweep again per spin, the lane (a MOCK of MailboxLane's
    idle_spin_ns; the sweep itself needs a GPU) set before each and reset after, even when a
    sweep raises."""
    gs = _gpu_slice()
    args = gs.parse_args(["--model", "/x", "--lane-spin-us", "200,5000"])
    assert args.lane_spin_us == [200, 5000]
    assert gs.parse_args(["--model", "/x"]).lane_spin_us == []
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--lane-spin-us", "-5"])

    class MockMailboxLane:
        idle_spin_ns = 200_000

    fast = types.SimpleNamespace(lane=MockMailboxLane())
    seen = []

    def sweep(loaded, fast_, percents, quick):
        seen.append(fast_.lane.idle_spin_ns)
        if len(seen) == 3:
            raise RuntimeError("a sweep failed")
        return {str(p): fast_.lane.idle_spin_ns for p in percents}

    monkeypatch.setattr(gs, "fixed_split_sweep", sweep)
    got = gs.spin_sweep(None, fast, [0, 10], True, [50, 5000])
    assert got == {"50": {"0": 50_000, "10": 50_000}, "5000": {"0": 5_000_000, "10": 5_000_000}}
    assert fast.lane.idle_spin_ns == 200_000
    with pytest.raises(RuntimeError, match="a sweep failed"):
        gs.spin_sweep(None, fast, [0], True, [7])
    assert fast.lane.idle_spin_ns == 200_000


def test_gpu_slice_says_where_a_lane_shares_time_goes():
    """Between two FastLane.stats(): the lane's ms a job and, over the device's timed layer
    calls, the mean GPU share and wait (issue 26: any lane use cost ~0.5 ms a layer on the
    H200 on 2026-12-05, and the sweep did not say which part)."""
    gs = _gpu_slice()

    def stats(jobs, lane_ms, layers):
        return {"jobs": jobs, "lane_ms": lane_ms,
                "layers": [dict(zip(("waits", "gpu_ms", "waited_ms"), v, strict=True))
                           for v in layers]}  # fmt: skip

    before = stats(10, 5.0, [(2, 1.0, 0.0), (1, 0.5, 0.0)])
    after = stats(30, 15.0, [(6, 5.0, 1.0), (4, 2.5, 2.0)])
    got = gs.where_the_time_goes(before, after)
    assert got == {"lane_ms": 10.0, "lane_ms_per_job": 0.5, "timed_calls": 7,
                   "gpu_ms_per_timed_call": 6.0 / 7, "wait_ms_per_timed_call": 3.0 / 7}  # fmt: skip
    assert gs.where_the_time_goes(after, after)["lane_ms_per_job"] is None


def test_gpu_slice_layer_major_rows_give_issue_28s_ratios(tmp_path):
    """MOCK rows (made-up figures; the layer-major rows have not run on a GPU): issue 28's JSON
    contract. Layer-major 8k at 2,048-token chunks and 32k against the one-pass stream bound
    (every expert of every MoE layer once, at the zero-copy rate measured between the stock
    and zerocopy rows), and 8k against exact's chunk-major figure of the same run."""
    gs = _gpu_slice()
    default = gs.parse_args(["--model", "/x"])
    assert "exact_layer_major" not in default.modes.split(",") and default.long_prefill is False
    args = gs.parse_args(["--model", "/x", "--modes", "stock,exact,exact_layer_major"])
    assert args.long_prefill is True and args.stream_t == 8
    assert gs.parse_args(["--model", "/x", "--modes", "exact_layer_major",
                          "--no-long-prefill"]).long_prefill is False  # fmt: skip
    assert [n for _, n, _ in gs.prefill_shapes(True, 65536)] == [512, 8192, 8192, 32768]
    assert [n for _, n, _ in gs.prefill_shapes(True, 32768)] == [512, 8192, 8192]  # no room
    assert [n for _, n, _ in gs.prefill_shapes(False, None)] == [512, 8192, 8192]
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    passes = {"p8192": {"passes": 1, "staging_skips": 21}, "p32768": {"passes": 1}}
    rows = {
        "stock": _mock_row(200.0, 150.0, 100.0, 400.0, 9000.0, 20000.0, 24000.0, p32768=19000.0),
        "zerocopy": _mock_row(25.0, 20.0, 15.0, 60.0, 500.0, 900.0, 1000.0),
        "exact": _mock_row(130.0, 90.0, 60.0, 240.0, 5000.0, 4500.0, 11000.0, p32768=4400.0,
                           decode_hit_rate=0.43, cache={"layer_hit_rate": [0.43] * 8}, slots=262),
        "exact_layer_major": _mock_row(129.0, 90.0, 60.0, 238.0, 5000.0, 11250.0, 11000.0,
                                       p32768=16000.0, decode_hit_rate=0.43, slots=262,
                                       cache={"layer_hit_rate": [0.43] * 8}, layer_major=passes),
        "stock_offload_stream": _mock_row(16.0, 12.0, 8.0, 32.0, 400.0, 2500.0, 4000.0,
                                          p32768=2600.0),
    }  # fmt: skip
    for mode, row in rows.items():
        stream_t = 8 if mode == "stock_offload_stream" else None
        r = {"mode": mode, "info": dict(info, split=255, stream_t=stream_t), "row": row}
        (tmp_path / f"row-{mode}.json").write_text(json.dumps(r))
    r = run_bench("gpu_slice", "--combine", str(tmp_path))
    ratios, figures = r["ratios"], r["figures"]
    # zero-copy rate: 8 picks x 8 layers x 9,437,184 B a token over (1/25 - 1/200) s
    gbps = 64 * 9_437_184 / (1 / 25 - 1 / 200) / 1e9
    assert figures["zero_copy_gbps"] == pytest.approx(gbps)
    # one pass over the routed experts of the 7 MoE layers a prefill runs (not the 8th, the last)
    every_expert_s = 7 * 288 * 9_437_184 / (gbps * 1e9)
    assert figures["prefill8k_stream_bound_tok_s"] == pytest.approx(8192 / every_expert_s)
    assert figures["prefill32k_stream_bound_tok_s"] == pytest.approx(32768 / every_expert_s)
    assert figures["prefill_32768_tok_s"] == {"stock": 19000.0, "zerocopy": None, "exact": 4400.0,
                                              "exact_layer_major": 16000.0,
                                              "stock_offload_stream": 2600.0}  # fmt: skip
    assert ratios["prefill8k_chunk2048_vs_stream_once"] == pytest.approx(
        11250.0 * every_expert_s / 8192
    )
    assert ratios["prefill32k_vs_stream_once"] == pytest.approx(16000.0 * every_expert_s / 32768)
    assert ratios["prefill8k_chunk2048_vs_before"] == 11250.0 / 4500.0
    assert ratios["prefill8k_chunk2048_vs_stock_stream"] == 11250.0 / 2500.0
    assert ratios["prefill32k_vs_stock_stream"] == 16000.0 / 2600.0
    assert ratios["prefill32k_vs_stock_vram"] == 16000.0 / 19000.0
    assert ratios["prefill8k_chunk2048_vs_stock_vram"] == 11250.0 / 20000.0
    assert ratios["layer_major_decode_c1_vs_exact"] == 129.0 / 130.0
    assert figures["layer_major"] == passes
    assert r["config"]["stream_t"] == 8


def test_gpu_slice_without_layer_major_rows_leaves_issue_28s_ratios_null(tmp_path):
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    row = _mock_row(130.0, 90.0, 60.0, 240.0, 5000.0, 4500.0, 11000.0, decode_hit_rate=0.43,
                    cache={"layer_hit_rate": [0.43] * 8}, slots=262)  # fmt: skip
    (tmp_path / "row-exact.json").write_text(
        json.dumps({"mode": "exact", "info": info, "row": row})
    )
    ratios = run_bench("gpu_slice", "--combine", str(tmp_path))["ratios"]
    for name in ("prefill8k_chunk2048_vs_stream_once", "prefill32k_vs_stream_once",
                 "prefill8k_chunk2048_vs_before"):  # fmt: skip
        assert ratios[name] is None, name


def test_ram_tier_policy_contract(tmp_path):
    synthetic = ("--layers", "2", "--experts", "32", "--top-k", "4", "--hidden", "64",
                 "--tokens", "24", "--vram-share", "0.1")  # fmt: skip
    trace = tmp_path / "trace.npz"
    r = run_bench("ram_tier_policy", *synthetic, "--write-trace", str(trace), "--burst", "1")
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    assert (cfg["num_keys"], cfg["ram_slots"]) == (64, 45)
    assert f["hits"]["oracle"] >= max(f["hits"][p] for p in ("ram_tier", "wave_clock", "clock"))
    for p in ("ram_tier", "wave_clock", "clock", "oracle"):
        assert f[f"{p}_hit_rate"] == f["hits"][p] / f["accesses"]
    assert ratios["ram_tier_vs_oracle"] == f["ram_tier_hit_rate"] / f["oracle_hit_rate"]
    assert ratios["ram_tier_vs_wave_clock"] == f["ram_tier_hit_rate"] / f["wave_clock_hit_rate"]
    assert f["oracle_minus_ram_tier_points"] == 100 * (
        f["oracle_hit_rate"] - f["ram_tier_hit_rate"]
    )
    assert f["waves"] == 24 * 2 and f["widest_wave"] <= 4
    assert set(f["us_per_wave"]) == set(f["c_ns_per_wave"]) == {"ram_tier", "wave_clock"}
    burst = f["burst"]
    assert (burst["burst_waves"], burst["burst_keys"], burst["at_wave"]) == (2, 64, 24)
    for p in ("ram_tier", "wave_clock"):
        assert 0 <= burst[p]["kept_share"] <= 1
    assert cfg["ram_tier_policy"]["policy"] == "freq"
    again = run_bench("ram_tier_policy", "--trace", str(trace))
    assert again["figures"]["hits"] == f["hits"] and again["config"]["trace"] == str(trace)
    warm = run_bench("ram_tier_policy", *synthetic, "--warm")
    assert warm["figures"]["hits"] == f["hits"]  # the measured streams are drawn the same
    w = warm["figures"]["warm"]
    assert 0 < w["seeded"] <= 45 and w["earlier_accesses"] > 0
    assert w["oracle_hit_rate"] >= max(w["ram_tier_hit_rate"], w["wave_clock_hit_rate"])
    # several cases: each under figures.cases, the worst at the top
    both = run_bench("ram_tier_policy", "--trace", str(trace), "--ram-share", "0.4,0.7")
    cases = both["figures"]["cases"]
    assert [c["case"]["ram_share"] for c in cases] == [0.4, 0.7]
    assert cases[1]["figures"]["hits"] == f["hits"]
    worst = max(c["figures"]["oracle_minus_ram_tier_points"] for c in cases)
    assert both["figures"]["max_oracle_minus_ram_tier_points"] == worst
    assert "max_oracle_minus_ram_tier_points_by_vram_share" not in both["figures"]  # a file
    assert both["ratios"]["ram_tier_vs_oracle_min"] == min(
        c["ratios"]["ram_tier_vs_oracle"] for c in cases
    )


def test_prefix_cache_contract(tmp_path):
    from glm53.synth.shapes import preset
    from glm53.synth.writer import write_checkpoint

    # the server finds this as its demo checkpoint (quicker to write than --demo's routing)
    write_checkpoint(
        preset("demo"), tmp_path / "demo-checkpoint", seed=0, routing_source="stand-in"
    )
    r = run_bench(
        "prefix_cache", "--demo", "--cache-dir", str(tmp_path), "--first-tokens", "140",
        "--chunk-size", "64", "--answer-tokens", "4", "--turn-tokens", "8", "--turns", "3",
    )  # fmt: skip
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    # turns of 140, 152 and 164 tokens: the later two resume at 128 (snapshots at 64 and 128)
    assert f["prompt_tokens_by_turn"] == [140, 152, 164]
    assert f["cached_tokens_by_turn"] == [0, 128, 128]
    assert f["prefilled_tokens_by_turn"] == [140, 24, 36]
    assert len(f["ttft_s_by_turn"]) == 3 and len(f["cold_ttft_s_same_prefill"]) == 2
    assert ratios["ttft_first_vs_later"] > 0 and ratios["later_vs_cold_same_prefill"] > 0
    assert (cfg["engine"], cfg["chunk_size"]) == ("cpu", 64)


def test_benchmarks_import_the_installed_glm53_not_the_source_tree():
    """A benchmark that puts the repository root first on sys.path imports glm53 from the
    source tree, which has no built modules (glm53._buildinfo, the native extensions) in a
    non-editable install: `No module named 'glm53._buildinfo'`."""
    offenders = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for line in path.read_text().splitlines():
            if "sys.path.insert" in line and ('".."' in line or ".parent.parent" in line):
                offenders.append(f"{path.name}: {line.strip()}")
    assert offenders == []


def test_micro_clock_contract():
    r = run_bench(
        "micro_clock", "--tokens", "400", "--batch-tokens", "4", "--py-tokens", "100",
        "--repeats", "1",
    )  # fmt: skip
    # the C table and the Python model ran the same prefix (the bench checks their counters)
    assert r["figures"]["c_batch_ops"] > 0 and r["ratios"]["c_batch_over_py_model"] > 0


def test_ram_cap_contract():
    r = run_bench("ram_cap", "--shares", "1", "--prompt", "8", "--tokens", "2")
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    (run,) = f["runs"]
    assert (run["share"], run["slots"], cfg["num_records"]) == (1.0, 192, 192)
    assert run["cap_bytes"] == 192 * cfg["record_bytes"]
    assert run["peak_rss_bytes"] == run["cap_bytes"] + run["overhead_bytes"]
    assert f["overhead_max_bytes"] == run["overhead_bytes"] > 0
    assert ratios["overhead_max_vs_all_experts"] == 1.0


def test_health_under_load_contract():
    """The real server under one kind of large request (the quickest); nothing timed here."""
    r = run_bench("health_under_load", "--reps", "1", "--only", "chat")
    f, cfg = r["figures"], r["config"]
    assert f["health_polls"] >= 1 and f["health_non_200"] == 0
    assert f["load_status_codes"] == [[200, 200]]
    assert 0 < f["health_median_ms"] <= f["health_max_ms"]
    assert cfg["only"] == "chat" and cfg["target_ms"] == 100.0
    assert r["ratios"]["health_max_vs_target"] == f["health_max_ms"] / 100.0


def test_gpu_slice_nvme_rows_give_the_lanes_ratio_against_nvme_exact(tmp_path):
    """MOCK rows (made-up figures; the real rows: H200, 2026-12-05, bench/results/README.md):
    issue 27's ratios.nvme_vs_nvme_exact_ram70 (and ram40) and each nvme row's lane counts; the
    nvme rows run only when asked for, and only with --store."""
    gs = _gpu_slice()
    default = gs.parse_args(["--model", "/x", "--store", "/s"]).modes.split(",")
    assert "nvme_exact_ram70" in default and "nvme_ram70" not in default
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--modes", "nvme_exact_ram70,nvme_ram70"])
    args = gs.parse_args(["--model", "/x", "--store", "/s", "--modes", "nvme_ram70,nvme_ram40"])
    assert args.modes == "nvme_ram70,nvme_ram40"
    assert gs.NVME_RAM_SHARE["nvme_ram70"] == 0.7 and "nvme_ram40" in gs.LANE_ROWS
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    lane = {"jobs": 100, "fallbacks": 1, "lane_picks": 300, "lane_ms": 12.5}
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 900.0, 3000.0, 6000.0, decode_hit_rate=0.5,
                           cache={"layer_hit_rate": [0.5] * 8}, slots=262),
        "nvme_exact_ram70": _mock_row(30.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0),
        "nvme_exact_ram40": _mock_row(20.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0),
        "nvme_ram70": dict(_mock_row(39.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0), lane=lane),
        "nvme_ram40": dict(_mock_row(22.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0), lane=lane),
    }  # fmt: skip
    r = combine(tmp_path, rows, info)
    assert r["ratios"]["nvme_vs_nvme_exact_ram70"] == pytest.approx(39.0 / 30.0)
    assert r["ratios"]["nvme_vs_nvme_exact_ram40"] == pytest.approx(22.0 / 20.0)
    assert r["figures"]["nvme_lane"] == {"nvme_ram70": lane, "nvme_ram40": lane}


def test_gpu_slice_prefetch_rows_give_their_ratio_against_prefetch_off_and_counters(tmp_path):
    """MOCK rows (made-up figures; the prefetch rows have not run on a GPU): issue 27's
    ratios.nvme_exact_ram70_prefetch_vs_off (and ram40), and figures.nvme_prefetch with every
    nvme_exact row's prefetch counters (zeros where it is off); the prefetch rows run only when
    asked for, only with --store, and load nvme-exact with --nvme-prefetch next-layer."""
    gs = _gpu_slice()
    default = gs.parse_args(["--model", "/x", "--store", "/s"]).modes.split(",")
    assert "nvme_exact_ram70" in default and "nvme_exact_ram70_prefetch" not in default
    with pytest.raises(SystemExit):
        gs.parse_args(["--model", "/x", "--modes", "nvme_exact_ram70,nvme_exact_ram70_prefetch"])
    modes = "nvme_exact_ram70,nvme_exact_ram70_prefetch,nvme_exact_ram40,nvme_exact_ram40_prefetch"
    assert gs.parse_args(["--model", "/x", "--store", "/s", "--modes", modes]).modes == modes
    assert gs.NVME_RAM_SHARE["nvme_exact_ram70_prefetch"] == 0.7
    assert gs.NVME_RAM_SHARE["nvme_exact_ram40_prefetch"] == 0.4
    assert set(gs.PREFETCH_ROWS) == {"nvme_exact_ram70_prefetch", "nvme_exact_ram40_prefetch"}
    from glm53.doctor.geometry import Geometry
    from glm53.tiers.decode_prefetch import DecodePrefetch

    assert gs.PREFETCH_COUNTERS == DecodePrefetch.COUNTERS  # the counters the RAM stats report
    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    off = dict.fromkeys(DecodePrefetch.COUNTERS, 0)
    on70 = dict(off, prefetch_waves=900, prefetch_keys=4000, prefetch_hits=3000,
                prefetch_wasted=1000, prefetch_bytes=4000 * 9_437_184)  # fmt: skip
    on40 = dict(on70, prefetch_keys=6000, prefetch_wasted=3000)
    rows = {
        "exact": _mock_row(40.0, 30.0, 20.0, 80.0, 900.0, 3000.0, 6000.0, decode_hit_rate=0.5,
                           cache={"layer_hit_rate": [0.5] * 8}, slots=262),
        "nvme_exact_ram70": dict(_mock_row(30.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0),
                                 ram=dict(off, slots=100)),
        "nvme_exact_ram40": dict(_mock_row(20.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0),
                                 ram=dict(off, slots=60)),
        "nvme_exact_ram70_prefetch": dict(
            _mock_row(33.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0), ram=dict(on70, slots=100)),
        "nvme_exact_ram40_prefetch": dict(
            _mock_row(25.0, 16.0, 10.0, 40.0, 500.0, 1500.0, 3000.0), ram=dict(on40, slots=60)),
    }  # fmt: skip
    r = combine(tmp_path, rows, info)
    assert r["ratios"]["nvme_exact_ram70_prefetch_vs_off"] == pytest.approx(33.0 / 30.0)
    assert r["ratios"]["nvme_exact_ram40_prefetch_vs_off"] == pytest.approx(25.0 / 20.0)
    assert r["ratios"]["nvme_exact_ram70_prefetch_vs_disk_bound"] is None  # no read rate here
    assert r["figures"]["nvme_prefetch"] == {
        "nvme_exact_ram70": off,
        "nvme_exact_ram40": off,
        "nvme_exact_ram70_prefetch": on70,
        "nvme_exact_ram40_prefetch": on40,
    }


def test_gpu_slice_without_prefetch_rows_leaves_their_ratios_null(tmp_path):
    """A MOCK nvme_exact row alone (made-up figures, no RAM stats): no prefetch ratio."""
    from glm53.doctor.geometry import Geometry

    geo = Geometry("slice", 8, 8, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 8, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    rows = {"nvme_exact_ram70": _mock_row(30.0, 28.0, 18.0, 72.0, 800.0, 2500.0, 5000.0)}
    r = combine(tmp_path, rows, info)
    assert r["ratios"]["nvme_exact_ram70_prefetch_vs_off"] is None
    assert r["ratios"]["nvme_exact_ram40_prefetch_vs_off"] is None
    assert r["figures"]["nvme_prefetch"] == {}  # a row without its RAM stats reports none


def test_gpu_slice_predicts_prefill_from_its_own_stock_row_and_exacts_staging(tmp_path):
    """The committed H200 s4 run's stock and exact prefill (bench/results/, real figures; the
    decode figures are copied too) through --combine: exact's prefill prediction takes the GPU's
    compute from the stock row (costmodel.prefill_compute_fit) and the whole-layer stages its
    copy-engine staging ran, so its measured / predicted are tests/test_doctor_prefill_measured's."""
    from glm53.doctor import costmodel
    from glm53.doctor.geometry import Geometry

    run = json.loads((ROOT / "bench/results/h200-gpu_slice-2026-11-30-s4.json").read_text())
    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 713_091_196, 3)
    info = {"moe_layers": 6, "experts": 288, "record_bytes": 9_437_184, "device": "H200",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    for mode in ("stock", "exact"):
        src = run["config"]["rows"][mode]
        row = {"decode": src["decode"], "prefill": src["prefill"]}
        if mode == "exact":
            row |= {"slots": 197, "decode_hit_rate": src["decode_hit_rate"], "stage_dma": True,
                    "cache": {"layer_hit_rate": [0.4] * 6}}  # fmt: skip
        (tmp_path / f"row-{mode}.json").write_text(
            json.dumps({"mode": mode, "info": info, "row": row})
        )
    r = run_bench("gpu_slice", "--combine", str(tmp_path))
    stock = run["config"]["rows"]["stock"]["prefill"]
    fit = costmodel.prefill_compute_fit(geo, (512, stock["p512"]), (8192, stock["p8192_c8192"]))
    x = costmodel.CostInputs(vram_slots=197, pcie_gbps=50.0, vram_gbps=4800.0,
                             gpu_fp16_tflops=989.0, prefill_chunk_ms=fit[0],
                             prefill_token_us=fit[1], stage_records=288,
                             stage_last_layer=True)  # the run predates stage_layers  # fmt: skip
    want = costmodel.exact_rows(x, geo)
    assert r["figures"]["predicted"]["exact"] == pytest.approx(want)
    vs = r["ratios"]["measured_vs_predicted"]
    assert vs["exact"]["prefill_512_tok_s"] == pytest.approx(0.76, abs=0.01)
    assert vs["exact"]["prefill_8192_tok_s"] == pytest.approx(1.06, abs=0.01)
    assert vs["exact"]["prefill_8192_chunk8192_tok_s"] == pytest.approx(0.81, abs=0.01)
    assert vs["stock"]["prefill_8192_tok_s"] == pytest.approx(1.04, abs=0.01)  # held out


def test_gpu_slice_loan_row_is_predicted_with_the_lent_slots_in_decode_only(tmp_path):
    """MOCK exact and exact_loan rows (made-up figures; the loan has not run on a GPU): the loan
    row's `slots` count its 576 lent staging records; the cost model gives them to its decode
    and not to its prefill, and the ratios set it against exact and the best stock offload."""
    from glm53.doctor.geometry import Geometry

    gs = _gpu_slice()
    assert "exact_loan" not in gs.parse_args(["--model", "/x"]).modes  # on request
    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 6, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    cache = {"layer_hit_rate": [0.4] * 6}
    loan = {"stage_loan_slots": 576, "stage_loan_with_cache": True, "stage_loans": 3,
            "stage_recalls": 2}  # fmt: skip
    rows = {
        "exact": _mock_row(130.0, 90.0, 60.0, 240.0, 1000.0, 5000.0, 11000.0,
                           decode_hit_rate=0.43, cache=cache, slots=197),
        "exact_loan": _mock_row(180.0, 120.0, 75.0, 300.0, 1000.0, 5000.0, 11000.0,
                                decode_hit_rate=0.8, cache=cache, slots=197 + 576,
                                stage_loan=loan),
        "stock_offload_arena": _mock_row(70.0, 50.0, 28.0, 112.0, 300.0, 2400.0, 4600.0),
    }  # fmt: skip
    r = combine(tmp_path, rows, info)
    pred = r["figures"]["predicted"]
    assert pred["exact_loan"]["decode_c1_tok_s"] > pred["exact"]["decode_c1_tok_s"]
    assert pred["exact_loan"]["hit_rate"] > pred["exact"]["hit_rate"]
    for name in ("prefill_512_tok_s", "prefill_8192_tok_s", "prefill_8192_chunk8192_tok_s"):
        assert pred["exact_loan"][name] == pytest.approx(pred["exact"][name])
    ratios = r["ratios"]
    assert ratios["exact_loan_vs_exact"] == 180.0 / 130.0
    assert ratios["exact_loan_c4_aggregate_vs_exact"] == 300.0 / 240.0
    assert ratios["exact_loan_vs_best_stock_offload"] == 180.0 / 70.0


def test_gpu_slice_copy_first_row_gives_the_stage_orders_side_by_side(tmp_path):
    """MOCK exact and exact_copy_first rows (made-up figures): the row whose stages queue the
    copy before the unstage kernel (PrefillStager.copy_first) against exact's prefill, per
    shape; the copy_first row is on request only."""
    from glm53.doctor.geometry import Geometry

    gs = _gpu_slice()
    assert "exact_copy_first" not in gs.parse_args(["--model", "/x"]).modes
    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 6, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    cache = {"layer_hit_rate": [0.4] * 6}
    rows = {
        "exact": _mock_row(130.0, 90.0, 60.0, 240.0, 1200.0, 6000.0, 14000.0,
                           decode_hit_rate=0.43, cache=cache, slots=197),
        "exact_copy_first": _mock_row(131.0, 90.0, 60.0, 240.0, 1800.0, 7000.0, 16000.0,
                                      decode_hit_rate=0.43, cache=cache, slots=197),
    }  # fmt: skip
    ratios = combine(tmp_path, rows, info)["ratios"]
    assert ratios["exact_copy_first_prefill512_vs_exact"] == 1800.0 / 1200.0
    assert ratios["exact_copy_first_prefill8k_vs_exact"] == 7000.0 / 6000.0
    assert ratios["exact_copy_first_prefill8k_one_chunk_vs_exact"] == 16000.0 / 14000.0


def test_gpu_slice_predicts_at_the_link_rate_its_rows_measured(tmp_path):
    """MOCK exact rows (made-up figures): each row records the link's pinned host-to-device rate
    as glm53 doctor's probe measures it (info.pcie_h2d_gbps); the predictions take the rows'
    median unless --predict-pcie-gbps names one, and rows that measured none keep the assumed
    50 GB/s. A faster link predicts a faster exact decode (its misses cross it)."""
    from glm53.doctor.geometry import Geometry

    gs = _gpu_slice()
    assert gs.parse_args(["--model", "/x"]).predict_pcie_gbps is None
    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 1_000_000_000, 3)
    info = {"moe_layers": 6, "experts": 288, "record_bytes": 9_437_184, "device": "MOCK",
            "geometry": {f: getattr(geo, f) for f in geo.__struct_fields__}}  # fmt: skip
    cache = {"layer_hit_rate": [0.4] * 6}
    row = _mock_row(150.0, 95.0, 55.0, 220.0, 1200.0, 6000.0, 14000.0, decode_hit_rate=0.42,
                    cache=cache, slots=197)  # fmt: skip
    rows = {"exact": row, "exact_clock": row, "exact_loan": dict(row, stage_loan={})}
    rates = {"exact": 55.5, "exact_clock": 54.0, "exact_loan": 58.0}
    (tmp_path / "m").mkdir()
    measured = combine(tmp_path / "m", rows, lambda m: dict(info, pcie_h2d_gbps=rates[m]))
    inputs = measured["config"]["prediction_inputs"]
    assert inputs["pcie_gbps"] == 55.5 and inputs["pcie_source"].startswith("measured")
    (tmp_path / "a").mkdir()
    assumed = combine(tmp_path / "a", {"exact": row}, info)
    a_inputs = assumed["config"]["prediction_inputs"]
    assert a_inputs["pcie_gbps"] == 50.0 and a_inputs["pcie_source"].startswith("assumed")
    fast = measured["figures"]["predicted"]["exact"]["decode_c1_tok_s"]
    assert fast > assumed["figures"]["predicted"]["exact"]["decode_c1_tok_s"]
    given = run_bench("gpu_slice", "--combine", str(tmp_path / "m"), "--predict-pcie-gbps", "50")
    assert given["config"]["prediction_inputs"]["pcie_source"] == "--predict-pcie-gbps"
    assert given["figures"]["predicted"]["exact"] == assumed["figures"]["predicted"]["exact"]


def test_gpu_slice_lane_rows_pin_as_the_server_does_unless_told_not_to():
    """The fast and nvme rows pin the driving thread and the lane's poller off the lane's cores
    (glm53.tiers.thread_pins.lane_threads_pinned, tested in tests/test_thread_pins.py) by default;
    --no-lane-pins measures the unpinned layout the fast row ran with before."""
    gs = _gpu_slice()
    assert gs.parse_args(["--model", "/x"]).lane_pins is True
    assert gs.parse_args(["--model", "/x", "--no-lane-pins"]).lane_pins is False


def test_gpu_slice_nvme_rows_ram_cap_and_read_rate_on_a_real_store(small_store):
    """The nvme rows' two store figures, on a real packed store (16 records of 77,824 bytes)
    read with O_DIRECT: --ram-cap as the row's share of the store's records, and the read
    rate beside it through the engine's reader (every record once, then the rate)."""
    gs = _gpu_slice()
    args = gs.parse_args(["--model", "/x", "--store", str(small_store), "--read-batch", "3",
                          "--modes", "exact,nvme_exact_ram70,nvme_exact_ram70_prefetch"])  # fmt: skip
    record = 77_824
    assert gs.nvme_ram_cap(args.store, "nvme_exact_ram70") == 11 * record  # int(0.7 * 16)
    assert gs.nvme_ram_cap(args.store, "nvme_exact_ram70_prefetch") == 11 * record
    assert gs.nvme_ram_cap(args.store, "nvme_ram40") == 6 * record  # int(0.4 * 16)
    rate = gs.store_read_rate(args)
    assert (rate["records_read"], rate["bytes_read"], rate["batch_records"]) == (16, 16 * record, 3)
    assert rate["bytes_per_s"] == rate["bytes_read"] / rate["seconds"]
    json.dumps(rate)  # the row's info holds it as JSON


def test_gpu_slice_predicts_a_rows_prefill_with_the_layers_its_stager_staged():
    """A staged exact row says how many MoE layers its stager stages in prefill (stage_layers:
    all but the last since 2026-12-05, glm53.exl3.hooks.prefill_moe_count); a row without the
    field predates it and staged every one. Any other count is refused, naming both it knows;
    a prediction for another geometry (full_model) takes what this code stages."""
    from glm53.doctor import costmodel
    from glm53.doctor.geometry import Geometry

    gs = _gpu_slice()
    geo = Geometry("slice", 8, 6, 288, 8, 9_437_184, 713_091_196, 3)
    rows = {"exact": {"stage_dma": True, "stage_layers": 5}}
    assert gs.prefill_inputs(rows, "exact", geo) == {"stage_records": 288,
                                                     "stage_last_layer": False}  # fmt: skip
    old = {"exact": {"stage_dma": True}}
    assert gs.prefill_inputs(old, "exact", geo)["stage_last_layer"] is True
    assert "stage_last_layer" not in gs.prefill_inputs(old, "exact", geo, target=geo)
    with pytest.raises(
        ValueError, match=r"staged 3 MoE layers in prefill; .* 6 \(every one\) or 5"
    ):
        gs.prefill_inputs({"exact": {"stage_dma": False, "stage_layers": 3}}, "exact", geo)
    # the last layer unstaged: a link-bound chunk saves that layer's stage over its compute
    x = costmodel.CostInputs(vram_slots=197, pcie_gbps=50.0, vram_gbps=4800.0,
                             gpu_fp16_tflops=989.0, prefill_chunk_ms=8.0, prefill_token_us=4.0,
                             stage_records=288)  # fmt: skip
    c = costmodel._chunk_compute_s(x, geo, 2048) / geo.num_layers
    s = costmodel._staged_s(x, geo)
    assert s > c
    both = costmodel.exact_chunk_s(x, geo, 2048)
    every = costmodel.exact_chunk_s(msgspec.structs.replace(x, stage_last_layer=True), geo, 2048)
    assert every - both == pytest.approx(s - c)


def test_gpu_slice_lane_decode_forces_the_share_and_puts_the_router_back(monkeypatch):
    """lane_decode (the fixed-split sweep's runs, and the router's run right after it): the
    share forced on the router (a MOCK of LaneRouter; the decode itself needs a GPU, MOCK too)
    for the decode, None after, even when the decode raises; the lane's counts are the run's."""
    gs = _gpu_slice()
    shares = []
    counts = iter([{"jobs": 10, "fallbacks": 1, "lane_picks": 20},
                   {"jobs": 15, "fallbacks": 1, "lane_picks": 31}])  # fmt: skip
    fast = types.SimpleNamespace(
        router=types.SimpleNamespace(set_forced_share=shares.append),
        stats=lambda: next(counts), step=None,
    )  # fmt: skip
    loaded = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    monkeypatch.setattr(gs, "decode_run", lambda loaded, vocab, b, n_new, step: {"b": b})
    monkeypatch.setattr(gs, "where_the_time_goes", lambda before, after: {"lane_ms": 1.0})
    got = gs.lane_decode(loaded, fast, 0.3, quick=True)
    assert shares == [0.3, None]
    assert got == {"decode": {"c1": {"b": 1}, "c4": {"b": 4}},
                   "lane": {"jobs": 5, "fallbacks": 0, "lane_picks": 11, "lane_ms": 1.0}}  # fmt: skip

    def fails(*args, **kwargs):
        raise RuntimeError("a decode failed")

    monkeypatch.setattr(gs, "decode_run", fails)
    shares.clear()
    with pytest.raises(RuntimeError, match="a decode failed"):
        gs.lane_decode(loaded, types.SimpleNamespace(router=fast.router, stats=dict, step=None),
                       None, quick=True)  # fmt: skip
    assert shares == [None, None]
