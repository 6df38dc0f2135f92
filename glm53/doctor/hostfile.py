"""A host described in a small TOML file, for `glm53 doctor --host FILE`: predict for a machine
without probing it. Every figure is a table `{ value = ..., source = "..." }` that says where the
number comes from (measured where, or a spec sheet, or an assumption); the doctor prints the
sources beside its prediction. Shipped descriptions live in glm53/doctor/hosts/."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from glm53.errors import Glm53Error

HOSTS_DIR = Path(__file__).parent / "hosts"


class Figure(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    value: float
    source: str


class GpuSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # as nvidia-smi prints it
    vram_mib: Figure
    vram_free_mib: Figure  # what glm53 finds free at start
    vram_gbps: Figure
    fp16_tflops: Figure
    pcie_gen: Figure
    pcie_lanes: Figure
    pcie_gbps: Figure | None = None  # the rate the GPU reads pinned host memory; else estimated
    vram_budget_mib: Figure | None = None  # plan as on a card this size (gpu_slice --vram-budget)
    ec_max_slots: Figure | None = None
    # prefill compute per model layer measured with every expert in VRAM (costmodel.CostInputs)
    prefill_chunk_ms: Figure | None = None
    prefill_token_us: Figure | None = None


class CpuSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    cores: Figure  # physical
    lane_isa: Literal["avx512", "avx2"]
    lane_isa_source: str


class MemorySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ram_gib: Figure
    dram_read_gbps: Figure  # all cores reading
    dram_channels: Figure | None = None  # unknown in a VM


class DiskSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    read_gbps: Figure  # O_DIRECT, record-sized reads, several readers
    latency_ms: Figure | None = None  # one record under that load


class Measured(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Figures measured for the full model on this host, set beside the prediction."""

    source: str
    decode_c1_tok_s: float | None = None
    decode_c4_aggregate_tok_s: float | None = None
    prefill_8k_tok_s: float | None = None


class HostSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    gpu: GpuSpec
    cpu: CpuSpec
    memory: MemorySpec
    disk: DiskSpec
    nvme_ram_cap_gib: Figure | None = None  # nvme modes' --ram-cap; default 55 GiB (the seed's)
    measured: dict[str, Measured] = {}  # by mode


class HostFileError(ValueError, Glm53Error):
    """A host file that cannot be read: names the file, the field and what was expected."""


POSITIVE = (
    "gpu.vram_mib", "gpu.vram_free_mib", "gpu.vram_gbps", "gpu.fp16_tflops", "gpu.pcie_gen",
    "gpu.pcie_lanes", "gpu.pcie_gbps", "gpu.vram_budget_mib", "gpu.ec_max_slots",
    "gpu.prefill_chunk_ms", "gpu.prefill_token_us", "cpu.cores", "memory.ram_gib",
    "memory.dram_channels", "memory.dram_read_gbps", "disk.read_gbps", "disk.latency_ms",
    "nvme_ram_cap_gib",
)  # fmt: skip


def _field(spec: HostSpec, dotted: str) -> Figure | None:
    obj = spec
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def parse(text: str, origin: str) -> HostSpec:
    """The host described by TOML `text`; raises HostFileError naming `origin` and the field."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HostFileError(f"{origin}: not TOML: {e}") from None
    try:
        spec = msgspec.convert(raw, HostSpec)
    except msgspec.ValidationError as e:
        raise HostFileError(f"{origin}: {e}") from None
    for name in POSITIVE:
        fig = _field(spec, name)
        if fig is None:
            continue
        if not fig.value > 0 or fig.value == float("inf"):
            raise HostFileError(f"{origin}: {name} must be a positive number, got {fig.value}")
        if not fig.source.strip():
            raise HostFileError(f"{origin}: {name} has no source; say where the number is from")
    if (spec.gpu.prefill_chunk_ms is None) != (spec.gpu.prefill_token_us is None):
        raise HostFileError(
            f"{origin}: gpu.prefill_chunk_ms and gpu.prefill_token_us go together (both from "
            "one all-VRAM prefill at two lengths, costmodel.prefill_compute_fit); give both or "
            "neither"
        )
    cores = spec.cpu.cores.value
    if cores != int(cores) or cores < 3:
        raise HostFileError(
            f"{origin}: cpu.cores must be a whole number of at least 3 (two are kept for the "
            f"engine), got {cores:g}"
        )
    return spec


def shipped() -> list[str]:
    """Names of the shipped host descriptions."""
    return sorted(p.stem for p in HOSTS_DIR.glob("*.toml"))


def load(name_or_path: str) -> HostSpec:
    """A shipped description by name, or a TOML file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        bundled = HOSTS_DIR / f"{name_or_path}.toml"
        if not bundled.is_file():
            raise HostFileError(
                f"--host {name_or_path}: no such file, and not a shipped host "
                f"({', '.join(shipped())})"
            )
        path = bundled
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HostFileError(f"{path}: cannot read: {e}") from None
    return parse(text, str(path))
