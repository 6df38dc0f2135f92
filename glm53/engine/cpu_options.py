"""What the CPU engine takes (`CpuEngineOptions`), validated once when it is built, before
anything loads: the CPU lane's precision, and its --cpus / --cpu-threads resolved into the lane's
layout (glm53.tiers.cpu_lane.lane_layout; a bad value is a ConfigurationError naming the flag).
`engine_options` builds one from glm53's Settings; tests and benches build one directly, naming
only what they change.

What needs the checkpoint stays in CpuEngine.load: the context against the checkpoint's
max_position_embeddings, and --ram-cap against one decode step's expert records
(glm53.plan.ram_cap). The settings the CPU engine does not read (--ct-b, --prefill layer-major,
--gpus) are refused where the engine is picked (glm53.engine.create_engine), for the scripted
engine too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from glm53.config import ConfigurationError, Settings, cache_dir
from glm53.tiers.cpu_lane import (
    PRECISIONS,
    LaneConfigError,
    LaneLayout,
    lane_layout,
    lane_precision,
)
from glm53.tiers.heat import heat_path

# KDA prefill's chunk (transformers' `chunk_size`); why 16: glm53.engine.cpu's docstring.
KDA_CHUNK = 16


@dataclass(frozen=True, kw_only=True)
class CpuEngineOptions:
    """Every setting of a CpuEngine. `lane` (resolved here) is the CPU lane's layout."""

    context: int = 131072  # capped at load by the checkpoint's max_position_embeddings
    max_batch: int = 4  # the engine's slots
    ram_cap: int | None = None  # bytes; None: planned from free memory at load
    cpus: str | None = None  # the lane's CPUs (--cpus) and threads (--cpu-threads)
    cpu_threads: int | None = None
    lane_precision: str = "exact"  # the lane's arithmetic, resolved: exact or fast
    torch_threads: int | None = None  # None: the CPUs the lane leaves, at least 1
    store: str | None = None  # the packed expert store; None: the checkpoint's shards
    kda_chunk: int = KDA_CHUNK
    read_timeout_s: float | None = 30.0
    heat_file: str | None = None  # the RAM tier's warm start; None: start cold, keep none
    lane: LaneLayout = field(init=False)

    def __post_init__(self):
        if self.lane_precision not in PRECISIONS:
            raise ConfigurationError(
                f"lane precision {self.lane_precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        try:
            layout = lane_layout(self.cpus, self.cpu_threads)
        except LaneConfigError as exc:
            raise ConfigurationError(str(exc)) from None
        set_ = object.__setattr__
        set_(self, "lane", layout)
        if self.store is not None:
            set_(self, "store", str(self.store))


def engine_options(settings: Settings, checkpoint_dir: Path) -> CpuEngineOptions:
    """The CpuEngine's options for these Settings, every value checked once. The lane's
    precision: --ct-precision, where auto is exact on the CPU engine (glm53.tiers.cpu_lane)."""
    try:
        precision = lane_precision(settings.ct_precision, "cpu", settings.mode)
    except LaneConfigError as exc:
        raise ConfigurationError(str(exc)) from None
    return CpuEngineOptions(
        context=settings.context,
        max_batch=settings.max_batch,
        ram_cap=settings.ram_cap,
        cpus=settings.cpus,
        cpu_threads=settings.cpu_threads,
        lane_precision=precision,
        store=settings.store,
        read_timeout_s=settings.read_timeout,
        heat_file=heat_path(str(checkpoint_dir), "ram", settings.store, cache_dir(settings)),
    )
