"""The tier modes are defined once (glm53.modes.Mode) and checked against one table
(glm53.modes.RULES): config parses --mode into it, the GPU engine, the CPU engine, --ct-b and
the doctor all read the table."""

import argparse

import pytest

from glm53 import modes
from glm53.config import ConfigurationError, add_arguments, describe, resolve
from glm53.modes import Mode


def settings(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ={})


def test_config_parses_mode_once_into_the_enum_and_offers_exactly_its_values():
    s, sources = settings("--mode", "nvme-exact")
    assert s.mode is Mode.NVME_EXACT
    s, _ = resolve({}, environ={"GLM53_MODE": "fast"})
    assert s.mode is Mode.FAST
    parser = argparse.ArgumentParser()
    add_arguments(parser, ["mode"])
    (action,) = [a for a in parser._actions if a.dest == "mode"]
    assert tuple(action.choices) == tuple(m.value for m in Mode)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "turbo"])
    # the start-up log shows the value, not the enum's repr
    assert describe(*settings("--mode", "fast")) == ["mode='fast' (from flag --mode)"]


def test_the_table_names_a_rule_for_every_engine_and_mode():
    for engine in ("cpu", "gpu", "scripted"):
        for mode in Mode:
            assert isinstance(modes.rule(engine, mode), modes.ModeRule)
    assert modes.served("gpu") == (Mode.EXACT, Mode.FAST, Mode.NVME_EXACT, Mode.NVME)
    assert set(modes.served("cpu")) == set(modes.TierMode)  # one path for every mode
    from glm53.doctor.plan import SERVED_MODES

    # the doctor recommends what the GPU engine serves without --allow-unrun-modes
    want = (Mode.EXACT, Mode.FAST, Mode.NVME_EXACT, Mode.NVME)
    assert SERVED_MODES == modes.recommended("gpu") == want
    gpu = {m: modes.rule("gpu", m) for m in modes.TierMode}
    assert modes.rule("gpu", Mode.AUTO) == gpu[Mode.EXACT]  # auto is exact on the GPU engine
    assert [m for m, r in gpu.items() if r.store == "needs"] == [Mode.NVME, Mode.NVME_EXACT]
    assert [m for m, r in gpu.items() if r.lane] == [Mode.FAST, Mode.NVME]
    # nvme is served without --allow-unrun-modes (its GPU tests passed, H200, 2026-12-05)
    assert gpu[Mode.NVME].served and gpu[Mode.NVME].load == "nvme-exact"


def test_the_doctors_modes_are_the_same_values_without_auto():
    from glm53.doctor.costmodel import Mode as DoctorMode

    assert [m.value for m in DoctorMode] == [m.value for m in Mode if m is not Mode.AUTO]
    assert DoctorMode.FAST == Mode.FAST and DoctorMode.NVME_EXACT in {Mode.NVME_EXACT}


def test_the_lane_runs_beside_the_gpu_only_in_the_gpu_engines_lane_modes():
    assert modes.lane_runs_beside_gpu("gpu", "fast") and modes.lane_runs_beside_gpu("gpu", "nvme")
    assert not modes.lane_runs_beside_gpu("gpu", "exact")
    assert not modes.lane_runs_beside_gpu("gpu", "auto")
    assert not modes.lane_runs_beside_gpu("cpu", "fast")


def test_the_unrun_flag_gates_only_what_has_not_passed_on_a_gpu(tmp_path):
    """fast and nvme-exact passed on the H200 (2026-12-02), nvme mode, the staging loan in
    exact mode and layer-major prefill (6 of 6, H200, 2026-12-05); in the whole GPU suite on an
    H100 (2026-12-05) staging from the store, decode prefetch, layer-major in the store modes
    and the split with both halves on one GPU (0,0) passed, so they are served without
    --allow-unrun-modes. The split over two or more distinct GPUs (run only as 0,0) and the
    loan beside fast mode's lane (never run) have not, so only they still need the flag, each
    refusal saying where it stands; the flag also turns on the store modes' layer-major pass
    staging (never run), whose absence refuses nothing."""
    from glm53.engine.gpu_create import create

    assert set(modes.UNRUN) == {"split", "stage-loan", "store-pass-staging"}
    assert set(modes.UNRUN_STATUS) == set(modes.UNRUN)
    create(settings("--mode", "fast")[0], tmp_path)
    create(settings("--mode", "nvme-exact", "--store", str(tmp_path))[0], tmp_path)
    create(settings("--mode", "nvme", "--store", str(tmp_path))[0], tmp_path)
    create(settings("--mode", "exact", "--ec-stage-loan")[0], tmp_path)
    lm = create(settings("--mode", "exact", "--prefill", "layer-major")[0], tmp_path)
    assert lm.prefill == "layer-major"  # no flag: its GPU tests passed
    store = ["--store", str(tmp_path)]
    for mode in ("nvme-exact", "nvme"):  # no flag: their GPU tests passed (H100, 2026-12-05)
        e = create(settings("--mode", mode, *store, "--prefill", "layer-major")[0], tmp_path)
        assert e.prefill == "layer-major" and e.options.load.mode == "nvme-exact"
        # its pass stages each layer once only with the flag (UNRUN["store-pass-staging"]: not
        # yet run on a GPU); without it the pass reads each chunk's picks zero-copy, as tested
        assert e.options.store_pass_staging is False
        assert modes.UNRUN_STATUS["store-pass-staging"] in e.description
        assert "--allow-unrun-modes turns it on" in e.description
        argv = ("--mode", mode, *store, "--prefill", "layer-major", "--allow-unrun-modes")
        e = create(settings(*argv)[0], tmp_path)
        assert e.options.store_pass_staging is True
        assert "each layer staged once per pass" in e.description
        e = create(settings("--mode", mode, *store, "--nvme-prefetch", "next-layer")[0], tmp_path)
        assert e.options.load.nvme_prefetch == "next-layer"
        e = create(settings("--mode", mode, *store, "--ec-stage-gb", "2")[0], tmp_path)
        assert e.options.load.ec_stage_gb == 2.0
    assert create(settings("--gpus", "0,0")[0], tmp_path).gpus == (0, 0)
    for key, argv in (
        ("split", ["--gpus", "0,1"]), ("split", ["--gpus", "0,0,1"]),
        ("stage-loan", ["--mode", "fast", "--ec-stage-loan"]),
    ):  # fmt: skip
        with pytest.raises(ConfigurationError, match="--allow-unrun-modes runs it anyway") as info:
            create(settings(*argv)[0], tmp_path)
        assert modes.UNRUN_STATUS[key] in str(info.value)
        create(settings(*argv, "--allow-unrun-modes")[0], tmp_path)


def test_the_unrun_flags_help_says_what_it_gates():
    from glm53.config import setting_info

    text = setting_info("allow_unrun_modes").description
    assert "three paths" in text and "each layer once per pass in the store modes" in text
    assert "split over two or more distinct GPUs" in text and "--ec-stage-loan" in text
    # what it no longer gates, named as running without it
    assert "Every other mode and path runs without it (prefill staging from the store" in text
    assert "--nvme-prefetch next-layer" in text
    assert "--prefill layer-major in the store modes" in text
    assert "test_layer_major_gpu" not in text
    assert "--mode fast" not in text and "nvme-exact" not in text and "--mode nvme" not in text
