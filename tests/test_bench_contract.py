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


def test_prefix_cache_contract(tmp_path):
    from glm53.models.synth import write_checkpoint
    from glm53.models.synth_layout import preset

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
