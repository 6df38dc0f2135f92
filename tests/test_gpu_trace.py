"""bench/tracelib.py (the reading of a torch.profiler trace that bench/gpu_trace.py records on the
GPU) on a hand-built trace whose answer is known, and on a real CPU trace from torch.profiler,
which has the real format's host ranges and no GPU activity. bench/gpu_trace.py itself needs a
GPU: here only its arguments and the ratios it derives from summaries."""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


tracelib = _bench("tracelib")


def X(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 1,
            "args": args}  # fmt: skip


def hand_trace(sync_from=600.0) -> dict:
    """The scenario runs 0-1000 us. Stream 7: a GEMM 100-300, the lane's wait 400-600, a GEMM
    800-900. Stream 20: a 2.5 MB host-to-device copy 250-500 (under both first kernels for
    50 + 100 us). 600-800 the GPU idles while the host sits in cudaStreamSynchronize."""
    return {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
            X("user_annotation", tracelib.SCENARIO, 0.0, 1000.0),
            X("user_annotation", tracelib.STEP, 50.0, 400.0),
            X("user_annotation", tracelib.STEP, 500.0, 450.0),
            X(
                "kernel",
                "void gemm_kernel<float, 128>(float const*, float*)",
                100.0,
                200.0,
                stream=7,
            ),
            X(
                "kernel",
                "void (anonymous namespace)::wait_kernel(g53_lane_dev*, float const*)",
                400.0,
                200.0,
                stream=7,
            ),  # fmt: skip
            X(
                "kernel",
                "void gemm_kernel<float, 128>(float const*, float*)",
                800.0,
                100.0,
                stream=7,
            ),
            X(
                "gpu_memcpy",
                "Memcpy HtoD (Pinned -> Device)",
                250.0,
                250.0,
                stream=20,
                bytes=2_500_000,
            ),  # fmt: skip
            X("cuda_runtime", "cudaLaunchKernel", 90.0, 5.0),
            X("cuda_runtime", "cudaStreamSynchronize", sync_from, 350.0),
            X(
                "kernel",
                "void gemm_kernel<float, 128>(float const*, float*)",
                1200.0,
                50.0,
                stream=7,
            ),  # outside the scenario: not counted  # fmt: skip
        ]
    }


def test_summary_of_a_hand_built_trace():
    s = tracelib.summarize(hand_trace())
    approx = pytest.approx
    assert s["wall_ms"] == approx(1.0) and s["gpu_events"] == 4
    assert s["lead_ms"] == approx(0.1) and s["tail_ms"] == approx(0.1)
    assert s["gpu_span_ms"] == approx(0.8)
    assert s["kernel_ms"] == approx(0.5) and s["copy_ms"] == approx(0.25)
    assert s["overlap_ms"] == approx(0.15)  # 250-300 and 400-500
    assert s["idle_ms"] == approx(0.2)
    assert s["copies"] == {"HtoD": {"count": 1, "bytes": 2_500_000, "ms": approx(0.25),
                                    "gbps": approx(10.0)}}  # fmt: skip
    assert s["streams"] == {"7": {"events": 3, "busy_ms": approx(0.5)},
                            "20": {"events": 1, "busy_ms": approx(0.25)}}  # fmt: skip
    (gap,) = s["gaps"]
    assert gap["at_ms"] == approx(0.6) and gap["ms"] == approx(0.2)
    assert gap["after_gpu"] == "wait_kernel" and gap["before_gpu"] == "gemm_kernel<float, 128>"
    assert gap["host"][0] == "cudaStreamSynchronize" and tracelib.STEP in gap["host"]
    assert s["idle_by_host"] == {"cudaStreamSynchronize": approx(0.2)}
    assert s["named"]["lane_wait"]["count"] == 1
    assert s["named"]["lane_wait"]["total_ms"] == approx(0.2)
    assert [k["name"] for k in s["kernels"]] == ["gemm_kernel<float, 128>", "wait_kernel"]
    assert s["kernels"][0]["count"] == 2 and s["kernels"][0]["share"] == approx(0.6)
    # the copy (250-500) overlaps the first GEMM (100-300) and the wait, not the second GEMM
    assert s["kernels"][0]["beside_copy"] == {"count": 1, "ms": approx(0.2)}
    assert s["kernels"][1]["beside_copy"] == {"count": 1, "ms": approx(0.2)}
    merged = [(0.0, 10.0), (20.0, 30.0)]
    assert [tracelib.overlaps(iv, merged) for iv in ((10.0, 20.0), (5.0, 12.0), (25.0, 40.0),
            (30.0, 31.0), (-5.0, 0.0), (12.0, 21.0))] == [False, True, True, False, False, True]  # fmt: skip
    assert tracelib.steps(hand_trace())["count"] == 2


