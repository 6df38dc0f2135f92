"""`glm53 doctor` end to end: the live host (this machine), capture and replay, probes that
hang, and the micro-measurements."""

import json
import mmap
import os
import sys
import time
import types
from pathlib import Path

import pytest

from glm53.cli import main
from glm53.doctor import measure
from glm53.doctor.probes import probe_host
from glm53.doctor.source import FixtureSource, LiveSource, Unavailable, bounded

REF = Path(__file__).parent / "fixtures" / "doctor" / "reference-3090-epyc-raid0"


NOGPU = REF.parent / "nogpu-i5-16g-container"
DESKTOP = REF.parent / "desktop-4090-gen4-64g"


def run_json(capsys, *args) -> dict:
    """The report of `glm53 doctor --json ARGS`, checked against its exit status: 1 when a check
    failed, else 0."""
    status = main(["doctor", "--json", *args])
    doc = json.loads(capsys.readouterr().out)
    assert status == (1 if any(c["verdict"] == "fail" for c in doc["checks"]) else 0)
    return doc


def test_live_doctor_gives_a_report_and_plan(capsys):
    doc = run_json(capsys, "--no-measure")
    host, plan = doc["host"], doc["plan"]
    assert host["cpu"]["logical_cpus"] >= 1 and host["memory"]["total_bytes"] > 0
    assert host["versions"]["python"].count(".") == 2
    if host["gpus"] == []:  # this project's CI machine
        assert plan["headline"] == "no GPU: demo only"
        assert plan["steps"] == ["glm53 serve --demo"]
        assert next(c for c in doc["checks"] if c["name"] == "gpu")["verdict"] == "fail"
    else:
        assert plan["headline"]
    assert host["measured"]["notes"] == {"all": "not measured (--no-measure)"}


def test_live_report_ends_with_the_command_to_run(capsys):
    assert main(["doctor", "--no-measure"]) in (0, 1)
    lines = capsys.readouterr().out.rstrip().splitlines()
    run_at = max(i for i, line in enumerate(lines) if line.startswith("Run:"))
    assert lines[run_at + 1].startswith("  glm53 ") and lines[-1].startswith("  glm53 ")


def test_capture_then_replay_plans_the_same(capsys, tmp_path):
    live = run_json(capsys, "--no-measure", "--capture", str(tmp_path))
    assert (tmp_path / "root/proc/meminfo").is_file()
    assert (tmp_path / "cmd/measured.txt").is_file() is False  # --no-measure: nothing measured
    replay = run_json(capsys, "--replay", str(tmp_path))
    assert replay["plan"]["headline"] == live["plan"]["headline"]
    assert replay["host"]["cpu"] == live["host"]["cpu"]
    assert replay["host"]["memory"] == live["host"]["memory"]


def test_replay_with_compare_sets_measurement_beside_prediction(capsys, tmp_path):
    result = tmp_path / "sweep.json"
    result.write_text(
        json.dumps(
            {
                "bench": "sweep",
                "figures": {"decode_c1_tok_s": 28.15, "prefill_8192_tok_s": 709.7},
                "ratios": {},
                "config": {"mode": "fast"},
            }
        )
    )
    doc = run_json(capsys, "--replay", str(REF), "--compare", str(result))
    comparison = doc["plan"]["comparison"]
    assert comparison["mode"] == "fast"
    assert (comparison["decode_measured_tok_s"], comparison["prefill_measured_tok_s"]) == (
        28.15,
        709.7,
    )
    assert abs(comparison["decode_predicted_tok_s"] / 28.15 - 1) <= 0.25


def test_warnings_alone_exit_0(capsys):
    assert main(["doctor", "--replay", str(REF)]) == 0
    out, err = capsys.readouterr()
    assert "│ warn │ memlock" in out and "│ fail │" not in out and "failed" not in err


@pytest.mark.parametrize(
    "fixture, failed, last",
    [
        (NOGPU, "gpu", "glm53 serve --demo"),
        # exact and fast do not fit its 64 GB; nvme (the fastest store mode) does, once
        # exllamav3 is installed
        (DESKTOP, "exllamav3, ram-exact, ram-fast", "glm53 serve --model "
         "/var/lib/glm53/GLM-5.3-Flash-exl3-3.05bpw --mode nvme --store "
         "/var/lib/glm53/glm53-store --ram-cap 33.5G --cpus 2-15 --ct-b 0.259 "
         "--ec-max-slots 1376"),
    ],
)  # fmt: skip
def test_a_failed_check_exits_1_naming_it_beside_the_plan(capsys, fixture, failed, last):
    assert main(["doctor", "--replay", str(fixture)]) == 1
    out, err = capsys.readouterr()
    assert (
        err.splitlines()[-1] == f"glm53 doctor: {len(failed.split(', '))} check(s) failed: {failed}"
    )
    assert out.rstrip().splitlines()[-1] == f"  {last}"


