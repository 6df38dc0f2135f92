"""The GPU engine for a glm53 Settings (`create`): which modes this build serves, the settings
each mode refuses (with the fix), and the GpuEngine arguments each mode takes. Creating is cheap;
GpuEngine.load does the heavy work (glm53.engine.gpu).
"""

from __future__ import annotations

from glm53.engine.gpu import GpuEngine
from glm53.exl3 import PAGE

# The tier modes this build's GPU engine serves (glm53 doctor recommends only these): fast,
# nvme-exact and nvme are wired in; those that have not run on a GPU only with
# --allow-unrun-modes.
SERVED_MODES = ("exact",)


# Paths written but not yet run on a GPU: served only with --allow-unrun-modes (for their GPU
# tests). mode -> what it is, for the refusal.
UNRUN_MODES = {
    "nvme-exact": "the GPU engine's nvme-exact (the RAM tier over --store as the experts' home)",
    "fast": "the GPU engine's fast mode (exact mode's tiers + the CPU lane taking the coldest "
    "decode misses, docs/fast-mode.md)",
    "nvme": "the GPU engine's nvme mode (nvme-exact + the CPU lane over the RAM tier, "
    "docs/fast-mode.md)",
}


def _unrun(what: str, instead: str):
    from glm53.config import ConfigurationError

    return ConfigurationError(
        f"{what} is written but has not yet run on a GPU, so serve refuses it; "
        f"--allow-unrun-modes runs it anyway (for its GPU tests). {instead}"
    )


def _common(settings) -> dict:
    """The GpuEngine arguments every mode takes from the settings."""
    from glm53.config import cache_dir

    return {
        "cache_dir": str(cache_dir(settings)),
        "context": settings.context,
        "max_batch": settings.max_batch,
        "chunk_size": settings.chunk_size,
        "ec_max_slots": settings.ec_max_slots,
        "ec_reserve_gb": settings.ec_reserve_gb,
        "ec_freq_window": settings.ec_freq_window,
        "vram_budget": settings.vram_budget,
        "warmup": settings.warmup,
        "gpus": settings.gpus,
    }


def _refuse_split(settings, mode: str) -> None:
    from glm53.config import ConfigurationError

    if settings.gpus is not None and len(settings.gpus) > 1:
        raise ConfigurationError(
            f"--gpus {','.join(map(str, settings.gpus))}: {mode} runs on one GPU; name one"
        )


def _refuse_chunk(settings) -> None:
    from glm53.config import ConfigurationError

    if settings.chunk_size % PAGE:
        raise ConfigurationError(
            f"--chunk-size {settings.chunk_size}: the GPU engine needs a multiple of {PAGE} "
            f"(exllamav3's page size), e.g. {max(PAGE, settings.chunk_size // PAGE * PAGE)}"
        )


def _refuse_layer_major(settings, mode: str) -> None:
    """--prefill layer-major: exact mode on one GPU, and only with --allow-unrun-modes until
    tests/gpu/test_layer_major_gpu.py has passed."""
    from glm53.config import ConfigurationError

    if settings.prefill == "chunk":
        return
    if mode != "exact":
        raise ConfigurationError(
            f"--prefill layer-major runs in exact mode only (its staging and expert cache); "
            f"--mode {settings.mode} prefills chunk by chunk: leave --prefill out"
        )
    if settings.gpus is not None and len(settings.gpus) > 1:
        raise ConfigurationError(
            f"--prefill layer-major runs on one GPU; --gpus {','.join(map(str, settings.gpus))} "
            "names more"
        )
    if not settings.allow_unrun_modes:
        raise _unrun(
            "--prefill layer-major (every chunk through a layer before the next, "
            "docs/layer-major.md)",
            "Leave --prefill out (chunk).",
        )


def create(settings, checkpoint_dir) -> GpuEngine:
    """The GPU engine for these Settings (not loaded)."""
    from glm53.config import ConfigurationError

    mode = "exact" if settings.mode in ("auto", "exact") else settings.mode
    if settings.gpus is not None and len(settings.gpus) > 1 and not settings.allow_unrun_modes:
        raise _unrun(
            f"--gpus {','.join(map(str, settings.gpus))}: the layer split over several GPUs "
            "(docs/multi-gpu.md)",
            "Name one GPU, or run one replica per GPU behind a router (docs/fleet.md).",
        )
    if mode in UNRUN_MODES and not settings.allow_unrun_modes:
        raise _unrun(f"--mode {mode}: {UNRUN_MODES[mode]}", "Use --mode exact.")
    _refuse_layer_major(settings, mode)
    if mode == "nvme-exact":
        return _create_nvme_exact(settings, checkpoint_dir)
    if mode == "fast":
        return _create_fast(settings, checkpoint_dir)
    if mode == "nvme":
        return _create_nvme(settings, checkpoint_dir)
    if mode not in SERVED_MODES:
        raise ConfigurationError(
            f"--mode {settings.mode}: this build's GPU engine serves exact mode only (VRAM cache + "
            "pinned RAM, bit-identical to stock exllamav3); use --mode exact (or --mode "
            "nvme-exact / fast / nvme with --allow-unrun-modes, not yet run on a GPU)."
        )
    if settings.store:
        raise ConfigurationError(
            f"--store {settings.store}: exact mode keeps every routed expert in pinned RAM and "
            "does not read a store; leave --store out"
        )
    _refuse_chunk(settings)
    return GpuEngine(
        str(checkpoint_dir),
        mode,
        ec_stage_gb=settings.ec_stage_gb,
        **_common(settings),
        prefill=settings.prefill,
    )


