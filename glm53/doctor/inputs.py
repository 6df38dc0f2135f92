"""What the planner derives from a probed host: the GPU to use, the CPUs of the lane, the
memory budget, PCIe and store rates (measured, else estimated from the links), and where a
store (and the checkpoint) could live."""

from __future__ import annotations

import os
import re

import msgspec

from glm53.doctor.costmodel import CHECKPOINT_BYTES, MIN_FREE_VRAM_MIB, store_total_bytes
from glm53.doctor.host import BlockDevice, Cpu, Gpu, Memory, Mount, Storage
from glm53.units import GIB

# GT/s per lane and line-code efficiency per PCIe generation
PCIE_GEN = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130),
            5: (32.0, 128 / 130), 6: (64.0, 242 / 256)}  # fmt: skip
# pinned copies reach about 80 % of the line rate: 25 GB/s on 4.0 x16 (seed README, anchors §1)
PCIE_PRACTICAL = 0.8
# sequential O_DIRECT reads reach about 85 % of an NVMe link: ~7 GB/s on one Gen4 x4 drive,
# ~26 GB/s on the seed's 4x Gen4 RAID0 (seed guide step 2; anchors §1)
NVME_PRACTICAL = 0.85
STORE_FILESYSTEMS = {"xfs", "ext4"}
LOCAL_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


def link_gbps(gen: int | None, width: int | None, practical: float) -> float | None:
    if gen not in PCIE_GEN or not width:
        return None
    gts, code = PCIE_GEN[gen]
    return round(gts * code * width / 8 * practical, 2)


def choose_gpu(gpus: list[Gpu], index: int | None) -> Gpu | None:
    """The requested GPU, else the one with most free VRAM among those no process uses, else
    the one with most free VRAM."""
    if index is not None:
        for g in gpus:
            if g.index == index:
                return g
        raise ValueError(f"--gpu {index}: no such GPU; found {[g.index for g in gpus]}")
    if not gpus:
        return None
    idle = [g for g in gpus if not g.processes and g.memory_free_mib >= MIN_FREE_VRAM_MIB]
    return max(idle or gpus, key=lambda g: g.memory_free_mib)


# The cores of the lane's node left out of the lane, in core order, and what each is kept for.
RESERVED_CORE_ROLES = ("the OS and the server's event loop", "the engine thread (drives the GPU)")


class ReservedCore(msgspec.Struct, frozen=True):
    cpu: int
    kept_for: str


class LeftOut(msgspec.Struct, frozen=True):
    cpus: list[int]
    why: str


class LaneLayout(msgspec.Struct, frozen=True):
    """Where the CPU lane's threads would run: one thread pinned to each CPU of `cpus`."""

    cpus: list[int]
    node: int | None  # the NUMA node of the lane; None: --cpus spans nodes, or no node held one
    node_why: str  # how that node was chosen
    reserved: list[ReservedCore]  # cores of the node kept out of the lane, and for what
    left_out: list[LeftOut]  # the other CPUs the lane does not use, and why


def _node_of(cpu: Cpu) -> dict[int, int]:
    return {t.cpu: t.node for t in cpu.topology}