def test_bad_arguments_exit_2_with_the_reason(capsys):
    assert main(["doctor", "--replay", str(REF), "--cpus", "2-x"]) == 2
    assert "bad CPU list '2-x'" in capsys.readouterr().err
    assert main(["doctor", "--replay", str(REF), "--ram-cap", "lots"]) == 2
    assert "--ram-cap 'lots' is not a size" in capsys.readouterr().err
    assert main(["doctor", "--replay", str(REF), "--gpu", "3"]) == 2
    assert "--gpu 3: no such GPU; found [0]" in capsys.readouterr().err


def test_a_probe_that_hangs_is_reported_unavailable():
    with pytest.raises(Unavailable, match="slow timed out after 0.2 s"):
        bounded(lambda: time.sleep(3), 0.2, "slow")

    class HangingMeminfo(FixtureSource):
        def read(self, path):
            if path == "/proc/meminfo":
                time.sleep(8)
            return super().read(path)

    host = probe_host(HangingMeminfo(REF), timeout_s=2.0)
    assert host.memory is None and host.unavailable == {"memory": "memory timed out after 2 s"}
    assert host.cpu is not None and host.gpus


def test_live_commands_are_bounded_and_their_failures_recorded():
    source = LiveSource(timeout_s=0.3)
    with pytest.raises(Unavailable, match="sleeper timed out after 0.3 s"):
        source.run("sleeper", ["sleep", "5"])
    with pytest.raises(Unavailable, match="no-such-tool-x1 not found"):
        source.run("x1", ["no-such-tool-x1"])
    assert source.recorded["cmd/sleeper.error"] == "sleeper timed out after 0.3 s\n"
    with pytest.raises(Unavailable, match="x1: not captured"):
        FixtureSource(REF).run("x1", ["x1"])


def test_dram_probe_measures_something():
    assert measure.dram_gbps(threads=1, total_bytes=8 << 20, repeats=1) > 0


def _odirect_works(folder: Path) -> bool:
    try:
        fd = os.open(folder / "t", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        os.pwritev(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(folder / "t")


def test_store_read_probe_on_a_directory_and_on_a_file(tmp_path):
    if not _odirect_works(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    got = measure.store_read(str(tmp_path), nbytes=4 * measure.RECORD_BYTES, readers=2)
    assert got.bytes_read == 4 * measure.RECORD_BYTES and got.read_gbps > 0
    assert os.listdir(tmp_path) == []  # the probe file is gone
    small = tmp_path / "store.bin"
    small.write_bytes(b"\1" * measure.RECORD_BYTES)
    with pytest.raises(Unavailable, match="too small to measure"):
        measure.store_read(str(small), readers=2)
    assert small.read_bytes() == b"\1" * measure.RECORD_BYTES  # never written


def test_odirect_probe_reports_an_unbuilt_module(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "glm53._odirect", None)
    with pytest.raises(Unavailable, match="glm53._odirect not built"):
        measure.odirect_probe(str(tmp_path))


def test_odirect_probe_refuses_tmpfs_when_built(tmp_path):
    pytest.importorskip("glm53._odirect", reason="native modules not built")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    with pytest.raises(OSError, match="tmpfs"):
        measure.odirect_probe("/dev/shm")


def test_lane_calibration_uses_the_cpu_lane_or_says_why_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "glm53.tiers.cpu_lane", None)
    with pytest.raises(
        Unavailable, match=r"^not calibrated: glm53.tiers.cpu_lane is not importable"
    ):
        measure.lane_calibration([2, 3])
    fake = types.ModuleType("glm53.tiers.cpu_lane")
    monkeypatch.setitem(sys.modules, "glm53.tiers.cpu_lane", fake)
    with pytest.raises(
        Unavailable, match=r"^not calibrated: glm53.tiers.cpu_lane has no calibrate"
    ):
        measure.lane_calibration([2, 3])
    seen = {}

    def calibrate(thread_counts, rows, layout):
        seen.update(threads=thread_counts, rows=rows, cpus=layout)
        return types.SimpleNamespace(variant="avx2", fits={(2, 1): (0.12, 0.9)})

    fake.calibrate, fake.LaneLayout = calibrate, lambda cpus: cpus
    got = measure.lane_calibration([2, 3])
    assert (got.threads, got.a_ms, got.b_ms, got.variant) == (2, 0.12, 0.9, "avx2")
    assert seen == {"threads": [2], "rows": (1,), "cpus": (2, 3)}