def _create_fast(settings, checkpoint_dir) -> GpuEngine:
    """fast under --allow-unrun-modes: exact mode's settings plus the lane's (--cpus,
    --cpu-threads, --ct-precision: auto is fast here) and --ct-b for the router. The lane's
    CPUs are resolved now, so a bad --cpus is refused before anything loads."""
    from glm53.config import ConfigurationError
    from glm53.tiers.cpu_lane import LaneConfigError, lane_layout, lane_precision

    if settings.store:
        raise ConfigurationError(
            f"--store {settings.store}: fast mode keeps every routed expert in pinned RAM, as "
            "exact mode does, and does not read a store; leave --store out"
        )
    _refuse_split(settings, "fast mode")
    _refuse_chunk(settings)
    try:
        lane_layout(settings.cpus, settings.cpu_threads)
        precision = lane_precision(settings.ct_precision, "gpu", "fast")
    except LaneConfigError as exc:
        raise ConfigurationError(str(exc)) from None
    return GpuEngine(
        str(checkpoint_dir),
        "fast",
        ec_stage_gb=settings.ec_stage_gb,
        lane_cpus=settings.cpus,
        lane_threads=settings.cpu_threads,
        lane_precision=precision,
        ct_b=settings.ct_b,
        **_common(settings),
    )


def _create_nvme_exact(settings, checkpoint_dir) -> GpuEngine:
    """nvme-exact under --allow-unrun-modes: exact mode's settings (no prefill staging) plus the
    store, --ram-cap and the read timeout (the refusals happen at load, before anything loads)."""
    from glm53.config import ConfigurationError

    if not settings.store:
        raise ConfigurationError(
            "--mode nvme-exact reads the routed experts from a packed store: pass --store DIR "
            "(`glm53 store pack`)"
        )
    _refuse_split(settings, "nvme-exact")
    return GpuEngine(
        str(checkpoint_dir),
        "nvme-exact",
        store=settings.store,
        ram_cap=settings.ram_cap,
        read_timeout_s=settings.read_timeout,
        **_common(settings),
    )


# --- nvme mode (nvme-exact + the CPU lane over the RAM tier), kept in one function ------------


def _create_nvme(settings, checkpoint_dir) -> GpuEngine:
    """nvme under --allow-unrun-modes (it has not run on a GPU): nvme-exact's settings (--store,
    --ram-cap, the read timeout; no prefill staging) plus the lane's as fast mode takes them
    (--cpus, --cpu-threads, --ct-precision: auto is fast here, --ct-b). The lane's CPUs are
    resolved now, so a bad --cpus is refused before anything loads."""
    from glm53.config import ConfigurationError
    from glm53.tiers.cpu_lane import LaneConfigError, lane_layout, lane_precision

    if not settings.allow_unrun_modes:  # whatever the mode table says: nvme never ran
        raise _unrun(f"--mode nvme: {UNRUN_MODES['nvme']}", "Use --mode exact.")
    if not settings.store:
        raise ConfigurationError(
            "--mode nvme reads the routed experts from a packed store: pass --store DIR "
            "(`glm53 store pack`)"
        )
    _refuse_split(settings, "nvme mode")
    _refuse_chunk(settings)
    try:
        lane_layout(settings.cpus, settings.cpu_threads)
        precision = lane_precision(settings.ct_precision, "gpu", "nvme")
    except LaneConfigError as exc:
        raise ConfigurationError(str(exc)) from None
    return GpuEngine(
        str(checkpoint_dir),
        "nvme",
        store=settings.store,
        ram_cap=settings.ram_cap,
        read_timeout_s=settings.read_timeout,
        lane_cpus=settings.cpus,
        lane_threads=settings.cpu_threads,
        lane_precision=precision,
        ct_b=settings.ct_b,
        **_common(settings),
    )