def lane_layout(cpu: Cpu, requested: list[int] | None, gpu: Gpu | None = None) -> LaneLayout:
    """The lane's CPUs: one logical CPU (the lowest SMT sibling) per physical core of the GPU's
    NUMA node (node 0 when sysfs does not say) inside the allowed set, but the node's first two
    cores, which stay with the OS, the event loop and the engine thread, as the seed's auto
    layout keeps two (§3.4). Threads on a far node would read the pinned experts across the
    interconnect. --cpus (`requested`) is taken as given, inside the allowed set."""
    allowed = set(cpu.allowed_cpus)
    node_of = _node_of(cpu)
    if requested is not None:
        outside = sorted(set(requested) - allowed)
        if outside:
            raise ValueError(
                f"--cpus has CPUs {outside} outside this process's allowed set; "
                "pick CPUs from the allowed list (a container's --cpuset-cpus)"
            )
        nodes = {node_of.get(c, 0) for c in requested}
        node = nodes.pop() if len(nodes) == 1 else None
        return LaneLayout(sorted(set(requested)), node, "from --cpus", [], [])
    first_of_core: dict[tuple[int, int], int] = {}
    for t in sorted(cpu.topology, key=lambda t: t.cpu):
        if t.cpu in allowed:
            first_of_core.setdefault((t.socket, t.core), t.cpu)
    cores = sorted(first_of_core.values())
    if gpu is not None and gpu.numa_node is not None:
        node = gpu.numa_node
        node_why = f"GPU {gpu.index}'s, from sysfs numa_node of PCI device {gpu.pci_bus_id}"
    elif gpu is None:
        node, node_why = 0, "no GPU to place it near"
    else:
        node = 0
        node_why = f"GPU {gpu.index}'s node unknown: " + (
            f"no numa_node in sysfs for PCI device {gpu.pci_bus_id}"
            if gpu.pci_bus_id
            else "the GPU probe gave no PCI address"
        )
    on_node = [c for c in cores if node_of.get(c, 0) == node]
    if not on_node:
        node_why += f"; node {node} has no CPU this process may run on, so every node's"
        on_node, node = cores, None
    left_out = []
    lane_or_reserved = set(cores)
    siblings = sorted(
        c for c in allowed - lane_or_reserved if node is None or node_of.get(c, 0) == node
    )
    if siblings:
        left_out.append(LeftOut(siblings, "SMT siblings (one lane thread per physical core)"))
    far = sorted(c for c in allowed if node is not None and node_of.get(c, 0) != node)
    if far:
        left_out.append(
            LeftOut(
                far, f"on other NUMA nodes than {node} (far from the GPU and the experts it pins)"
            )
        )
    barred = sorted(set(node_of) - allowed)
    if barred:
        left_out.append(LeftOut(barred, "outside this process's allowed CPUs (its cpuset)"))
    reserved = [ReservedCore(c, r) for c, r in zip(on_node, RESERVED_CORE_ROLES, strict=False)]
    return LaneLayout(on_node[len(RESERVED_CORE_ROLES) :], node, node_why, reserved, left_out)


def lane_cpus(cpu: Cpu, requested: list[int] | None, gpu: Gpu | None = None) -> list[int]:
    """The CPUs of lane_layout."""
    return lane_layout(cpu, requested, gpu).cpus


def lane_simd(cpu: Cpu) -> str | None:
    """The vector path the CPU lane can use here, or None (its scalar path is far too slow)."""
    f = cpu.flags
    if f.avx512f and f.avx512bw:
        return "AVX-512"
    if f.avx2 and f.fma and f.f16c:
        return "AVX2+FMA+F16C"
    return None


class Budget(msgspec.Struct, frozen=True):
    bytes: int
    how: str


