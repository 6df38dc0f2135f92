import argparse
import subprocess
import sys

import pytest

from glm53 import config
from glm53.config import ConfigurationError, Settings, parse_size, resolve


def parse(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_documented_ones():
    settings, sources = resolve({}, {})
    assert (settings.host, settings.port, settings.served_name) == (
        "127.0.0.1",
        30000,
        "glm-5.3-flash",
    )
    assert (settings.context, settings.max_batch, settings.mode, settings.ec_reserve_gb) == (
        131072,
        4,
        "auto",
        1.0,
    )
    assert (settings.model, settings.api_key, settings.reasoning_field) == (None, None, False)
    assert settings.ct_swz is False  # fast mode keeps no second (swizzled) copy of the experts
    assert set(sources.values()) == {"default"}


def test_flag_beats_environment_beats_default_and_each_source_is_recorded():
    env = {"GLM53_PORT": "8001", "GLM53_MAX_BATCH": "8", "GLM53_MODE": "nvme"}
    settings, sources = resolve(parse(["--port", "9000", "-cs", "4096"]), env)
    assert (settings.port, settings.max_batch, settings.context, settings.mode, settings.host) == (
        9000,
        8,
        4096,
        "nvme",
        "127.0.0.1",
    )
    assert (sources["port"], sources["max_batch"], sources["context"], sources["host"]) == (
        "flag",
        "env",
        "flag",
        "default",
    )


def test_seed_variable_names_are_kept():
    env = {
        "GLM53_CT_CPUS": "2-23",
        "GLM53_CT_THREADS": "22",
        "GLM53_EC_MAX_SLOTS": "1376",
        "GLM53_EC_RESERVE_GB": "1.5",
        "GLM53_EC_ELASTIC_GB": "8",
        "GLM53_EC_STAGE_GB": "2.6",
        "GLM53_CT_B": "0.2",
        "GLM53_CT_SWZ": "1",
        "GLM53_TRITON_PIN": "/x/pin.json",
        "GLM53_API_KEY": "k",
    }
    s, _ = resolve({}, env)
    assert (
        s.cpus,
        s.cpu_threads,
        s.ec_max_slots,
        s.ec_reserve_gb,
        s.ec_elastic_gb,
        s.ec_stage_gb,
    ) == (
        "2-23",
        22,
        1376,
        1.5,
        8.0,
        2.6,
    )
    assert (s.ct_b, s.ct_swz, s.triton_pin, s.api_key) == (0.2, True, "/x/pin.json", "k")


def test_aliases_and_boolean_flags():
    s, sources = resolve(
        parse(["--cpus", "0,2", "--cpu-threads", "2", "--demo", "--ct-swz", "--reasoning-field"]),
        {},
    )
    assert (s.cpus, s.cpu_threads, s.demo, s.ct_swz, s.reasoning_field) == (
        "0,2",
        2,
        True,
        True,
        True,
    )
    assert sources["ct_swz"] == "flag"


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"GLM53_PORT": "0"},
            "GLM53_PORT='0': Expected `int` >= 1 (--port / GLM53_PORT: TCP port.)",
        ),
        (
            {"GLM53_DEMO": "maybe"},
            "GLM53_DEMO='maybe': expected one of 1/0, true/false, yes/no, on/off",
        ),
        (
            {"GLM53_RAM_CAP": "lots"},
            "GLM53_RAM_CAP: 'lots' is not a size; write bytes or a number with K, M, G or T",
        ),
        ({"GLM53_MAX_BATCH": "four"}, "GLM53_MAX_BATCH='four': Expected `int`, got `str`"),
    ],
)
def test_bad_values_name_the_variable_and_the_fix(env, message):
    with pytest.raises(ConfigurationError) as info:
        resolve({}, env)
    assert str(info.value).startswith(message)


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigurationError, match=r"^--max-batch='0': Expected `int` >= 1"):
        resolve(parse(["--max-batch", "0"]), {})


def test_empty_variable_counts_as_unset():
    settings, sources = resolve({}, {"GLM53_MODEL": "", "GLM53_PORT": ""})
    assert (settings.model, settings.port, sources["port"]) == (None, 30000, "default")


@pytest.mark.parametrize(
    "text, size",
    [("123", 123), ("4K", 4096), ("64M", 64 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30)],
)
def test_sizes_accept_binary_suffixes(text, size):
    assert parse_size(text) == size


def test_effective_settings_hide_the_api_key_and_round_trip_through_json():
    settings, sources = resolve(parse(["--api-key", "secret"]), {"GLM53_PORT": "1234"})
    eff = config.effective(settings, sources)
    assert eff["api_key"] == {
        "value": "<set>",
        "source": "flag",
        "flag": "--api-key",
        "env": "GLM53_API_KEY",
    }
    assert eff["port"] == {"value": 1234, "source": "env", "flag": "--port", "env": "GLM53_PORT"}
    assert config.from_json(config.to_json(settings, sources)) == (settings, sources)


def test_reference_table_lists_every_setting():
    table = config.reference_markdown()
    for info in config.SETTINGS:
        assert f"`{info.flags[0]}`" in table and f"`{info.env}`" in table
    assert "| `--context`, `-cs` | `GLM53_CONTEXT` | `131072` |" in table
    assert len(config.SETTINGS) == len(Settings.__struct_fields__)


def test_serve_help_lists_the_settings():
    out = subprocess.run(
        [sys.executable, "-m", "glm53", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in (
        "--model",
        "--demo",
        "--mode",
        "--served-name",
        "-cs",
        "--max-batch",
        "--api-key",
        "--ec-reserve-gb",
    ):
        assert flag in out.stdout


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--ct-swz"], "--ct-swz"),
        (["--triton-pin", "/x/pin.json"], "--triton-pin"),
        (["--ec-elastic-gb", "4"], "--ec-elastic-gb"),
    ],
)
def test_settings_of_parts_not_built_are_refused_at_start(argv, flag):
    from glm53.engine import create_engine

    s, _ = resolve(parse(["--engine", "scripted", *argv]), {})
    with pytest.raises(ConfigurationError, match=f"{flag} .*not in this build"):
        create_engine(s)


def test_defaults_of_parts_not_built_pass_the_refusal():
    from glm53.engine import refuse_unbuilt

    s, _ = resolve(parse(["--engine", "scripted"]), {})
    refuse_unbuilt(s)


def test_the_swizzled_copy_is_refused_from_the_environment_too():
    from glm53.engine import refuse_unbuilt

    s, sources = resolve(parse(["--engine", "scripted"]), {"GLM53_CT_SWZ": "1"})
    assert s.ct_swz is True and sources["ct_swz"] == "env"
    with pytest.raises(ConfigurationError, match=r"--ct-swz \(.*doubles their RAM"):
        refuse_unbuilt(s)
