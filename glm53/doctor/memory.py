"""Memory probe: /proc/meminfo, /proc/swaps, this process's cgroup (v2 or v1) limits, and
`ulimit -l`."""

from __future__ import annotations

from glm53.doctor.host import Memory, SwapDevice
from glm53.doctor.source import Source, Unavailable
from glm53.plan.host_memory import parse_limit, parse_meminfo, parse_proc_cgroup


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


def _ancestors(path: str) -> list[str]:
    """ "/a/b" -> ["/a/b", "/a", ""]: a limit anywhere up the tree applies."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) if i else "" for i in range(len(parts), -1, -1)]


def _tightest(source: Source, dirs: list[str], name: str) -> tuple[bool, int | None]:
    """(was any such file found, smallest limit among them or None for no limit)."""
    found, best = False, None
    for d in dirs:
        try:
            limit = parse_limit(source.read(f"{d}/{name}"))
        except Unavailable:
            continue
        found = True
        if limit is not None and (best is None or limit < best):
            best = limit
    return found, best


def _cgroup_limits(source: Source) -> tuple[int | None, str | None, int | None, int | None]:
    """(version, path, memory limit, swap limit); limits None when there are none."""
    try:
        found = parse_proc_cgroup(source.read("/proc/self/cgroup"))
    except Unavailable:
        return None, None, None, None
    if found is None:
        return None, None, None, None
    version, path = found
    if version == 2:
        dirs = ["/sys/fs/cgroup" + a for a in _ancestors(path)]
        _, mem = _tightest(source, dirs, "memory.max")
        _, swap = _tightest(source, dirs, "memory.swap.max")
        return 2, path, mem, swap
    dirs = ["/sys/fs/cgroup/memory" + a for a in _ancestors(path)]
    _, mem = _tightest(source, dirs, "memory.limit_in_bytes")
    has_memsw, memsw = _tightest(source, dirs, "memory.memsw.limit_in_bytes")
    swap = None
    if has_memsw and memsw is not None and mem is not None:
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
