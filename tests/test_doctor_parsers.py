"""The doctor's parsers on real-format outputs (tests/fixtures/doctor) and small inline cases."""

from pathlib import Path

import pytest

from glm53.doctor.cpu import format_cpu_list, parse_cpu_list, parse_lscpu_parsable
from glm53.doctor.gpu import parse_smi_header, parse_smi_processes, parse_smi_query
from glm53.doctor.memory import parse_memlock
from glm53.doctor.storage import parse_lsblk, parse_mdstat, parse_mounts
from glm53.doctor.sweep import parse_sweep
from glm53.plan.host_memory import parse_limit, parse_meminfo, parse_proc_cgroup

FIX = Path(__file__).parent / "fixtures" / "doctor"
REF = FIX / "reference-3090-epyc-raid0"
DESKTOP = FIX / "desktop-4090-gen4-64g"


def test_nvidia_smi_query_and_banner_give_the_gpu():
    (gpu,) = parse_smi_query(
        (REF / "cmd/nvidia-smi-query.txt").read_text(), (REF / "cmd/nvidia-smi.txt").read_text()
    )
    assert (gpu.index, gpu.name, gpu.compute_capability) == (0, "NVIDIA GeForce RTX 3090", "8.6")
    assert (gpu.memory_total_mib, gpu.memory_free_mib) == (24576, 24233)
    assert (gpu.driver_version, gpu.cuda_driver_version) == ("610.57.04", "13.1")
    assert (gpu.pcie_gen_current, gpu.pcie_gen_max, gpu.pcie_width_max) == (1, 4, 16)
    assert gpu.memory_bandwidth_gbps == 936.1  # 384-bit x 9751 MHz x 2
    assert gpu.processes == []


def test_nvidia_smi_process_table_lists_graphics_work():
    procs = parse_smi_processes((DESKTOP / "cmd/nvidia-smi.txt").read_text())[0]
    assert [(p.pid, p.name, p.kind, p.used_mib) for p in procs[:2]] == [
        (2841, "/usr/lib/xorg/Xorg", "graphics", 412),
        (3120, "/usr/bin/gnome-shell", "graphics", 226),
    ]
    assert len(procs) == 3


def test_nvidia_smi_unsupported_fields_become_none():
    row = "1, GPU-x, Tesla T4, 15360, 0, 14913, 535.183.01, [N/A], [N/A], [N/A], 8, 16, [N/A]\n"
    (gpu,) = parse_smi_query(row, "")
    assert gpu.compute_capability is None and gpu.pcie_gen_max is None
    assert gpu.pcie_width_current == 8 and gpu.memory_bandwidth_gbps is None
    assert parse_smi_header("") == (None, None)


def test_nvidia_smi_row_with_missing_fields_is_an_error():
    with pytest.raises(ValueError, match="nvidia-smi query row has 3 fields, expected 13"):
        parse_smi_query("0, GPU-x, RTX\n", "")


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list([5]) == "5"
    with pytest.raises(ValueError, match="bad CPU list '2-x': expected e.g. 0-3,8,10-11"):
        parse_cpu_list("2-x")


def test_lscpu_parsable_gives_smt_siblings_on_one_core():
    rows = parse_lscpu_parsable((REF / "cmd/lscpu-p.txt").read_text())
    assert len(rows) == 48
    assert (rows[24].cpu, rows[24].core) == (24, 0)
    assert parse_lscpu_parsable("# CPU,Core,Socket,Node\n0,0,0,\n")[0].node == 0


def test_meminfo_is_bytes():
    info = parse_meminfo((REF / "root/proc/meminfo").read_text())
    assert info["MemTotal"] == 527_433_728 * 1024
    assert info["HugePages_Total"] == 0


def test_cgroup_v1_and_v2_paths():
    assert parse_proc_cgroup("0::/user.slice/a.scope\n") == (2, "/user.slice/a.scope")
    assert parse_proc_cgroup("11:memory:/docker/ab\n1:name=systemd:/docker/ab\n") == (
        1,
        "/docker/ab",
    )
    assert parse_proc_cgroup("4:memory:/docker/ab\n0::/system.slice/x.service\n") == (
        1,
        "/docker/ab",
    )
    assert parse_proc_cgroup("") is None
    assert parse_limit("max\n") is None
    assert parse_limit("9223372036854771712") is None
    assert parse_limit("8589934592") == 8 * 2**30
    with pytest.raises(ValueError, match="cgroup limit 'lots': expected 'max' or a number"):
        parse_limit("lots")
    assert parse_memlock("unlimited") is None and parse_memlock("8192") == 8 * 2**20


def test_lsblk_merges_an_array_over_its_member_disks():
    devices = {d.name: d for d in parse_lsblk((REF / "cmd/lsblk.txt").read_text())}
    md = devices["md127"]
    assert (md.type, md.fstype, md.mountpoints) == ("raid0", "xfs", ["/nvx"])
    assert md.disks == ["nvme1n1", "nvme2n1", "nvme3n1", "nvme4n1"]
    assert devices["nvme0n1p2"].disks == ["nvme0n1"] and devices["nvme0n1"].has_children
    assert devices["nvme0n1"].model == "Samsung SSD 990 PRO 4TB"


def test_lsblk_before_util_linux_2_37_uses_mountpoint_and_strings():
    text = (FIX / "nogpu-i5-16g-container" / "cmd/lsblk.txt").read_text()
    devices = {d.name: d for d in parse_lsblk(text)}
    assert devices["sda"].transport == "sata" and devices["sda"].size_bytes == 500107862016
    assert devices["sda2"].mountpoints == ["/etc/hosts"] and not devices["sda2"].rotational
    assert devices["sda2"].path == "/dev/sda2"


def test_mdstat_members_level_and_chunk():
    (md,) = parse_mdstat((REF / "root/proc/mdstat").read_text())
    assert (md.name, md.state, md.level, md.chunk_kib) == ("md127", "active", "raid0", 512)
    assert md.members == ["nvme4n1", "nvme3n1", "nvme2n1", "nvme1n1"]
    degraded = "md0 : active (auto-read-only) raid1 sdb1[1](F) sda1[0]\n      1000 blocks\n"
    assert parse_mdstat(degraded)[0].members == ["sdb1", "sda1"]
    assert parse_mdstat("Personalities : \nunused devices: <none>\n") == []


def test_mounts_decode_octal_escapes():
    rows = parse_mounts((DESKTOP / "root/proc/mounts").read_text())
    assert ("/dev/nvme0n1p2", "/home/ana/My Games", "ext4") == rows[-1][:3]


def test_sweep_result_gives_c1_decode_and_shortest_prefill():
    text = (
        "some table\n"
        '{"bench": "sweep", "figures": {"decode_c1_tok_s": 16.9, "decode_c2_tok_s": 17.5, '
        '"prefill_32768_tok_s": 950.0, "prefill_8192_tok_s": 640.5}, "config": {"mode": "nvme"}}\n'
    )
    got = parse_sweep(text)
    assert (got.mode, got.decode_c1_tok_s, got.prefill_tokens, got.prefill_tok_s) == (
        "nvme",
        16.9,
        8192,
        640.5,
    )
    assert parse_sweep('{"figures": {"prefill_8k_tok_s": 700}}').prefill_tokens == 8192


def test_sweep_result_without_known_figures_lists_what_it_has():
    with pytest.raises(ValueError, match=r"no decode_c1_tok_s or prefill_<N>_tok_s .*\(rps\)"):
        parse_sweep('{"figures": {"rps": 3}}', "x.json")
    with pytest.raises(ValueError, match="x.json: not a bench result"):
        parse_sweep("hello", "x.json")
