"""Engines and the scheduler. `create_engine` is the one place that picks an engine.

Each engine module (glm53.engine.cpu, glm53.engine.gpu) exposes
`create(settings: Settings, checkpoint_dir: Path) -> Engine`; creating is cheap, `Engine.load`
does the heavy work on the engine thread.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from glm53.config import ConfigurationError, Settings, cache_dir
from glm53.engine.base import Engine, EngineError, EngineUnavailable, StreamWork, Tokenizer
from glm53.exl3.version import installed_version, version_problem
from glm53.modes import lane_runs_beside_gpu, rule

__all__ = [
    "Engine",
    "EngineError",
    "EngineUnavailable",
    "StreamWork",
    "Tokenizer",
    "checkpoint_dir",
    "create_engine",
    "engine_kind",
    "refuse_unservable",
    "uses_demo",
]

log = logging.getLogger("glm53.engine")


def uses_demo(settings: Settings) -> bool:
    return settings.demo or not settings.model


def demo_dir(settings: Settings) -> Path:
    return cache_dir(settings) / "demo-checkpoint"


def checkpoint_dir(settings: Settings) -> Path:
    """The checkpoint to serve: --model, or the demo checkpoint (written on first use; slow the
    first time, so call this off the event loop)."""
    if not uses_demo(settings):
        path = Path(settings.model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigurationError(
                f"--model {settings.model}: no config.json there; point --model at a checkpoint "
                "directory (or leave it out to serve the demo checkpoint)"
            )
        return path
    path = demo_dir(settings)
    if (path / "config.json").is_file():
        return path
    from glm53.synth.shapes import preset
    from glm53.synth.writer import write_checkpoint

    log.info("writing the demo checkpoint to %s (first use)", path)
    # Written next to its final place and renamed, so an interrupted write never looks complete.
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    write_checkpoint(preset("demo"), partial, seed=0)
    try:
        os.replace(partial, path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # another process finished first
    return path


def _num_cuda_devices() -> int:
    """CUDA devices, counted without torch's lazy CUDA init: `glm53 serve` asks in granian's
    main process, which then forks the worker, and torch.cuda.is_available() would initialize
    CUDA there, after which the forked worker cannot (on an H200, torch 2.11: "Cannot re-initialize CUDA in
    forked subprocess"; device_count() left the worker able to)."""
    import torch

    return torch.cuda.device_count()


def engine_kind(settings: Settings) -> str:
    """cpu, gpu or scripted: --engine, where auto means gpu for a real checkpoint on a CUDA host."""
    if settings.engine != "auto":
        return settings.engine
    return "gpu" if not uses_demo(settings) and _num_cuda_devices() > 0 else "cpu"


# Settings of parts that this build does not have yet: accepted by the parser (the doctor's
# plans and the systemd unit name them), refused at start when changed from their defaults, so
# that a value never silently does nothing.
NOT_BUILT = {
    "ct_swz": (
        "--ct-swz",
        "a swizzled second copy of the experts: it doubles their RAM and was not measured to pay",
    ),
    "triton_pin": ("--triton-pin", "pinned Triton kernel configurations"),
    "ec_elastic_gb": ("--ec-elastic-gb", "lending part of the VRAM expert cache to prefill"),
}


def refuse_unbuilt(settings: Settings) -> None:
    """ConfigurationError naming every setting changed from its default whose part is not built."""
    defaults = Settings()
    changed = [
        f"{flag} ({what})"
        for name, (flag, what) in NOT_BUILT.items()
        if getattr(settings, name) != getattr(defaults, name)
    ]
    if changed:
        raise ConfigurationError(
            f"{', '.join(changed)}: not in this build of glm53, so the value would do nothing; "
            "leave it out (and its GLM53_* variable unset)"
        )


def refuse_ct_b(settings: Settings, kind: str) -> None:
    """--ct-b pins fast mode's router (the GPU engine's lane modes, glm53.modes); anywhere else
    nothing reads it, so a value is refused rather than ignored."""
    if settings.ct_b is None or lane_runs_beside_gpu(kind, settings.mode):
        return
    raise ConfigurationError(
        f"--ct-b {settings.ct_b}: it pins the CPU lane's ms per expert for fast mode's router, "
        f"which only the GPU engine's --mode fast has; the {kind} engine in mode "
        f"{settings.mode} would ignore it. Leave --ct-b (GLM53_CT_B) out, or serve "
        "--engine gpu --mode fast"
    )


def refuse_layer_major_off_gpu(settings: Settings, kind: str) -> None:
    """--prefill layer-major is the GPU engine's (glm53.exl3.layer_major); the other
    engines would prefill chunk by chunk whatever it says, so a value is refused."""
    if settings.prefill == "chunk" or kind == "gpu":
        return
    raise ConfigurationError(
        f"--prefill {settings.prefill}: only the GPU engine (exact, nvme-exact and nvme mode) "
        "prefills layer-major; "
        f"the {kind} engine would ignore it. Leave --prefill (GLM53_PREFILL) out"
    )


def refuse_prefetch_off_gpu(settings: Settings, kind: str) -> None:
    """--nvme-prefetch is the GPU engine's (glm53.tiers.decode_prefetch, driven by its routing
    hook); the other engines would ignore it, so a value is refused."""
    if settings.nvme_prefetch == "off" or kind == "gpu":
        return
    raise ConfigurationError(
        f"--nvme-prefetch {settings.nvme_prefetch}: only the GPU engine (--mode nvme-exact or "
        f"nvme) prefetches decode picks from the store; the {kind} engine would ignore it. "
        "Leave --nvme-prefetch (GLM53_NVME_PREFETCH) out"
    )


def _refuse_gpus_off_gpu(settings: Settings, kind: str) -> None:
    if settings.gpus is not None and kind != "gpu":
        raise ConfigurationError(
            f"--gpus {','.join(map(str, settings.gpus))}: the {kind} engine runs on no GPU, so "
            "the split would do nothing; leave --gpus (GLM53_GPUS) out, or serve a real "
            "checkpoint with --engine gpu"
        )


def _gpu_host_problems(num_devices: int) -> list[str]:
    """Why this host, with `num_devices` CUDA devices, cannot run the GPU engine (empty when it
    can). exllamav3 is looked up, not imported: importing it on a host without CUDA fails inside
    its extension build."""
    import torch

    problems = []
    if num_devices == 0:
        if torch.version.cuda is None:
            problems.append(f"this torch ({torch.__version__}) is a CPU build")
        else:
            problems.append(f"torch {torch.__version__} sees no CUDA device")
    # the one pin, glm53.exl3.version.EXLLAMAV3_VERSION (also read by `glm53 doctor`)
    found = installed_version() if importlib.util.find_spec("exllamav3") is not None else None
    problem = version_problem(found)
    if problem is not None:
        problems.append(problem)
    return problems


def _refuse_nvme_exact_store(settings: Settings) -> None:
    """The store of nvme-exact and nvme, checked as their load checks it
    (glm53.tiers.gpu_home.open_home_source: a store of another checkpoint, a --ram-cap below one
    layer's picks) and closed again: these are mistakes in the settings, refused with their own
    fix whatever the host (torch-free)."""
    if rule("gpu", settings.mode).store != "needs":
        return
    if not settings.store or uses_demo(settings):
        return
    from glm53.store.errors import StoreError
    from glm53.tiers.gpu_home import open_home_source
    from glm53.tiers.ram_tier import TierError

    rows = max(settings.chunk_size, settings.max_batch)
    try:
        store, _, _ = open_home_source(
            checkpoint_dir(settings), settings.store, settings.ram_cap, rows
        )
    except (StoreError, TierError) as exc:
        raise ConfigurationError(f"--mode {settings.mode}: {exc}") from None
    store.close()


def refuse_unservable(settings: Settings) -> None:
    """Before the server binds its port: ConfigurationError, one line with the fix, when the
    engine these settings pick cannot run on this host (the GPU engine without a CUDA device or
    without exllamav3, --gpus naming a device that is not there, --gpus off the GPU engine)."""
    kind = engine_kind(settings)
    _refuse_gpus_off_gpu(settings, kind)
    if kind != "gpu":
        return
    _refuse_nvme_exact_store(settings)
    num_devices = _num_cuda_devices()
    problems = _gpu_host_problems(num_devices)
    if problems:
        if any("exllamav3" not in p for p in problems):
            fix = (
                "run `glm53 serve --engine cpu` instead (`glm53 serve --demo` for the demo "
                "checkpoint), or see docs/install.md to set up a GPU host"
            )
        else:
            fix = "install it with `pip install 'glm53[gpu]'`, or serve with --engine cpu"
        raise ConfigurationError(f"--engine gpu: {' and '.join(problems)}; {fix}")
    absent = [g for g in settings.gpus or () if g >= num_devices]
    if absent:
        raise ConfigurationError(
            f"--gpus {','.join(map(str, settings.gpus))}: this host has {num_devices} CUDA "
            f"device(s), numbered 0 to {num_devices - 1}, so {','.join(map(str, absent))} "
            "is not there; name devices that nvidia-smi lists"
        )


def create_engine(settings: Settings) -> Engine:
    """The engine the settings ask for (not loaded); never another one in its place."""
    refuse_unbuilt(settings)
    kind = engine_kind(settings)
    refuse_ct_b(settings, kind)
    refuse_layer_major_off_gpu(settings, kind)
    refuse_prefetch_off_gpu(settings, kind)
    _refuse_gpus_off_gpu(settings, kind)
    if kind == "scripted":
        from glm53.engine.scripted import ScriptedEngine, read_script

        if not settings.script:
            raise ConfigurationError(
                "--engine scripted needs --script FILE (see glm53/engine/scripted.py)"
            )
        return ScriptedEngine(
            checkpoint_dir(settings),
            read_script(settings.script),
            context_length=settings.context,
            num_slots=settings.max_batch,
        )
    if kind == "cpu":  # imported when picked: the CPU engine's module imports torch
        from glm53.engine.cpu import create
    else:
        from glm53.engine.gpu_create import create
    return create(settings, checkpoint_dir(settings))
