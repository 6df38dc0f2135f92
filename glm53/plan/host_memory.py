"""This process's memory as the RAM cap is planned from it (glm53.plan.ram_cap): MemAvailable from
/proc/meminfo, and the binding memory limit of its cgroup (v2, or v1's names) with that cgroup's
usage. The parsers and the cgroup rule are shared with the doctor's memory probe
(glm53.doctor.memory).

The cgroup rule, one for both: a limit anywhere up the tree applies, so every ancestor of the
process's cgroup is read (`cgroup_levels`). The doctor plans before glm53 runs and takes the
tightest limit (`tightest_limit`); the RAM cap is planned in the running process and takes the
level with the least room, limit less usage (`binding_level`): a parent whose siblings use most
of its larger limit binds before a child's smaller, emptier one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from glm53.units import GIB

# cgroup v1 writes "no limit" as a huge page-rounded number (9223372036854771712)
V1_UNLIMITED = 2**62


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per key."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
            out[key.strip()] = int(fields[0]) * scale
    return out


def parse_proc_cgroup(text: str) -> tuple[int, str] | None:
    """(version, path of this process's memory cgroup) from /proc/self/cgroup. A v1 memory
    line wins: in the hybrid layout the unified "0::" line carries no controllers."""
    unified = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if "memory" in controllers.split(","):
            return 1, path
        if hier == "0" and controllers == "":
            unified = (2, path)
    return unified


def parse_limit(text: str) -> int | None:
    """A cgroup limit file: "max" (v2) or a byte count (huge in v1 meaning none) -> None."""
    value = text.strip()
    if value == "max":
        return None
    if not value.isdigit():
        raise ValueError(f"cgroup limit {value!r}: expected 'max' or a number of bytes")
    n = int(value)
    return None if n >= V1_UNLIMITED else n


def ancestor_dirs(version: int, path: str) -> list[str]:
    """The cgroup directories of `path` from itself up to the root, under the v2 mount or v1's
    memory controller: "/a/b" -> [base/a/b, base/a, base]."""
    base = "/sys/fs/cgroup" if version == 2 else "/sys/fs/cgroup/memory"
    parts = [p for p in path.split("/") if p]
    return [base + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


@dataclass(frozen=True, slots=True)
class CgroupLevel:
    """One cgroup directory's memory limit (None: none set) and usage (None: not readable)."""

    directory: str
    limit_bytes: int | None
    current_bytes: int | None

    def room_bytes(self) -> int | None:
        if self.limit_bytes is None:
            return None
        return self.limit_bytes - (self.current_bytes or 0)


LIMIT_FILES = {
    2: ("memory.max", "memory.current"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes"),
}


def cgroup_levels(
    read, version: int, path: str, names: tuple[str, str] | None = None
) -> list[CgroupLevel]:
    """Every level of the cgroup tree above (and at) `path` that has the limit file `names[0]`
    (default: the memory limit of that version), nearest first. `read(path)` gives a file's
    text or None when it is not there."""
    limit_name, current_name = names or LIMIT_FILES[version]
    levels = []
    for directory in ancestor_dirs(version, path):
        text = read(f"{directory}/{limit_name}")
        if text is None:
            continue
        current = read(f"{directory}/{current_name}") if current_name else None
        current = current.strip() if current else ""
        levels.append(
            CgroupLevel(directory, parse_limit(text), int(current) if current.isdigit() else None)
        )
    return levels


def tightest_limit(levels: list[CgroupLevel]) -> int | None:
    """The smallest limit among the levels; None when none is limited."""
    limits = [lv.limit_bytes for lv in levels if lv.limit_bytes is not None]
    return min(limits) if limits else None


def binding_level(levels: list[CgroupLevel]) -> CgroupLevel | None:
    """The limited level with the least room (limit less usage); None when none is limited."""
    limited = [lv for lv in levels if lv.limit_bytes is not None]
    return min(limited, key=CgroupLevel.room_bytes) if limited else None


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Bytes: MemAvailable; the cgroup's memory.max and memory.current (None without a limit)."""

    available_bytes: int
    cgroup_max_bytes: int | None
    cgroup_current_bytes: int | None

    def room_bytes(self) -> int:
        room = self.available_bytes
        if self.cgroup_max_bytes is not None:
            room = min(room, self.cgroup_max_bytes - (self.cgroup_current_bytes or 0))
        return room

    def describe(self) -> str:
        text = f"MemAvailable {self.available_bytes / GIB:.1f} GiB"
        if self.cgroup_max_bytes is not None:
            text += (
                f", cgroup memory.max {self.cgroup_max_bytes / GIB:.1f} GiB with "
                f"{(self.cgroup_current_bytes or 0) / GIB:.1f} GiB in use"
            )
        return text


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def host_memory(root: str = "/") -> HostMemory:
    """This process's view now: /proc/meminfo and the binding level of its memory cgroup (v2, or
    v1's names)."""

    def read(path: str) -> str | None:
        return _read(os.path.join(root, path.lstrip("/")))

    info = parse_meminfo(read("/proc/meminfo") or "")
    available = info.get("MemAvailable", info.get("MemFree", 0))
    found = parse_proc_cgroup(read("/proc/self/cgroup") or "")
    if found is None:
        return HostMemory(available, None, None)
    level = binding_level(cgroup_levels(read, *found))
    if level is None:
        return HostMemory(available, None, None)
    return HostMemory(available, level.limit_bytes, level.current_bytes)
