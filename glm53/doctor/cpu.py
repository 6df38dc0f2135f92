"""CPU probe: model and flags from /proc/cpuinfo (or lscpu), topology from `lscpu -p` (or
sysfs), the allowed CPU set from /proc/self/status."""

from __future__ import annotations

import re

from glm53.doctor.host import Cpu, CpuFlags, CpuTopology
from glm53.doctor.source import Source, Unavailable


def parse_cpu_list(text: str) -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text.strip()!r}: expected e.g. 0-3,8,10-11")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)


def parse_key_values(text: str) -> dict[str, str]:
    """`key: value` lines (lscpu, /proc/cpuinfo's first block, /proc/self/status)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def parse_flags(flag_text: str) -> CpuFlags:
    have = set(flag_text.split())
    return CpuFlags(
        avx2="avx2" in have,
        fma="fma" in have,
        f16c="f16c" in have,
        avx512f="avx512f" in have,
        avx512bw="avx512bw" in have,
        avx512_vnni="avx512_vnni" in have,
        avx512_vbmi="avx512vbmi" in have,
        amx_tile="amx_tile" in have,
    )


def parse_lscpu_parsable(text: str) -> list[CpuTopology]:
    """`lscpu -p=CPU,CORE,SOCKET,NODE`; an empty NODE column (no NUMA info) means node 0."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.strip().split(",")
        if len(f) != 4:
            raise ValueError(f"lscpu -p row {line!r}: expected CPU,CORE,SOCKET,NODE")
        cpu, core, socket, node = (int(x) if x else 0 for x in f)
        rows.append(CpuTopology(cpu=cpu, core=core, socket=socket, node=node))
    return rows


def _sysfs_topology(source: Source) -> list[CpuTopology]:
    base = "/sys/devices/system/cpu"
    node_of: dict[int, int] = {}
    try:
        for entry in source.listdir("/sys/devices/system/node"):
            if re.fullmatch(r"node\d+", entry):
                text = source.read(f"/sys/devices/system/node/{entry}/cpulist")
                for cpu in parse_cpu_list(text):
                    node_of[cpu] = int(entry[4:])
    except Unavailable:
        pass  # no NUMA directory: every CPU is on node 0
    rows = []
    for entry in source.listdir(base):
        if not re.fullmatch(r"cpu\d+", entry):
            continue
        cpu = int(entry[3:])
        try:
            core = int(source.read(f"{base}/{entry}/topology/core_id"))
            socket = int(source.read(f"{base}/{entry}/topology/physical_package_id"))
        except Unavailable:
            continue  # an offline CPU has no topology
        rows.append(CpuTopology(cpu=cpu, core=core, socket=socket, node=node_of.get(cpu, 0)))
    return sorted(rows, key=lambda r: r.cpu)


def build_cpu(model: str, flag_text: str, topology: list[CpuTopology], allowed: list[int]) -> Cpu:
    if not topology:
        raise Unavailable("CPU topology: no CPUs listed")
    return Cpu(
        model=model,
        sockets=len({t.socket for t in topology}),
        physical_cores=len({(t.socket, t.core) for t in topology}),
        logical_cpus=len(topology),
        numa_nodes=len({t.node for t in topology}),
        flags=parse_flags(flag_text),
        topology=topology,
        allowed_cpus=allowed or [t.cpu for t in topology],
    )


def probe_cpu(source: Source) -> Cpu:
    lscpu: dict[str, str] = {}
    try:
        lscpu = parse_key_values(source.run("lscpu", ["lscpu"]))
    except Unavailable:
        pass
    try:
        first_block = source.read("/proc/cpuinfo").split("\n\n")[0]
        info = parse_key_values(first_block)
    except Unavailable:
        info = {}
    flag_text = info.get("flags") or lscpu.get("Flags")
    if flag_text is None:
        raise Unavailable("CPU flags: neither /proc/cpuinfo nor lscpu answered")
    model = info.get("model name") or lscpu.get("Model name") or "unknown"
    try:
        topology = parse_lscpu_parsable(source.run("lscpu-p", ["lscpu", "-p=CPU,CORE,SOCKET,NODE"]))
    except Unavailable:
        topology = _sysfs_topology(source)
    try:
        status = parse_key_values(source.read("/proc/self/status"))
        allowed = parse_cpu_list(status.get("Cpus_allowed_list", ""))
    except Unavailable:
        allowed = []
    return build_cpu(model, flag_text, topology, allowed)
