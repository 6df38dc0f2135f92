"""This process's memory as the RAM cap is planned from it (glm53.plan.ram_cap): MemAvailable from
/proc/meminfo, and the nearest memory limit of its cgroup (v2, or v1's names) with that cgroup's
usage. The parsers are shared with the doctor's memory probe (glm53.doctor.memory).
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
    """This process's view now: /proc/meminfo and its memory cgroup (v2, or v1's names)."""
    info = parse_meminfo(_read(os.path.join(root, "proc/meminfo")) or "")
    available = info.get("MemAvailable", info.get("MemFree", 0))
    found = parse_proc_cgroup(_read(os.path.join(root, "proc/self/cgroup")) or "")
    if found is None:
        return HostMemory(available, None, None)
    version, path = found
    base = "sys/fs/cgroup" if version == 2 else "sys/fs/cgroup/memory"
    names = (
        ("memory.max", "memory.current")
        if version == 2
        else (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    )
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts), -1, -1):  # the nearest limit up the tree, and its usage
        directory = "/" + "/".join(parts[:i]) if i else ""
        where = os.path.join(root, base + directory)
        text = _read(os.path.join(where, names[0]))
        limit = parse_limit(text) if text is not None else None
        if limit is not None:
            current = _read(os.path.join(where, names[1]))
            return HostMemory(available, limit, int(current) if current else None)
    return HostMemory(available, None, None)
