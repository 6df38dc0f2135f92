"""The GPU engine's tier modes beyond exact (glm53.engine.gpu.GpuEngine calls these): the CPU lane
of fast and nvme mode, nvme-exact's warm start and tier check, and the nvme modes' iteration with
read faults isolated to the requests that needed the record (glm53.tiers.read_faults).

Modes: fast = exact's tiers + the lane (glm53.tiers.fast_lane); nvme-exact = the RAM tier over
--store as the experts' home (glm53.tiers.gpu_home); nvme = nvme-exact + the same lane over the
RAM tier (glm53.tiers.nvme_lane; its GPU tests passed on an H200, 2026-12-05). Which load each
mode takes is glm53.modes' table (EngineOptions.load).
"""

from __future__ import annotations

import logging

from glm53 import exl3
from glm53.engine.base import FinishReason, JobOutput

log = logging.getLogger("glm53.engine.gpu")


def start_lane(engine) -> None:
    """fast or nvme: the CPU lane (over the pinned home, or in nvme
    mode over the RAM tier), the hooks and the router (glm53.exl3.fast, glm53.tiers.fast_lane).
    The lane's settings are engine.options' (--cpus, --cpu-threads, --ct-precision, --ct-b)."""
    from glm53.tiers.cpu_lane import CpuLane, device_pci_address, lane_layout

    o = engine.options
    layout = lane_layout(o.lane_cpus, o.lane_threads, device_pci_address(engine.device))
    cpu = CpuLane(layout, precision=o.lane_precision)
    engine.fast = exl3.start_fast(engine.loaded, engine.model_dir, cpu, ct_b=o.ct_b)
    log.info("%s mode: %s", engine.mode, cpu.describe())


def start_nvme(engine) -> None:
    """nvme-exact (and nvme): warm start (the RAM tier's heat list, then the VRAM cache's among
    the keys now in RAM), then the tier check; a bad count refuses to serve. /admin/verify
    repeats the check (engine.verify_tiers, set in the nvme modes only)."""
    from glm53.engine.base import EngineUnavailable
    from glm53.tiers.heat import heat_path, read_heat

    nvme = engine.loaded.nvme
    engine.ram_heat_file = heat_path(
        engine.model_dir, "ram", engine.store, cache_dir=engine.cache_dir
    )
    ram = read_heat(engine.ram_heat_file, nvme.tier.num_keys)
    if ram and nvme.tier.clock.n_used:
        # exllamav3's warm-up (--warmup) ran real forwards, which read experts into the RAM tier:
        # a tier in use is not seeded (RamTier.seed), so its heat list waits for the next start
        log.warning(
            "the warm-up read %d experts into the RAM tier, so its heat list %s is not used "
            "this start (it is rewritten at shutdown)", nvme.tier.clock.n_used,
            engine.ram_heat_file,
        )  # fmt: skip
        ram = []
    warm = nvme.warm_start(ram, read_heat(engine.heat_file, nvme.ec.num_keys))
    log.info("nvme warm start: %s", warm)
    engine.verify_tiers = engine._verify_nvme
    result = engine.verify_tiers(64)
    (log.info if result.is_ok else log.error)("tier check at start: %s", result.summary())
    if not result.is_ok:  # closed without writing heat lists of tiers that failed
        engine.generator.close()
        engine.generator = None
        engine.loaded.close()
        engine.loaded = None
        raise EngineUnavailable(
            f"the tier check at start failed, so glm53 does not serve: {result.summary()}; "
            f"check the store with `glm53 store verify --store {engine.store}` and repack it"
        )


def iterate_nvme(engine, generator, nvme) -> tuple[list, dict]:
    """One Generator iteration under the tiers' lock, with decode read faults isolated: the
    routing hook reads each decode row's job key (exl3.decode_row_keys) when a read fails.
    A job exllamav3 reaped for a read fault in its prefill gets the same error text (layer,
    expert, cause, the store check). Returns (exllamav3's results, key -> error for each job a
    decode read fault fails)."""
    from glm53.tiers.ram_tier import ReadFault
    from glm53.tiers.read_faults import fault_message, fault_record, jobs_to_fail

    with nvme.lock:
        nvme.row_keys = lambda: exl3.decode_row_keys(generator)
        try:
            results = generator.iterate()
            nvme.check_table_bad()
        finally:
            nvme.row_keys = None
            nvme.end_forward()  # a decode prefetch wave left over: collected, unpinned
            faults = nvme.take_faults()
    for r in results:
        if r.get("stage") == "error" and isinstance(r.get("error"), ReadFault):
            r["error"] = fault_message(fault_record(r["error"], None), engine.store)
    return results, jobs_to_fail(faults, engine.store)


def step_layer_major_nvme(engine, nvme) -> dict:
    """A layer-major pass's next module in a store mode (glm53.exl3.layer_major), under the
    tiers' lock as a Generator iteration is: its hooks resolve each chunk's picks in the RAM
    tier. A store read fault there fails the pass's job alone, with the fault's message (the
    prompt being prefilled is the only one whose picks needed the record): the pass is dropped
    when fail_jobs cancels the job, and the other jobs decode on. Returns key -> error (empty
    when the step ran)."""
    from glm53.tiers.ram_tier import ReadFault
    from glm53.tiers.read_faults import fault_message, fault_record

    lm = engine.layer_major
    active = lm.active
    with nvme.lock:
        try:
            lm.step()
            nvme.check_table_bad()
        except ReadFault as exc:
            if active is None:
                raise
            # the job's key is its identifier (exl3.generator.make_job), as decode faults find it
            key = active.job.identifier
            return {key: fault_message(fault_record(exc, None), engine.store)}
    return {}


def fail_jobs(engine, outs: dict, failed: dict) -> None:
    """Fail each job a read fault named: its tokens of this step (computed without the expert)
    are dropped, exllamav3 cancels it, and it ends with the fault's error; no other job is
    touched."""
    for key, error in failed.items():
        if key in engine._jobs:
            engine.cancel(key)
        elif key not in outs:  # not a job of this step any more: nothing to fail
            continue
        # a job that also ended this step (its last token computed without the expert) fails too
        outs[key] = JobOutput(key, [], finish=FinishReason.ERROR, error=error)