def memory_budget(mem: Memory) -> Budget:
    """RAM glm53 may plan with: what is available (under a cgroup cap, the cap), less headroom
    for the OS and the user's other work (the larger of 4 GiB and 10 % of RAM)."""
    available = mem.available_bytes
    how = f"MemAvailable {available / GIB:.1f} GiB"
    if mem.cgroup_limited and mem.cgroup_max_bytes is not None:
        if mem.cgroup_max_bytes < available:
            available = mem.cgroup_max_bytes
            how = f"cgroup memory.max {available / GIB:.1f} GiB"
    headroom = max(4 * GIB, mem.total_bytes // 10)
    return Budget(
        bytes=max(0, available - headroom),
        how=f"{how} - {headroom / GIB:.1f} GiB headroom",
    )


def _device_by_path(storage: Storage) -> dict[str, BlockDevice]:
    table = {}
    for d in storage.devices:
        table[d.path] = d
        table[f"/dev/{d.name}"] = d
    return table


def mount_of(storage: Storage, path: str) -> Mount | None:
    """The mount holding path: the longest matching mount point, the later of equal ones."""
    path = os.path.abspath(path)
    best = None
    for m in storage.mounts:
        t = m.target
        if path == t or path.startswith(t.rstrip("/") + "/"):
            if best is None or len(t) >= len(best.target):
                best = m
    return best


def backing_disks(storage: Storage, mount: Mount) -> list[BlockDevice]:
    """The whole disks under a mount (through partitions, md, crypt, lvm)."""
    by_path = _device_by_path(storage)
    dev = by_path.get(mount.source)
    if dev is None:
        return []
    disks = {d.name: d for d in storage.devices if d.type == "disk"}
    return [disks[n] for n in dev.disks if n in disks]


def is_nvme(disk: BlockDevice) -> bool:
    return disk.transport == "nvme" or bool(re.fullmatch(r"nvme\d+n\d+", disk.name))


def estimated_read_gbps(storage: Storage, mount: Mount) -> float | None:
    """Sequential O_DIRECT read rate from the NVMe links under a mount (RAID0 adds them up);
    None when any disk under it is not NVMe or its link is unknown."""
    disks = backing_disks(storage, mount)
    if not disks or not all(is_nvme(d) for d in disks):
        return None
    total = 0.0
    for disk in disks:
        ctrl = next((c for c in storage.nvme if disk.name in c.namespaces), None)
        if ctrl is None or not ctrl.link_speed_current or not ctrl.link_width_current:
            return None
        m = re.match(r"([\d.]+)\s*GT/s", ctrl.link_speed_current)
        gen = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}.get(
            m.group(1) if m else ""
        )
        rate = link_gbps(gen, ctrl.link_width_current, NVME_PRACTICAL)
        if rate is None:
            return None
        total += rate
    return round(total, 2)


class Spot(msgspec.Struct, frozen=True):
    """A filesystem that could hold the store or the checkpoint."""

    target: str
    fstype: str
    free_bytes: int
    disks: list[str]
    nvme_only: bool
    read_gbps_estimate: float | None


def spots(storage: Storage) -> list[Spot]:
    """Mounted filesystems with a known free size, best store location first: local xfs/ext4
    on NVMe only, then by estimated read rate, then by free space."""
    seen, out = set(), []
    for m in storage.mounts:
        if m.free_bytes is None or m.source in seen or not m.source.startswith("/dev/"):
            continue
        seen.add(m.source)
        disks = backing_disks(storage, m)
        out.append(
            Spot(
                target=m.target,
                fstype=m.fstype,
                free_bytes=m.free_bytes,
                disks=[d.name for d in disks],
                nvme_only=bool(disks) and all(is_nvme(d) for d in disks),
                read_gbps_estimate=estimated_read_gbps(storage, m),
            )
        )
    return sorted(
        out,
        key=lambda s: (
            not (s.nvme_only and s.fstype in STORE_FILESYSTEMS),
            -(s.read_gbps_estimate or 0.0),
            -s.free_bytes,
        ),
    )


def store_spot(all_spots: list[Spot], bits: int = 3) -> Spot | None:
    need = store_total_bytes(bits)
    for s in all_spots:
        if s.nvme_only and s.fstype in STORE_FILESYSTEMS and s.free_bytes >= need:
            return s
    return None


def checkpoint_spot(all_spots: list[Spot], avoid: str | None) -> Spot | None:
    """Where the 125.3 GB checkpoint fits: any local disk (only its non-expert part is read,
    once at load); another filesystem than the store's if one has room."""
    fits = [s for s in all_spots if s.free_bytes >= CHECKPOINT_BYTES]
    other = [s for s in fits if s.target != avoid]
    return (other or fits or [None])[0]


def idle_nvme_disks(storage: Storage) -> list[BlockDevice]:
    """NVMe disks with no partition, filesystem, mount or RAID membership: safe to propose for a
    new array only after the user confirms them (creating one erases them)."""
    members = {m for a in storage.md for m in a.members}
    return [
        d
        for d in storage.devices
        if d.type == "disk"
        and is_nvme(d)
        and not d.has_children
        and not d.fstype
        and not d.mountpoints
        and d.name not in members
    ]
