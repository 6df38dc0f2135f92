"""Reference panels on the GPU: `glm53 reference make --engine stock-exllamav3` writes a panel
from stock exllamav3 1.6.5 (every weight in VRAM), and exact mode, served through the real API,
must score top-1 1.0000 and KL 0 against it (bench/score_ref_panel.py). The checkpoint comes
from GLM53_TEST_DEMO (tools/gpu-check.sh writes it with `glm53 synth`).

Exact mode's scoring needs prompt logprobs from the GPU engine (TokenEvent.prompt_logprobs,
filled by its Generator loop); until that loop lands the scoring test fails with the GPU step
path's error naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("exllamav3")

from serving_kit import Server  # noqa: E402

from glm53.reference import fingerprint, read_panel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEMO = os.environ.get("GLM53_TEST_DEMO")
pytestmark = pytest.mark.skipif(not DEMO, reason="GLM53_TEST_DEMO names no demo checkpoint")


@pytest.fixture(scope="module")
def stock_panel(tmp_path_factory):
    out = tmp_path_factory.mktemp("panel") / "stock.json"
    proc = subprocess.run(
        [sys.executable, "-m", "glm53", "reference", "make", "--model", DEMO,
         "--engine", "stock-exllamav3", "--out", str(out)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_stock_panel_names_its_checkpoint_and_versions(stock_panel):
    panel = read_panel(stock_panel)
    assert panel.engine == "stock-exllamav3"
    assert panel.checkpoint_fingerprint == fingerprint(DEMO)
    assert panel.versions["exllamav3"] == "1.6.5"
    assert all(len(p.positions) == len(p.token_ids) - 1 for p in panel.prompts)


def test_exact_mode_scores_top1_1_and_kl_0_against_stock(stock_panel, tmp_path):
    args = ["--engine", "gpu", "--mode", "exact", "--model", DEMO]
    server = Server(
        args, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}, log_path=tmp_path / "log"
    )
    server.wait_ready(timeout_s=600)
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "score_ref_panel.py"), "--json",
             "--url", server.url, "--panel", str(stock_panel)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:] + server.log()[-3000:]
        figures = json.loads(proc.stdout.strip().splitlines()[-1])["figures"]
        assert figures["top1_agreement"] == 1.0, figures["worst"]
        assert figures["kl_max"] == 0.0, figures["worst"]
    finally:
        assert server.stop() == 0, server.log()
