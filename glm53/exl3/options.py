"""What `glm53.exl3.load` takes, validated once when it is built (before anything loads):
the load mode, the chunk (whole exllamav3 pages), and a mode's GPU count. The GPU engine builds
one from its glm53.engine.gpu_options.EngineOptions; tests and benches build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from glm53.config import ConfigurationError
from glm53.exl3.prefix import PAGE
from glm53.modes import NVME_PREFETCH


class LoadMode(StrEnum):
    """How the routed experts are placed (glm53.exl3.loader says each)."""

    STOCK = "stock"
    ZEROCOPY = "zerocopy"
    EXACT = "exact"
    NVME_EXACT = "nvme-exact"


def check_chunk(chunk: int) -> None:
    """--chunk-size on the GPU engine: whole exllamav3 pages (the one check of it)."""
    if chunk % PAGE:
        raise ConfigurationError(
            f"--chunk-size {chunk}: the GPU engine needs a multiple of {PAGE} "
            f"(exllamav3's page size), e.g. {max(PAGE, chunk // PAGE * PAGE)}"
        )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """glm53.exl3.load's settings. vram_budget (bytes; None: the device's free VRAM) plans the
        expert cache and staging as on a card with that much free. `gpus` with two or more entries
        splits the layers over them (glm53.exl3.split; `device` is then unused); None is the one-GPU
        load on `device`. store (required), ram_cap, read_timeout_s and nvme_prefetch are nvme-exact's (one GPU;
    the GPU engine's mode table, glm53.modes, requires the store)."""

    mode: LoadMode = LoadMode.EXACT
    device: str = "cuda:0"
    cache_tokens: int = 8192
    max_batch: int = 4
    max_chunk: int = 2048
    ec_slots: int | None = None
    ec_max_slots: int | None = None
    ec_reserve_gb: float = 1.0
    ec_stage_gb: float | None = None
    ec_freq_window: int | None = None
    stage_min_rows: int = 256
    stage_dma: bool | None = None
    stage_loan: bool = False  # exact: the staging buffers are cache slots in decode (StagingLoan)
    allow_unsupported: bool = False
    vram_budget: int | None = None
    gpus: tuple[int, ...] | None = None
    store: str | None = None
    ram_cap: int | None = None
    read_timeout_s: float | None = 30.0
    nvme_prefetch: str = "off"  # off or next-layer (glm53.tiers.decode_prefetch): nvme-exact's

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", LoadMode(self.mode))
        except ValueError:
            raise ConfigurationError(
                f"unknown load mode {self.mode!r}: stock, zerocopy, exact or nvme-exact"
            ) from None
        check_chunk(self.max_chunk)
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if self.is_split and self.mode is LoadMode.NVME_EXACT:
            raise ConfigurationError("nvme-exact runs on one GPU: --gpus names more than one")
        if self.nvme_prefetch not in NVME_PREFETCH:
            raise ConfigurationError(
                f"--nvme-prefetch {self.nvme_prefetch!r}: one of {', '.join(NVME_PREFETCH)}"
            )
        if self.nvme_prefetch != "off" and self.mode is not LoadMode.NVME_EXACT:
            raise ConfigurationError(
                f"--nvme-prefetch {self.nvme_prefetch}: it reads the store ahead, and load "
                f"mode {self.mode} reads no store; leave it off, or load nvme-exact"
            )
        if self.stage_loan and (self.mode is not LoadMode.EXACT or self.is_split):
            raise ConfigurationError(
                "--ec-stage-loan lends exact mode's staging buffers to its one-GPU expert cache; "
                f"load mode {self.mode}{' split over --gpus' if self.is_split else ''} has no "
                "such pair: leave it out"
            )
        if self.is_split and self.mode is LoadMode.STOCK:
            raise ConfigurationError(
                "--gpus with two or more entries runs modes exact and zerocopy (routed experts "
                "in the pinned home); stock mode places every expert in VRAM and is the one-GPU "
                "reference"
            )

    @property
    def is_split(self) -> bool:
        return self.gpus is not None and len(self.gpus) > 1

    @property
    def rows(self) -> int:
        """The most rows one forward routes: a prefill chunk or a decode batch."""
        return max(self.max_chunk, self.max_batch)
