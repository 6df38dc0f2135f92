"""The probed facts about a host, as typed records. Every size is in bytes or MiB as its name
says; a field is None when the probe could not tell (the reason is in HostProbe.unavailable)."""

from __future__ import annotations

import msgspec


class GpuProcess(msgspec.Struct, frozen=True):
    pid: int
    name: str
    kind: str  # "compute", "graphics" or "compute+graphics"
    used_mib: int | None


class Gpu(msgspec.Struct, frozen=True):
    index: int
    name: str
    uuid: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    driver_version: str
    cuda_driver_version: str | None  # the newest CUDA this driver supports, e.g. "13.0"
    compute_capability: str | None  # "8.6"
    pcie_gen_current: int | None  # idle GPUs drop to gen 1: judge the link by the max values
    pcie_gen_max: int | None  # the most this GPU and this slot can both do
    pcie_width_current: int | None
    pcie_width_max: int | None
    memory_bandwidth_gbps: float | None  # from bus width x memory clock, when known
    processes: list[GpuProcess]
    source: str  # "nvml" or "nvidia-smi"
    pci_bus_id: str | None = None  # sysfs form, 0000:41:00.0
    numa_node: int | None = None  # from /sys/bus/pci/devices/<pci_bus_id>/numa_node


class CpuFlags(msgspec.Struct, frozen=True):
    avx2: bool
    fma: bool
    f16c: bool
    avx512f: bool
    avx512bw: bool
    avx512_vnni: bool
    avx512_vbmi: bool
    amx_tile: bool


class CpuTopology(msgspec.Struct, frozen=True):
    cpu: int
    core: int
    socket: int
    node: int


class Cpu(msgspec.Struct, frozen=True):
    model: str
    sockets: int
    physical_cores: int
    logical_cpus: int
    numa_nodes: int
    flags: CpuFlags
    topology: list[CpuTopology]
    allowed_cpus: list[int]  # this process's affinity (a container's cpuset)


class SwapDevice(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "partition" or "file"
    size_bytes: int
    is_zram: bool


class Memory(msgspec.Struct, frozen=True):
    total_bytes: int
    available_bytes: int
    swap_total_bytes: int
    swap_devices: list[SwapDevice]
    cgroup_version: int | None
    cgroup_path: str | None
    cgroup_limited: bool
    cgroup_max_bytes: int | None  # set only when cgroup_limited
    cgroup_swap_max_bytes: int | None  # None: no swap limit found
    memlock_unlimited: bool
    memlock_bytes: int | None  # set only when not unlimited


class BlockDevice(msgspec.Struct, frozen=True):
    name: str
    path: str
    model: str | None
    size_bytes: int
    type: str  # disk, part, raid0, crypt, lvm, loop, ...
    fstype: str | None
    mountpoints: list[str]
    rotational: bool
    transport: str | None  # nvme, sata, usb, ...
    disks: list[str]  # the top-level disks this device sits on (itself for a disk)
    has_children: bool


class NvmeController(msgspec.Struct, frozen=True):
    name: str  # nvme0
    model: str
    link_speed_current: str | None  # "16.0 GT/s PCIe"
    link_width_current: int | None
    link_speed_max: str | None
    link_width_max: int | None
    namespaces: list[str]  # block devices: nvme0n1


class MdArray(msgspec.Struct, frozen=True):
    name: str
    state: str
    level: str
    members: list[str]
    chunk_kib: int | None


class Mount(msgspec.Struct, frozen=True):
    source: str
    target: str
    fstype: str
    options: str
    total_bytes: int | None
    free_bytes: int | None


class Storage(msgspec.Struct, frozen=True):
    devices: list[BlockDevice]
    nvme: list[NvmeController]
    md: list[MdArray]
    mounts: list[Mount]


class Versions(msgspec.Struct, frozen=True):
    python: str
    torch: str | None
    torch_cuda: str | None  # None: a CPU build of torch
    torch_arch_list: list[str]
    exllamav3: str | None
    huggingface_hub: str | None
    nvidia_ml_py: str | None
    glm53: str | None


class LaneCalibration(msgspec.Struct, frozen=True):
    threads: int
    a_ms: float  # fixed cost per CPU-lane job
    b_ms: float  # cost per 3-bit expert
    variant: str = ""  # the kernel the lane chose (AVX-512, AVX2, scalar)


class StoreRead(msgspec.Struct, frozen=True):
    path: str
    read_gbps: float  # O_DIRECT, several readers, record-sized requests
    record_latency_ms: float  # mean time of one record-sized read under that load
    bytes_read: int


class Measured(msgspec.Struct):
    """Micro-probes run on this host; a None value has its reason in `notes`."""

    dram_gbps: float | None = None
    pcie_h2d_gbps: float | None = None
    lane: LaneCalibration | None = None
    store: StoreRead | None = None
    odirect_ok: bool | None = None
    notes: dict[str, str] = {}


class HostProbe(msgspec.Struct):
    gpus: list[Gpu] | None  # [] when the host has no NVIDIA GPU, None when the probe failed
    gpu_source: str  # how the GPUs were found, or why none was
    cpu: Cpu | None
    memory: Memory | None
    storage: Storage | None
    versions: Versions | None
    measured: Measured
    unavailable: dict[str, str]  # probe name -> why it could not answer
