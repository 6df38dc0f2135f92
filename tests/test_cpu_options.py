"""The CPU engine's settings, checked once when its CpuEngineOptions are built
(glm53.engine.cpu_options): from glm53's Settings through create_engine, and directly. Creating
an engine loads nothing, so a bad value is refused before the model loads."""

import argparse
import dataclasses
import os

import pytest

from glm53.config import ConfigurationError, add_arguments, resolve
from glm53.engine import create_engine
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import KDA_CHUNK, CpuEngineOptions, engine_options
from glm53.tiers.heat import heat_path


def settings(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(list(argv)), environ={})[0]


def test_create_engine_maps_every_setting(tmp_path):
    cache = _checkpoint(tmp_path) / "cache"
    e = create_engine(
        settings("--engine", "cpu", "--model", str(tmp_path), "--context", "4096",
                 "--max-batch", "3", "--ram-cap", "8M", "--store", "/x", "--read-timeout", "5",
                 "--cpus", "0", "--cpu-threads", "1", "--ct-precision", "fast",
                 "--cache-dir", str(cache)),
    )  # fmt: skip
    assert isinstance(e, CpuEngine) and e.model is None  # nothing loaded
    o = e.options
    assert (o.context, o.max_batch, o.ram_cap, o.store, o.read_timeout_s) == (
        4096, 3, 8 << 20, "/x", 5.0,
    )  # fmt: skip
    assert (o.cpus, o.cpu_threads, o.lane_precision, o.lane.cpus) == ("0", 1, "fast", (0,))
    assert (o.torch_threads, o.kda_chunk) == (None, KDA_CHUNK)
    assert o.heat_file == e.heat_file == heat_path(str(tmp_path), "ram", "/x", cache)
    assert (e.num_slots, e.context_length) == (3, 4096)


@pytest.mark.parametrize("mode", ["auto", "exact", "fast", "nvme", "nvme-exact"])
def test_auto_precision_is_exact_on_the_cpu_engine_in_every_mode(tmp_path, mode):
    o = engine_options(settings("--engine", "cpu", "--mode", mode), _checkpoint(tmp_path))
    assert o.lane_precision == "exact"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--cpus", "100000"], "^--cpus 100000: CPUs \\[100000\\] are outside this process's"),
        (["--cpus", "2-x"], "^--cpus '2-x': '2-x' is not a CPU number or range like 2-23"),
        (["--cpus", "0", "--cpu-threads", "2"], "^--cpu-threads 2 exceeds the 1 CPUs of --cpus 0"),
    ],
)
def test_a_bad_lane_setting_is_refused_before_anything_loads(tmp_path, argv, match):
    with pytest.raises(ConfigurationError, match=match):
        create_engine(settings("--engine", "cpu", "--model", str(_checkpoint(tmp_path)), *argv))


def test_the_options_refuse_values_no_setting_can_give():
    with pytest.raises(ConfigurationError, match="^lane precision 'fp8' is not one of exact, fast"):
        CpuEngineOptions(lane_precision="fp8")
    with pytest.raises(ConfigurationError, match="^--cpu-threads 0: the lane needs at least 1"):
        CpuEngineOptions(cpu_threads=0)


def test_the_options_are_frozen_and_replace_checks_them_again():
    first = min(os.sched_getaffinity(0))
    o = CpuEngineOptions(cpus=str(first))
    assert o.lane.cpus == (first,) and o.lane.note == "from --cpus"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_batch = 8
    assert dataclasses.replace(o, max_batch=8).lane == o.lane
    with pytest.raises(ConfigurationError, match="^--cpu-threads 2 exceeds the 1 CPUs"):
        dataclasses.replace(o, cpu_threads=2)


def _checkpoint(tmp_path):
    """A checkpoint directory as --model takes it: nothing loads, so only config.json is read
    (the heat list's name hashes it)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path
