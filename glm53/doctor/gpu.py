"""GPU probe: NVML (nvidia-ml-py, in a child process) first, `nvidia-smi` text second."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgspec

from glm53.doctor.host import Gpu, GpuProcess
from glm53.doctor.source import Source, Unavailable

HERE = Path(__file__).parent
SMI_FIELDS = (
    "index,uuid,name,memory.total,memory.used,memory.free,driver_version,compute_cap,"
    "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,"
    "clocks.max.memory"
)

# Spec-sheet figures for cards glm53 users run: memory bus width (bits) and dense FP16 tensor
# TFLOPS with FP32 accumulate. Used when NVML cannot give the bus width, and by the prefill model.
GPU_SPECS: dict[str, tuple[int, float]] = {
    "RTX 3090 Ti": (384, 80.0),
    "RTX 3090": (384, 71.0),
    "RTX A5000": (384, 111.1),
    "RTX A6000": (384, 154.8),
    "RTX 4090": (384, 165.2),
    "RTX 5090": (512, 209.5),
    "H200": (6144, 989.0),
}


def spec_of(name: str) -> tuple[int, float] | None:
    for key, spec in GPU_SPECS.items():  # most specific names first
        if key in name:
            return spec
    return None


def _int(field: str) -> int | None:
    field = field.strip()
    return int(field) if re.fullmatch(r"\d+", field) else None


def parse_smi_header(text: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from the banner of plain `nvidia-smi`."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", text)
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None)


_PROC_ROW = re.compile(
    r"^\|\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(C\+G|C|G)\s+(.*?)\s+(\d+MiB|N/A)\s*\|$"
)
_KINDS = {"C": "compute", "G": "graphics", "C+G": "compute+graphics"}


def parse_smi_processes(text: str) -> dict[int, list[GpuProcess]]:
    """Rows of the Processes table of plain `nvidia-smi`, by GPU index."""
    found: dict[int, list[GpuProcess]] = {}
    for line in text.splitlines():
        m = _PROC_ROW.match(line.strip())
        if m:
            used = None if m.group(7) == "N/A" else int(m.group(7)[:-3])
            proc = GpuProcess(
                pid=int(m.group(4)), name=m.group(6), kind=_KINDS[m.group(5)], used_mib=used
            )
            found.setdefault(int(m.group(1)), []).append(proc)
    return found


def parse_smi_query(csv_text: str, banner: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits` plus the banner."""
    _, cuda = parse_smi_header(banner)
    processes = parse_smi_processes(banner)
    gpus = []
    for line in csv_text.splitlines():
        if not line.strip():
            continue
        f = [x.strip() for x in line.split(",")]
        if len(f) != len(SMI_FIELDS.split(",")):
            raise ValueError(f"nvidia-smi query row has {len(f)} fields, expected 13: {line!r}")
        index, name, mem_mhz = int(f[0]), f[2], _int(f[12])
        spec = spec_of(name)
        bandwidth = None
        if spec and mem_mhz:
            bandwidth = round(spec[0] / 8 * mem_mhz * 2 / 1000, 1)
        gpus.append(
            Gpu(
                index=index,
                name=name,
                uuid=f[1],
                memory_total_mib=int(f[3]),
                memory_used_mib=int(f[4]),
                memory_free_mib=int(f[5]),
                driver_version=f[6],
                cuda_driver_version=cuda,
                compute_capability=f[7] if re.fullmatch(r"\d+\.\d+", f[7]) else None,
                pcie_gen_current=_int(f[8]),
                pcie_gen_max=_int(f[9]),
                pcie_width_current=_int(f[10]),
                pcie_width_max=_int(f[11]),
                memory_bandwidth_gbps=bandwidth,
                processes=processes.get(index, []),
                source="nvidia-smi",
            )
        )
    return gpus


def sysfs_pci_address(bus_id: str) -> str | None:
    """NVML's and nvidia-smi's "00000000:41:00.0" in the form of /sys/bus/pci/devices names,
    "0000:41:00.0"; None for text that is not a PCI address."""
    m = re.fullmatch(
        r"([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", bus_id.strip().lower()
    )
    return f"{m[1][-4:]}:{m[2]}:{m[3]}.{m[4]}" if m else None


def parse_smi_bus_ids(csv_text: str) -> dict[int, str]:
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader`: GPU index -> address."""
    found = {}
    for line in csv_text.splitlines():
        index, _, bus_id = (x.strip() for x in line.partition(","))
        if index.isdigit() and (address := sysfs_pci_address(bus_id)):
            found[int(index)] = address
    return found


def with_numa_nodes(source: Source, gpus: list[Gpu]) -> list[Gpu]:
    """Each GPU with its NUMA node, read from sysfs for its PCI address (-1 there: the host
    does not say, left None)."""
    out = []
    for g in gpus:
        address = sysfs_pci_address(g.pci_bus_id) if g.pci_bus_id else None
        node = None
        if address:
            try:
                text = source.read(f"/sys/bus/pci/devices/{address}/numa_node").strip()
                node = int(text) if re.fullmatch(r"\d+", text) else None
            except Unavailable:
                pass  # no such sysfs file (a container without /sys): the node stays unknown
        out.append(msgspec.structs.replace(g, pci_bus_id=address, numa_node=node))
    return out


def parse_nvml_json(text: str) -> list[Gpu]:
    """The JSON list nvml_dump.py prints."""
    return msgspec.json.decode(text, type=list[Gpu])


def probe_gpus(source: Source) -> tuple[list[Gpu], str]:
    """All NVIDIA GPUs and a note on how they were found. No GPU at all is an empty list
    (with the reason in the note); a probe that answered nothing useful raises Unavailable."""
    try:
        text = source.run("nvml", [sys.executable, "-P", str(HERE / "nvml_dump.py")])
        return with_numa_nodes(source, parse_nvml_json(text)), "NVML"
    except Unavailable as e:
        nvml_reason = str(e)
    try:
        query = source.run(
            "nvidia-smi-query",
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
        )
        banner = source.run("nvidia-smi", ["nvidia-smi"])
    except Unavailable as e:
        if "not found" in str(e):
            return [], f"no NVIDIA GPU: {e}; NVML: {nvml_reason}"
        raise Unavailable(f"NVML: {nvml_reason}; nvidia-smi: {e}") from None
    gpus = parse_smi_query(query, banner)
    try:
        bus_ids = parse_smi_bus_ids(
            source.run(
                "nvidia-smi-pci",
                ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
            )
        )
        gpus = [msgspec.structs.replace(g, pci_bus_id=bus_ids.get(g.index)) for g in gpus]
    except Unavailable:
        pass  # the GPUs' NUMA nodes stay unknown; the lane layout says so
    return with_numa_nodes(source, gpus), f"nvidia-smi (NVML: {nvml_reason})"
