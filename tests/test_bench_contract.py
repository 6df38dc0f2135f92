"""The benchmarks' JSON contract (bench/README or the native-core issue): one JSON object as the
last line, with "bench", "figures", "ratios" and "config". Run at the smallest sizes; nothing here
is timed or compared against a speed."""

import json
import subprocess
import sys
from pathlib import Path

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


def test_micro_gemv_contract():
    pytest.importorskip("glm53._gemv")
    r = run_bench(
        "micro_gemv", "--threads", "1", "--jobs", "1", "--pool-mb", "64", "--no-calibrate",
        "--no-exllamav3",
    )  # fmt: skip
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    assert f["max_rel_err"] <= 1e-5
    for key in ("trellis_gbps_per_thread", "ms_per_expert", "dram_gbps",
                "independent_gbps_per_thread"):  # fmt: skip
        assert f[key] > 0, key
    assert {row["variant"] for row in f["table"]} == set(cfg["variants"])
    assert ratios["vs_exllamav3"] is None and "skipped" in cfg["exllamav3"]
    assert 0 < ratios["dram_share"] and 0 < ratios["pool_vs_independent"]
    assert f["cost_model"] is None


def test_ram_cap_contract():
    r = run_bench("ram_cap", "--shares", "1", "--prompt", "8", "--tokens", "2")
    f, ratios, cfg = r["figures"], r["ratios"], r["config"]
    (run,) = f["runs"]
    assert (run["share"], run["slots"], cfg["num_records"]) == (1.0, 192, 192)
    assert run["cap_bytes"] == 192 * cfg["record_bytes"]
    assert run["peak_rss_bytes"] == run["cap_bytes"] + run["overhead_bytes"]
    assert f["overhead_max_bytes"] == run["overhead_bytes"] > 0
    assert ratios["overhead_max_vs_all_experts"] == 1.0
