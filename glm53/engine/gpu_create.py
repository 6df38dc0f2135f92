"""The GPU engine for a glm53 Settings (`create`): `engine_options` turns the Settings into the
engine's EngineOptions, once, before anything loads (what each mode serves and needs is
glm53.modes' table; the checks of a value alone live in EngineOptions and LoadOptions). Here
are the checks that need the Settings themselves: --allow-unrun-modes for what has not yet passed
its GPU tests (glm53.modes.UNRUN: the split over two or more distinct GPUs and the staging loan
in fast mode, refused without it; the store modes' layer-major pass staging, which the flag turns
on: EngineOptions.store_pass_staging; UNRUN_STATUS says where each stands), and the CPU lane's
settings in a lane mode.
Creating is cheap; GpuEngine.load does the heavy work (glm53.engine.gpu).
"""

from __future__ import annotations

from glm53.config import ConfigurationError, Settings, cache_dir
from glm53.engine.gpu import GpuEngine
from glm53.engine.gpu_options import EngineOptions
from glm53.modes import UNRUN, UNRUN_STATUS, Mode, resolved, rule, served

# The tier modes this build's GPU engine serves (glm53.modes' table; the doctor recommends
# glm53.modes.recommended("gpu"): those not gated by UNRUN).
SERVED_MODES = served("gpu")


def _unrun(key: str, setting: str, instead: str) -> ConfigurationError:
    """The refusal of UNRUN[key], asked for by `setting` ("" where UNRUN[key] names it)."""
    return ConfigurationError(
        f"{setting}{UNRUN[key]} {UNRUN_STATUS[key]}, so serve refuses it; "
        f"--allow-unrun-modes runs it anyway (for its GPU tests). {instead}"
    )


def _refuse_unrun(settings: Settings) -> None:
    """What has not yet passed its GPU tests (glm53.modes.UNRUN) runs only with
    --allow-unrun-modes."""
    if settings.allow_unrun_modes:
        return
    gpus, r = settings.gpus, rule("gpu", settings.mode)
    # a mode that runs on one GPU only is refused as such (EngineOptions), flag or not; the
    # split with every entry on one device (0,0) passed its GPU tests, over two or more
    # distinct devices it has not run
    if gpus is not None and len(set(gpus)) > 1 and r.served and not r.one_gpu:
        raise _unrun(
            "split",
            f"--gpus {','.join(map(str, gpus))}: ",
            "Name one GPU (or one GPU more than once, as 0,0), or run one replica per GPU "
            "behind a router (docs/fleet.md). The flag is needed for two or more distinct GPUs.",
        )
    # the loan outside exact's one-GPU load is refused as such (LoadOptions), flag or not; in
    # exact mode it passed its GPU tests, beside fast mode's lane it has not run
    if settings.ec_stage_loan and resolved("gpu", settings.mode) is Mode.FAST:
        raise _unrun("stage-loan", "--ec-stage-loan in --mode fast: ", "Leave --ec-stage-loan out.")


def _lane_precision(settings: Settings) -> str:
    """A lane mode's CPU lane (--cpus, --cpu-threads; --ct-precision, where auto is fast beside
    the GPU), resolved now, so that a bad --cpus is refused before anything loads."""
    from glm53.tiers.cpu_lane import LaneConfigError, lane_layout, lane_precision

    try:
        lane_layout(settings.cpus, settings.cpu_threads)
        return lane_precision(settings.ct_precision, "gpu", settings.mode)
    except LaneConfigError as exc:
        raise ConfigurationError(str(exc)) from None


def engine_options(settings: Settings) -> EngineOptions:
    """The GpuEngine's options for these Settings, every value checked once."""
    _refuse_unrun(settings)
    lane = rule("gpu", settings.mode).served and rule("gpu", settings.mode).lane
    lane_kw = {}
    if lane:
        lane_kw = dict(
            lane_cpus=settings.cpus, lane_threads=settings.cpu_threads,
            lane_precision=_lane_precision(settings), ct_b=settings.ct_b,
        )  # fmt: skip
    return EngineOptions(
        mode=settings.mode,
        context=settings.context,
        max_batch=settings.max_batch,
        chunk_size=settings.chunk_size,
        ec_max_slots=settings.ec_max_slots,
        ec_reserve_gb=settings.ec_reserve_gb,
        ec_stage_gb=settings.ec_stage_gb,
        ec_freq_window=settings.ec_freq_window,
        ec_stage_loan=settings.ec_stage_loan,
        vram_budget=settings.vram_budget,
        warmup=settings.warmup,
        gpus=settings.gpus,
        store=settings.store,
        ram_cap=settings.ram_cap,
        read_timeout_s=settings.read_timeout,
        nvme_prefetch=settings.nvme_prefetch,
        prefill=settings.prefill,
        store_pass_staging=settings.allow_unrun_modes,
        cache_dir=str(cache_dir(settings)),
        **lane_kw,
    )


def create(settings: Settings, checkpoint_dir) -> GpuEngine:
    """The GPU engine for these Settings (not loaded)."""
    return GpuEngine(str(checkpoint_dir), engine_options(settings))
