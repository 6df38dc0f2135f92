"""Where `glm53 doctor` puts the CPU lane: one thread per physical core of the GPU's NUMA node
(from sysfs /sys/bus/pci/devices/<address>/numa_node, else node 0), the node's first two cores
left to the OS, the event loop and the engine thread, and what else it leaves out and why, in
the text report and the JSON. The hosts are captured ones (tests/fixtures/doctor/) with a fake
two-socket topology and sysfs written over them."""

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from glm53.cli import main
from glm53.doctor.checks import Verdict, run_checks
from glm53.doctor.fleet import plan_per_gpu
from glm53.doctor.gpu import parse_smi_bus_ids, sysfs_pci_address
from glm53.doctor.plan import PlanRequest, make_plan
from glm53.doctor.probes import probe_host
from glm53.doctor.source import FixtureSource

FIX = Path(__file__).parent / "fixtures" / "doctor"
GPU_ADDRESS = "0000:c1:00.0"


def two_socket_host(tmp_path: Path, gpu_node: str | None, allowed: str = "0-31") -> Path:
    """The Blackwell capture (NVML, 32 CPUs) as two sockets of 8 cores with SMT: cores 0-7 on
    node 0 (CPUs 0-7, siblings 16-23), cores 8-15 on node 1 (CPUs 8-15, siblings 24-31); its
    GPU at GPU_ADDRESS, whose sysfs numa_node reads `gpu_node` (no file for None)."""
    host = tmp_path / "host"
    shutil.copytree(FIX / "blackwell-5090-192g-idle-nvme", host)
    rows = ["# CPU,Core,Socket,Node"]
    for cpu in range(32):
        core = cpu % 16
        rows.append(f"{cpu},{core},{core // 8},{core // 8}")
    (host / "cmd" / "lscpu-p.txt").write_text("\n".join(rows) + "\n")
    nvml = host / "cmd" / "nvml.txt"
    (gpu,) = json.loads(nvml.read_text())
    nvml.write_text(json.dumps([{**gpu, "pci_bus_id": "00000000:C1:00.0"}]))
    status = host / "root" / "proc" / "self" / "status"
    status.write_text(
        status.read_text().replace("Cpus_allowed_list:\t0-31", f"Cpus_allowed_list:\t{allowed}")
    )
    if gpu_node is not None:
        node_file = host / "root" / "sys" / "bus" / "pci" / "devices" / GPU_ADDRESS / "numa_node"
        node_file.parent.mkdir(parents=True)
        node_file.write_text(gpu_node + "\n")
    return host


def plan_of(host_dir: Path, req: PlanRequest | None = None):
    host = probe_host(FixtureSource(host_dir))
    plan = make_plan(host, req or PlanRequest())
    return host, plan, {c.name: c for c in run_checks(host, plan, req or PlanRequest())}


def test_lane_goes_to_the_gpus_numa_node_one_thread_per_physical_core(tmp_path):
    host, plan, checks = plan_of(two_socket_host(tmp_path, "1"))
    (gpu,) = host.gpus
    assert (gpu.pci_bus_id, gpu.numa_node) == (GPU_ADDRESS, 1)
    layout = plan.lane_layout
    assert plan.lane_cpus == layout.cpus == list(range(10, 16))
    assert layout.node == 1 and GPU_ADDRESS in layout.node_why
    assert [(r.cpu, r.kept_for) for r in layout.reserved] == [
        (8, "the OS and the server's event loop"),
        (9, "the engine thread (drives the GPU)"),
    ]
    assert [(o.cpus, o.why) for o in layout.left_out] == [
        (list(range(24, 32)), "SMT siblings (one lane thread per physical core)"),
        (
            [*range(0, 8), *range(16, 24)],
            "on other NUMA nodes than 1 (far from the GPU and the experts it pins)",
        ),
    ]
    fast = next(o for o in plan.options if o.mode == "fast")
    assert fast.flags["--cpus"] == "10-15"
    assert checks["numa"].verdict == Verdict.OK and "node 1" in checks["numa"].detail


def test_unknown_gpu_node_falls_back_to_node_0_and_says_why(tmp_path):
    _, plan, checks = plan_of(two_socket_host(tmp_path, "-1"))  # a host without NUMA info
    layout = plan.lane_layout
    assert layout.cpus == list(range(2, 8)) and layout.node == 0
    assert layout.node_why == (
        f"GPU 0's node unknown: no numa_node in sysfs for PCI device {GPU_ADDRESS}"
    )
    assert checks["numa"].verdict == Verdict.WARN


