"""Memory probe: /proc/meminfo, /proc/swaps, this process's cgroup (v2 or v1) limits, and
`ulimit -l`."""

from __future__ import annotations

from glm53.doctor.host import Memory, SwapDevice
from glm53.doctor.source import Source, Unavailable
from glm53.plan.host_memory import (
    cgroup_levels,
    parse_meminfo,
    parse_proc_cgroup,
    tightest_limit,
)


def parse_swaps(text: str) -> list[SwapDevice]:
    devices = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 3 and f[2].isdigit():
            name = f[0].replace("\\040", " ")
            devices.append(
                SwapDevice(
                    name=name,
                    kind=f[1],
                    size_bytes=int(f[2]) * 1024,
                    is_zram=name.startswith("/dev/zram"),
                )
            )
    return devices


def _reader(source: Source):
    """source.read as the shared cgroup walk wants it: None for a file that is not there."""

    def read(path: str) -> str | None:
        try:
            return source.read(path)
        except Unavailable:
            return None

    return read


def _cgroup_limits(source: Source) -> tuple[int | None, str | None, int | None, int | None]:
    """(version, path, memory limit, swap limit); limits None when there are none. Every level
    up the tree is read, and the tightest limit applies (glm53.plan.host_memory's rule)."""
    try:
        found = parse_proc_cgroup(source.read("/proc/self/cgroup"))
    except Unavailable:
        return None, None, None, None
    if found is None:
        return None, None, None, None
    version, path = found
    read = _reader(source)
    mem = tightest_limit(cgroup_levels(read, version, path))
    if version == 2:
        swap = tightest_limit(cgroup_levels(read, 2, path, ("memory.swap.max", "")))
        return 2, path, mem, swap
    memsw_levels = cgroup_levels(read, 1, path, ("memory.memsw.limit_in_bytes", ""))
    memsw = tightest_limit(memsw_levels)
    swap = None
    if memsw_levels and memsw is not None and mem is not None:
        swap = max(0, memsw - mem)
    return 1, path, mem, swap


def parse_memlock(text: str) -> int | None:
    """`ulimit -l` (KiB or "unlimited") -> bytes, None for unlimited."""
    value = text.strip()
    if value == "unlimited":
        return None
    if not value.isdigit():
        raise ValueError(f"ulimit -l {value!r}: expected a number of KiB or 'unlimited'")
    return int(value) * 1024


def probe_memory(source: Source) -> Memory:
    info = parse_meminfo(source.read("/proc/meminfo"))
    if "MemTotal" not in info:
        raise Unavailable("/proc/meminfo has no MemTotal")
    try:
        swaps = parse_swaps(source.read("/proc/swaps"))
    except Unavailable:
        swaps = []
    version, path, mem_max, swap_max = _cgroup_limits(source)
    memlock = parse_memlock(source.memlock())
    return Memory(
        total_bytes=info["MemTotal"],
        available_bytes=info.get("MemAvailable", info.get("MemFree", 0)),
        swap_total_bytes=info.get("SwapTotal", 0),
        swap_devices=swaps,
        cgroup_version=version,
        cgroup_path=path,
        cgroup_limited=mem_max is not None,
        cgroup_max_bytes=mem_max,
        cgroup_swap_max_bytes=swap_max,
        memlock_unlimited=memlock is None,
        memlock_bytes=memlock,
    )