def test_idle_with_no_host_call_is_named_so_and_short_gaps_are_pooled():
    s = tracelib.summarize(hand_trace(sync_from=2000.0), min_gap_us=300.0)
    assert s["gaps"] == [] and s["gaps_total"]["count"] == 1
    assert list(s["idle_by_host"]) == ["(gaps under 300 us)"]
    s = tracelib.summarize(hand_trace(sync_from=2000.0))
    assert s["gaps"][0]["host"] == [tracelib.STEP]  # only the step range spans 700 us


def test_breakdown_splits_the_extra_wall_time():
    a = tracelib.summarize(hand_trace())
    b = dict(a, wall_ms=0.6, lead_ms=0.05, tail_ms=0.05, kernel_ms=0.5, copy_ms=0.0,
             overlap_ms=0.0, idle_ms=0.0)  # fmt: skip
    d = tracelib.breakdown(a, b)
    approx = pytest.approx
    assert d["wall_ms"] == approx(0.4)
    assert (d["lead_ms"], d["tail_ms"], d["kernel_ms"]) == (approx(0.05), approx(0.05), approx(0))
    assert d["copy_not_hidden_ms"] == approx(0.1) and d["idle_ms"] == approx(0.2)
    # the parts add up to the wall here (no memsets): lead + tail + kernel + copy + idle
    parts = sum(v for k, v in d.items() if k != "wall_ms")
    assert parts == approx(d["wall_ms"])


def test_no_scenario_range_is_an_error_that_says_what_to_do():
    t = hand_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if e.get("name") != tracelib.SCENARIO]
    with pytest.raises(ValueError, match=tracelib.SCENARIO):
        tracelib.summarize(t)