def test_gpu_node_outside_the_cpuset_uses_every_allowed_core(tmp_path):
    _, plan, _ = plan_of(two_socket_host(tmp_path, "1", allowed="0-7"))
    layout = plan.lane_layout
    assert layout.node is None and "node 1 has no CPU this process may run on" in layout.node_why
    assert layout.cpus == list(range(2, 8)) and [r.cpu for r in layout.reserved] == [0, 1]
    assert layout.left_out[-1].cpus == list(range(8, 32))
    assert layout.left_out[-1].why.startswith("outside this process's allowed CPUs")


def test_cpus_given_are_kept_and_their_far_node_is_warned_about(tmp_path):
    _, plan, checks = plan_of(two_socket_host(tmp_path, "1"), PlanRequest(cpus=[2, 3, 4]))
    layout = plan.lane_layout
    assert (layout.cpus, layout.node, layout.node_why) == ([2, 3, 4], 0, "from --cpus")
    assert layout.reserved == [] and layout.left_out == []
    assert checks["numa"].verdict == Verdict.WARN and "node 1" in checks["numa"].fix


def test_report_text_and_json_explain_the_layout(tmp_path, capsys):
    host_dir = two_socket_host(tmp_path, "1")
    assert main(["doctor", "--replay", str(host_dir)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps long cells
    assert (
        f"CPU lane layout: NUMA node 1 (GPU 0's, from sysfs numa_node of PCI device {GPU_ADDRESS})"
        in text
    )
    assert "10-15 │ the lane: 6 threads, one pinned to each, one per physical core" in text
    assert "8 │ left out for the OS and the server's event loop" in text
    assert "9 │ left out for the engine thread (drives the GPU)" in text
    assert "24-31 │ left out: SMT siblings (one lane thread per physical core)" in text
    assert main(["doctor", "--json", "--replay", str(host_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["host"]["gpus"][0]["numa_node"] == 1
    lane = doc["plan"]["lane_layout"]
    assert lane["cpus"] == list(range(10, 16)) and lane["node"] == 1
    assert [r["cpu"] for r in lane["reserved"]] == [8, 9]


def test_per_gpu_plans_keep_each_instance_on_its_gpus_node(tmp_path):
    host = probe_host(FixtureSource(two_socket_host(tmp_path, "1")))
    (gpu,) = host.gpus
    near = msgspec.structs.replace(gpu, index=0, numa_node=0)
    far = msgspec.structs.replace(gpu, index=1, uuid=f"{gpu.uuid}-1", numa_node=1)
    fleet = plan_per_gpu(msgspec.structs.replace(host, gpus=[near, far]), PlanRequest())
    assert [p.plan.lane_cpus for p in fleet.plans] == [list(range(2, 8)), list(range(10, 16))]
    assert [p.plan.lane_layout.node for p in fleet.plans] == [0, 1]


def test_nvidia_smi_bus_ids_map_to_sysfs_addresses(tmp_path):
    assert sysfs_pci_address("00000000:C1:00.0") == GPU_ADDRESS
    assert sysfs_pci_address("0001:02:03.4") == "0001:02:03.4"
    assert sysfs_pci_address("N/A") is None
    text = "0, 00000000:01:00.0\n1, 00000000:C1:00.0\n2, [N/A]\n"
    assert parse_smi_bus_ids(text) == {0: "0000:01:00.0", 1: GPU_ADDRESS}
    host = tmp_path / "ref"
    shutil.copytree(FIX / "reference-3090-epyc-raid0", host)
    (host / "cmd" / "nvidia-smi-pci.txt").write_text("0, 00000000:01:00.0\n")
    node_file = host / "root" / "sys" / "bus" / "pci" / "devices" / "0000:01:00.0" / "numa_node"
    node_file.parent.mkdir(parents=True)
    node_file.write_text("0\n")
    (gpu,) = probe_host(FixtureSource(host)).gpus
    assert (gpu.source, gpu.pci_bus_id, gpu.numa_node) == ("nvidia-smi", "0000:01:00.0", 0)


@pytest.mark.parametrize("host_dir", ["reference-3090-epyc-raid0", "desktop-4090-gen4-64g"])
def test_captured_one_node_hosts_keep_their_lane_cpus(host_dir):
    _, plan, _ = plan_of(FIX / host_dir)
    cores = {"reference-3090-epyc-raid0": 24, "desktop-4090-gen4-64g": 16}[host_dir]
    assert plan.lane_cpus == list(range(2, cores)) and plan.lane_layout.node == 0
    assert "GPU probe gave no PCI address" in plan.lane_layout.node_why
