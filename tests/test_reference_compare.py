"""`glm53 reference compare A B`: two panels of one checkpoint, position by position (what showed
that two stock exllamav3 runs on the H200 disagree: bench/results/README.md)."""

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from glm53.reference import read_panel, write_panel

ROOT = Path(__file__).resolve().parents[1]
PANEL = ROOT / "reference" / "demo-panel.json"


def _compare(a, b):
    return subprocess.run(
        [sys.executable, "-m", "glm53", "reference", "compare", str(a), str(b)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_a_panel_against_its_own_copy_is_identical(tmp_path):
    copy = tmp_path / "copy.json"
    write_panel(read_panel(PANEL), copy)
    proc = _compare(PANEL, copy)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical"] is True
    assert (out["top1_agreement"], out["kl_max"], out["max_abs_logprob_diff_shared_ids"]) == (
        1.0,
        0.0,
        0.0,
    )


def test_one_changed_logprob_is_found(tmp_path):
    panel = read_panel(PANEL)
    pos = panel.prompts[0].positions[3]
    lps = list(pos.top_logprobs)
    lps[1] -= 0.25  # the second most likely token, 0.25 nats less likely
    panel.prompts[0].positions[3] = msgspec.structs.replace(pos, top_logprobs=lps)
    changed = tmp_path / "changed.json"
    write_panel(panel, changed)
    out = json.loads(_compare(PANEL, changed).stdout)
    assert out["identical"] is False
    assert abs(out["max_abs_logprob_diff_shared_ids"] - 0.25) < 1e-9
    assert out["kl_max"] > 0 and out["worst"][0]["position"] == 3
    assert out["top1_agreement"] == 1.0


def test_panels_of_other_checkpoints_are_refused(tmp_path):
    panel = read_panel(PANEL)
    other = tmp_path / "other.json"
    write_panel(msgspec.structs.replace(panel, checkpoint_fingerprint="0" * 64), other)
    proc = _compare(PANEL, other)
    assert proc.returncode != 0
    assert "another checkpoint" in proc.stderr