def test_a_real_cpu_profiler_trace_reads_as_all_host_time(tmp_path):
    """torch.profiler's own chrome trace (CPU activity only: no GPU here): the scenario and step
    ranges are found by name and category; with no GPU activity the wall is all lead."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(tracelib.SCENARIO):
            for _ in range(3):
                with record_function(tracelib.STEP):
                    torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    s = tracelib.summarize(trace)
    assert s["gpu_events"] == 0 and s["wall_ms"] > 0
    assert s["lead_ms"] == s["wall_ms"] and s["kernel_ms"] == 0.0 and s["gaps"] == []
    assert tracelib.steps(trace)["count"] == 3


def test_gpu_trace_arguments():
    gt = _bench("gpu_trace")
    a = gt.parse_args(["--model", "/m"])
    assert a.fast_shares == [None, 0, 20] and a.modes == "stock,exact,fast"
    assert gt.parse_args(["--model", "/m", "--modes", "exact,exact_copy_first"]).modes == (
        "exact,exact_copy_first"
    )
    a = gt.parse_args(["--model", "/m", "--fast-shares", "router,30", "--lane-spin-us", "5000"])
    assert a.fast_shares == [None, 30] and a.lane_spin_us == [5000] and a.lane_pins is True
    assert gt.parse_args(["--model", "/m", "--no-lane-pins"]).lane_pins is False
    assert gt.parse_args(["--model", "/m"]).poller_cpus is None
    assert gt.parse_args(["--model", "/m", "--poller-cpus", "15,14"]).poller_cpus == [14, 15]
    for bad in ("--poller-cpus=", "--poller-cpus=x", "--poller-cpus=-1"):
        with pytest.raises(SystemExit):
            gt.parse_args(["--model", "/m", bad])
    for bad in ("--fast-shares=101", "--fast-shares=x", "--fast-shares=", "--modes=exact,nope"):
        with pytest.raises(SystemExit):
            gt.parse_args(["--model", "/m", bad])
    with pytest.raises(argparse.ArgumentTypeError):
        gt.share_list("-1")


def test_gpu_trace_ratios_and_prefill_breakdown_from_summaries():
    gt = _bench("gpu_trace")
    s = tracelib.summarize(hand_trace())
    stock = dict(s, wall_ms=0.5, lead_ms=0.05, tail_ms=0.05, copy_ms=0.0, overlap_ms=0.0,
                 idle_ms=0.0, named={})  # fmt: skip
    traced = dict(s, untraced_wall_ms=0.8, traced_vs_untraced=1.25)
    figures = {"stock": {"p512": stock}, "exact": {"p512": traced},
               "fast": {"decode_c1_share20": s}}  # fmt: skip
    out = gt.combine(figures)
    r = out["ratios"]
    assert r["gpu_busy_share"]["exact.p512"] == pytest.approx(0.6)
    assert r["copy_hidden_share"]["exact.p512"] == pytest.approx(0.6)
    assert "stock.p512" not in r["copy_hidden_share"]
    assert r["lane_wait_share"] == {"exact.p512": pytest.approx(0.2),
                                    "fast.decode_c1_share20": pytest.approx(0.2)}  # fmt: skip
    assert r["traced_vs_untraced"] == {"exact.p512": 1.25}
    assert out["prefill_exact_vs_stock"]["p512"]["wall_ms"] == pytest.approx(0.5)
    assert list(out["prefill_exact_vs_stock"]) == ["p512"]
    assert out["prefill_copy_first_vs_stock"] == {}  # no exact_copy_first row
    figures["exact_copy_first"] = {"p512": traced}
    first = gt.combine(figures)["prefill_copy_first_vs_stock"]
    assert first["p512"] == out["prefill_exact_vs_stock"]["p512"]


def test_the_fast_hooks_ranges_appear_in_a_trace_only_when_turned_on(tmp_path):
    """bench/gpu_trace.py turns on glm53.exl3.trace_fast_ranges for its fast scenarios: the
    hooks' host work then runs in named ranges (g53_fast_*) that the trace's host ranges show,
    which tracelib.host_at names as the innermost range; off (serving), no range is opened."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from glm53.exl3 import fast_hooks, trace_fast_ranges

    def record(on: bool) -> list[dict]:
        trace_fast_ranges(on)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with fast_hooks._traced("g53_fast_publish"):
                    torch.randn(32, 32) @ torch.randn(32, 32)
        finally:
            trace_fast_ranges(False)
        path = tmp_path / f"trace-{on}.json"
        prof.export_chrome_trace(str(path))
        return tracelib.events(json.loads(path.read_text()))

    evs = record(True)
    on = [e for e in evs if e.get("name") == "g53_fast_publish"]
    assert len(on) == 1 and on[0]["cat"] in tracelib.HOST_RANGE_CATS
    ranges = [e for e in evs if e.get("cat") in tracelib.HOST_RANGE_CATS]
    start = on[0]["ts"] + 1e-3  # inside the range, before the matmul's ops begin
    assert tracelib.host_at(ranges, start, limit=1) == ["g53_fast_publish"]
    assert not [e for e in record(False) if e.get("name") == "g53_fast_publish"]
    assert fast_hooks.TRACE_RANGES is False
