"""What the GPU engine takes (`EngineOptions`), validated once when it is built, before anything
loads: the mode against the one table (glm53.modes.RULES: served, the store, one GPU), the
prefill order, and, through the glm53.exl3 LoadOptions it builds, the chunk and the load mode.
glm53.engine.gpu_create.engine_options builds one from glm53's Settings; tests and benches
build one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm53.config import ConfigurationError
from glm53.exl3.options import LoadMode, LoadOptions
from glm53.exl3.prefix import PAGE
from glm53.modes import NVME_PREFETCH as PREFETCH_MODES
from glm53.modes import Mode, ReferenceMode, resolved, rule, served

PREFILL_ORDERS = ("chunk", "layer-major")
# the modes a layer-major pass runs in: exact's load (its staging, its expert cache), and the
# store modes' (the RAM tier read once per layer per prompt; nvme's lane decodes only)
LAYER_MAJOR_MODES = (Mode.EXACT, Mode.NVME_EXACT, Mode.NVME)


def _gpus_text(gpus) -> str:
    return ",".join(map(str, gpus))


def check_mode(mode: Mode | ReferenceMode, store: str | None, gpus) -> None:
    """The GPU engine's mode against glm53.modes' table: served, its store, its GPU count."""
    if isinstance(mode, ReferenceMode):
        return  # stock and zerocopy: reference loads, one GPU or a split, no store
    r = rule("gpu", mode)
    if not r.served:
        raise ConfigurationError(f"--mode {mode}: {r.refusal}")
    if r.store == "refuses" and store:
        raise ConfigurationError(
            f"--store {store}: {r.name} {r.what} and does not read a store; leave --store out"
        )
    if r.store == "needs" and not store:
        raise ConfigurationError(
            f"--mode {mode} reads the routed experts from a packed store: pass --store DIR "
            "(`glm53 store pack`)"
        )
    if r.one_gpu and gpus is not None and len(gpus) > 1:
        raise ConfigurationError(f"--gpus {_gpus_text(gpus)}: {r.name} runs on one GPU; name one")


def check_prefetch(mode: Mode | ReferenceMode, prefetch: str) -> None:
    """--nvme-prefetch: a known value, and next-layer only where the store is read (the modes
    whose load is nvme-exact: nvme-exact and nvme)."""
    if prefetch not in PREFETCH_MODES:
        raise ConfigurationError(
            f"--nvme-prefetch {prefetch!r}: one of {', '.join(PREFETCH_MODES)}"
        )
    if prefetch == "off":
        return
    if isinstance(mode, ReferenceMode) or rule("gpu", mode).load != "nvme-exact":
        raise ConfigurationError(
            f"--nvme-prefetch {prefetch}: it reads the store ahead, and --mode {mode} reads no "
            "store; leave --nvme-prefetch out (off), or serve --mode nvme-exact or nvme with "
            "--store DIR"
        )


def _engine_mode(mode) -> Mode | ReferenceMode:
    if mode in tuple(ReferenceMode):
        return ReferenceMode(mode)
    try:
        return resolved("gpu", mode)
    except ValueError:
        runs = ", ".join(repr(str(m)) for m in (*served("gpu"), *ReferenceMode))
        raise ConfigurationError(
            f"mode {mode!r}: the GPU engine runs {runs} (the last two: reference loads)"
        ) from None


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Every setting of a GpuEngine. `load` (built here) is what glm53.exl3.load takes; `device`
    and `gpus` come out resolved: one --gpus entry is the one-GPU path on that GPU (gpus None),
    two or more split the layers (glm53.exl3.split)."""

    mode: Mode | ReferenceMode | str = Mode.EXACT  # auto is exact
    context: int = 8192
    max_batch: int = 4
    chunk_size: int = 2048
    ec_max_slots: int | None = None
    ec_reserve_gb: float = 1.0
    ec_stage_gb: float | None = None
    ec_freq_window: int | None = None
    ec_stage_loan: bool = False  # the staging buffers are cache slots in decode (StagingLoan)
    prefix_cache: bool = True
    recurrent_cache_gb: float = 4.0
    cache_tokens: int | None = None  # None: max_batch whole contexts, in pages
    vram_budget: int | None = None  # bytes: plan the cache, staging and KV as on that card
    device: str = "cuda:0"
    allow_unsupported: bool = False
    heat_file: str | None = None
    warmup: bool = False
    gpus: tuple[int, ...] | None = None
    store: str | None = None  # nvme-exact: the store, --ram-cap, the read timeout
    ram_cap: int | None = None
    read_timeout_s: float | None = 30.0
    nvme_prefetch: str = "off"  # the store modes' decode prefetch (glm53.tiers.decode_prefetch)
    lane_cpus: str | None = None  # fast: the lane's CPUs, threads, precision; --ct-b
    lane_threads: int | None = None
    lane_precision: str = "fast"
    ct_b: float | None = None
    prefill: str = "chunk"  # layer-major: glm53.exl3.layer_major
    # layer-major in the store modes: each layer staged once per pass (glm53.exl3.nvme_device;
    # not yet run on a GPU: on only with --allow-unrun-modes, UNRUN["store-pass-staging"]);
    # without it the pass reads each chunk's picks zero-copy, as its GPU test passed
    store_pass_staging: bool = False
    cache_dir: str | None = None  # heat lists live here (glm53.config.cache_dir; None: default)
    load: LoadOptions = field(init=False)

    def __post_init__(self):
        mode = _engine_mode(self.mode)
        set_ = object.__setattr__
        set_(self, "mode", mode)
        check_mode(mode, self.store, self.gpus)
        check_prefetch(mode, self.nvme_prefetch)
        if self.prefill not in PREFILL_ORDERS:
            raise ConfigurationError(
                f"--prefill {self.prefill!r}: chunk, or layer-major in exact, nvme-exact or "
                "nvme mode"
            )
        if self.prefill == "layer-major":
            if mode not in LAYER_MAJOR_MODES:
                raise ConfigurationError(
                    "--prefill layer-major runs in exact, nvme-exact and nvme mode (their "
                    f"expert cache and homes); --mode {mode} prefills chunk by chunk: leave "
                    "--prefill out (chunk)"
                )
            if self.gpus is not None and len(self.gpus) > 1:
                raise ConfigurationError(
                    f"--prefill layer-major runs on one GPU; --gpus {_gpus_text(self.gpus)} "
                    "names more"
                )
            if self.ec_stage_loan:
                raise ConfigurationError(
                    "--prefill layer-major lends cache slots to its own pass, and "
                    "--ec-stage-loan lends the staging buffers to the cache: one at a time; "
                    "leave one of them out"
                )
        device, gpus = self.device, self.gpus
        if gpus is not None and len(gpus) == 1:
            device = f"cuda:{gpus[0]}"  # one entry: the one-GPU path on that GPU
        set_(self, "device", device)
        set_(self, "gpus", tuple(gpus) if gpus is not None and len(gpus) > 1 else None)
        pages = -(-self.context // PAGE)
        set_(self, "cache_tokens", self.cache_tokens or self.max_batch * pages * PAGE)
        # the mode's load (glm53.modes' table: fast loads exact, the lane goes on top)
        load_mode = LoadMode(mode if isinstance(mode, ReferenceMode) else rule("gpu", mode).load)
        set_(self, "load", LoadOptions(
            mode=load_mode, device=self.device, cache_tokens=self.cache_tokens,
            max_batch=self.max_batch, max_chunk=self.chunk_size, ec_max_slots=self.ec_max_slots,
            ec_reserve_gb=self.ec_reserve_gb, ec_stage_gb=self.ec_stage_gb,
            ec_freq_window=self.ec_freq_window, stage_loan=self.ec_stage_loan,
            allow_unsupported=self.allow_unsupported,
            vram_budget=self.vram_budget, gpus=self.gpus, store=self.store,
            ram_cap=self.ram_cap, read_timeout_s=self.read_timeout_s,
            nvme_prefetch=self.nvme_prefetch,
        ))  # fmt: skip
