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
