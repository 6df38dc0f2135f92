"""`glm53 doctor --per-gpu` on the captured hosts (tests/fixtures/doctor/), given more GPUs of
the kind they have: one plan per GPU with its own share of the lane CPUs, and a warning exactly
when the instances' pinned RAM does not fit the host's memory budget together."""

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from glm53.doctor.fleet import plan_per_gpu
from glm53.doctor.plan import PlanRequest, make_plan
from glm53.doctor.probes import probe_host
from glm53.doctor.source import FixtureSource
from glm53.units import GIB

FIX = Path(__file__).parent / "fixtures" / "doctor"


def host_with_gpus(host_dir: str, count: int):
    """The captured host with its one GPU repeated `count` times (indices 0..count-1)."""
    host = probe_host(FixtureSource(FIX / host_dir))
    (gpu,) = host.gpus
    gpus = [msgspec.structs.replace(gpu, index=i, uuid=f"{gpu.uuid}-{i}") for i in range(count)]
    return msgspec.structs.replace(host, gpus=gpus)


def test_two_3090s_on_the_reference_host_split_the_lane_and_fit():
    host = host_with_gpus("reference-3090-epyc-raid0", 2)
    fleet = plan_per_gpu(host, PlanRequest())
    assert [(p.gpu_index, p.unit, p.port) for p in fleet.plans] == [
        (0, "glm53@0", 31000),
        (1, "glm53@1", 31001),
    ]
    assert [p.plan.lane_cpus for p in fleet.plans] == [list(range(2, 13)), list(range(13, 24))]
    for p in fleet.plans:
        assert p.plan.gpu_index == p.gpu_index
        assert p.plan.steps[-1].startswith(
            f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={p.gpu_index} glm53 serve"
        )
        chosen = next(o for o in p.plan.options if o.mode == p.plan.mode)
        assert p.pinned_bytes == chosen.host_ram_bytes > 0
    assert fleet.pinned_bytes == sum(p.pinned_bytes for p in fleet.plans)
    assert fleet.budget_bytes == make_plan(host, PlanRequest()).budget_bytes
    assert fleet.pinned_bytes <= fleet.budget_bytes and fleet.warning is None


@pytest.mark.parametrize(
    ("host_dir", "count"),
    [("reference-3090-epyc-raid0", 5), ("blackwell-5090-192g-idle-nvme", 2)],
)
def test_instances_whose_pinned_ram_does_not_fit_draw_a_warning(host_dir, count):
    fleet = plan_per_gpu(host_with_gpus(host_dir, count), PlanRequest())
    assert len(fleet.plans) == count
    assert fleet.pinned_bytes > fleet.budget_bytes
    assert fleet.warning.startswith(f"the {count} instances (GPU 0 ")
    assert (
        f"pin {fleet.pinned_bytes / GIB:.1f} GiB of RAM together, but this host has "
        f"{fleet.budget_bytes / GIB:.1f} GiB for them" in fleet.warning
    )


def test_a_host_without_a_gpu_is_refused():
    host = probe_host(FixtureSource(FIX / "nogpu-i5-16g-container"))
    with pytest.raises(ValueError, match="--per-gpu: this host has no NVIDIA GPU"):
        plan_per_gpu(host, PlanRequest())


def test_cli_per_gpu_prints_each_plan_as_json():
    done = subprocess.run(
        [sys.executable, "-m", "glm53", "doctor", "--replay",
         str(FIX / "reference-3090-epyc-raid0"), "--per-gpu", "--no-measure", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    fleet = json.loads(done.stdout)["per_gpu"]
    assert [p["unit"] for p in fleet["plans"]] == ["glm53@0"]
    assert fleet["warning"] is None
