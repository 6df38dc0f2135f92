"""The RAM tier's size: the default --ram-cap planned from MemAvailable and the cgroup's
memory.max (glm53.plan.ram_cap, glm53.plan.host_memory), read from real files laid out like /proc and /sys/fs/cgroup,
and a cap below one decode step's working set refused before anything loads."""

from pathlib import Path

import pytest
from serving_kit import Server

from glm53.config import ConfigurationError
from glm53.engine.cpu import CpuEngine
from glm53.engine.cpu_options import CpuEngineOptions
from glm53.plan.host_memory import HostMemory, host_memory
from glm53.plan.ram_cap import RamCapError, check_cap, planned_cap_bytes, working_set_records
from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint
from glm53.units import GIB

RECORD = 77_824
MEMINFO = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   10485760 kB\n"


def host(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_line)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_v2_cgroup_limit_up_the_tree_and_its_usage_are_read(tmp_path):
    root = host(
        tmp_path,
        "0::/system.slice/glm53.service\n",
        {
            "sys/fs/cgroup/system.slice/glm53.service/memory.max": "max\n",
            "sys/fs/cgroup/system.slice/memory.max": f"{8 * GIB}\n",
            "sys/fs/cgroup/system.slice/memory.current": f"{GIB}\n",
        },
    )
    assert host_memory(str(root)) == HostMemory(10 * GIB, 8 * GIB, GIB)


def test_a_v1_limit_and_no_cgroup_are_read(tmp_path):
    v1 = host(
        tmp_path / "v1",
        "5:memory:/docker/abc\n0::/\n",
        {
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{4 * GIB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{GIB // 2}\n",
        },
    )
    assert host_memory(str(v1)) == HostMemory(10 * GIB, 4 * GIB, GIB // 2)
    unlimited = host(tmp_path / "none", "0::/\n", {"sys/fs/cgroup/memory.max": "max\n"})
    assert host_memory(str(unlimited)) == HostMemory(10 * GIB, None, None)


def nested_tree(tmp_path: Path, parent_current: int) -> Path:
    """A service with its own 6 GiB limit (1 GiB used) under a slice limited to 8 GiB, whose
    usage (the service's and its siblings') is `parent_current`."""
    return host(
        tmp_path,
        "0::/work.slice/glm53.service\n",
        {
            "sys/fs/cgroup/work.slice/glm53.service/memory.max": f"{6 * GIB}\n",
            "sys/fs/cgroup/work.slice/glm53.service/memory.current": f"{GIB}\n",
            "sys/fs/cgroup/work.slice/memory.max": f"{8 * GIB}\n",
            "sys/fs/cgroup/work.slice/memory.current": f"{parent_current}\n",
            "sys/fs/cgroup/memory.max": "max\n",
        },
    )


def test_every_level_up_the_tree_binds_and_the_doctor_reads_the_same_tree(tmp_path):
    # the slice's siblings use 6 of its 8 GiB: the slice leaves 2 GiB, the service's own
    # limit 5; the room is the slice's (the nearest limit alone would say 5 GiB)
    busy = nested_tree(tmp_path / "busy", 6 * GIB)
    assert host_memory(str(busy)) == HostMemory(10 * GIB, 8 * GIB, 6 * GIB)
    assert host_memory(str(busy)).room_bytes() == 2 * GIB
    # an idle slice: the service's limit leaves less room, so it binds
    idle = nested_tree(tmp_path / "idle", GIB)
    assert host_memory(str(idle)) == HostMemory(10 * GIB, 6 * GIB, GIB)
    # the doctor, planning before glm53 runs, reads the same levels and takes the tightest limit
    from glm53.doctor.memory import probe_memory
    from glm53.doctor.source import FixtureSource

    for root in (busy, idle):
        (root / "cmd").mkdir()
        (root / "cmd/ulimit-l.txt").write_text("unlimited\n")
        (root / "root").mkdir()
        for sub in ("proc", "sys"):
            (root / sub).rename(root / "root" / sub)
        mem = probe_memory(FixtureSource(root))
        assert (mem.cgroup_version, mem.cgroup_limited, mem.cgroup_max_bytes) == (2, True, 6 * GIB)


def test_the_planned_cap_is_the_tighter_room_less_the_margin():
    # MemAvailable 10 GiB, no cgroup: small-host margin 1.5 + 0.3 GiB
    free = HostMemory(10 * GIB, None, None)
    assert planned_cap_bytes(free, RECORD, 10**6) == 10 * GIB - int(1.8 * GIB)
    # the cgroup leaves 7 GiB of its 8: that is the room
    capped = HostMemory(10 * GIB, 8 * GIB, GIB)
    assert planned_cap_bytes(capped, RECORD, 10**6) == 7 * GIB - int(1.8 * GIB)
    # a big host: the 3 GiB margin, and never more than every record
    big = HostMemory(200 * GIB, 120 * GIB, 10 * GIB)
    assert planned_cap_bytes(big, RECORD, 10**7) == 110 * GIB - int(3.3 * GIB)
    assert planned_cap_bytes(big, RECORD, 192) == 192 * RECORD
    assert planned_cap_bytes(HostMemory(GIB, None, None), RECORD, 192) == 0


def test_a_cap_below_one_decode_steps_working_set_is_refused():
    assert working_set_records(4, 4, 32) == 16
    assert working_set_records(8, 8, 32) == 32  # never more than the layer has
    check_cap(16 * RECORD, RECORD, 16, 4, 4)
    with pytest.raises(RamCapError) as info:
        check_cap(15 * RECORD, RECORD, 16, 4, 4)
    assert str(info.value) == (
        f"--ram-cap {15 * RECORD} bytes (1.1 MiB): 15 expert records of {RECORD} bytes, but one "
        f"decode step needs 16 of a layer at once (top-k 4 x --max-batch 4), {16 * RECORD} "
        "bytes (1.2 MiB): raise --ram-cap, or lower --max-batch"
    )
    with pytest.raises(RamCapError, match="planned from free memory .MemAvailable 1.0 GiB."):
        check_cap(0, RECORD, 16, 4, 4, HostMemory(GIB, None, None).describe())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("budget") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


def test_the_engine_refuses_a_small_cap_before_loading_the_model(demo):
    engine = CpuEngine(demo, CpuEngineOptions(max_batch=4, cpu_threads=1, ram_cap=3 * RECORD))
    # read from the shards, a record is the aligned span of the expert's tensors: 81,920 bytes
    with pytest.raises(
        ConfigurationError,
        match=r"^--ram-cap 233472 bytes \(0.2 MiB\): 2 expert records of 81920 bytes, but one "
        r"decode step needs 16 of a layer at once",
    ):
        engine.load()
    assert engine.model is None


def test_serve_with_a_small_cap_exits_with_the_reason(demo, tmp_path):
    server = Server(
        ["--model", str(demo), "--engine", "cpu", "--ram-cap", "1M", "--max-batch", "4"],
        log_path=tmp_path / "server.log",
    )
    with pytest.raises(RuntimeError, match="exited with 1"):
        server.wait_ready()
    log = server.log()
    assert "the model failed to load: ConfigurationError: --ram-cap 1048576 bytes (1.0 MiB)" in log
    assert "one decode step needs 16 of a layer at once (top-k 4 x --max-batch 4)" in log
    assert "glm53.engine.cpu: tier check" not in log  # refused before anything loaded
