"""Loading a glm5_next EXL3 checkpoint into stock exllamav3 1.6.5, four ways:

- `stock`:      exllamav3 as shipped, every routed expert in VRAM (the ceiling, and the
                reference that exact mode must match bit for bit);
- `zerocopy`:   routed experts' trellis in pinned host memory, read over PCIe by the MoE
                kernels, no cache (the floor);
- `exact`:      the same pinned home plus the device-side CLOCK cache in VRAM;
- `nvme-exact`: the same cache, with the RAM tier (--ram-cap, filled from the packed --store
                with O_DIRECT) as the experts' home (glm53.exl3.nvme_device).

What to load is a glm53.exl3.options.LoadOptions, checked when it was built.
"""

from __future__ import annotations

import gc
import json
import logging
import os

from glm53.exl3 import hooks
from glm53.exl3.errors import Exl3Refused
from glm53.exl3.loaded import (
    Loaded,
    MoeGeometry,
    VramUse,
    check_tables_point_home,
    moe_geometry,
)
from glm53.exl3.options import LoadOptions
from glm53.exl3.version import check_version
from glm53.plan.vram import (
    VramInputs,
    VramPlan,
    cache_geometry,
    chunk_activation_bytes,
    plan_vram,
    staging_slots,
)
from glm53.units import GIB

log = logging.getLogger(__name__)


def vram_use(device) -> VramUse:
    import torch

    return VramUse(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device))


def held_vram_bytes(before: VramUse, after: VramUse) -> tuple[int, int] | None:
    """(resident, peak): the VRAM a load holds after it, and the most it held during it, over
    what was allocated before it. Live tensors, not free memory: the driver's free count
    (mem_get_info) also moves with the allocator's cached blocks and whatever else frees or
    allocates meanwhile, and came out at -6.2 GB for a fast-mode load (issue #26). A negative
    count means tensors allocated before the load were freed during it, so the count would not
    be the load's: None then (the caller says so; a statistic never fails a load)."""
    resident, peak = after.allocated - before.allocated, after.peak - before.allocated
    if resident < 0:
        return None
    return resident, max(peak, resident)


def vram_plan_for(
    model_dir: str,
    geo: MoeGeometry,
    vram_budget: int,
    cache_tokens: int,
    max_batch: int,
    max_chunk: int,
    ec_reserve_gb: float = 1.0,
    ec_stage_gb: float | None = None,
    ec_max_slots: int | None = None,
) -> VramPlan:
    """glm53.plan.vram.plan_vram for a checkpoint (its config and safetensors geometry) and load()'s cache
    and chunk sizes. `ec_max_slots` (--ec-max-slots) caps the cache, so that the plan's cache and
    free bytes are the load's."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        text_config = json.load(f)["text_config"]
    kv_per_token, state_per_sequence = cache_geometry(text_config)
    return plan_vram(
        VramInputs(
            budget_bytes=vram_budget,
            model_bytes=geo.vram_model_bytes,
            record_bytes=sum(geo.part_bytes),
            num_experts=geo.n_experts,
            num_moe_layers=len(geo.moe_layers),
            kv_bytes_per_token=kv_per_token,
            context_tokens=cache_tokens,
            state_bytes_per_sequence=state_per_sequence,
            batch=max_batch,
            activation_bytes=chunk_activation_bytes(text_config, max_chunk),
            reserve_bytes=int(ec_reserve_gb * GIB),
            stage_gb=ec_stage_gb,
            max_slots=ec_max_slots,
        )
    )


def load(model_dir: str, options: LoadOptions | None = None) -> Loaded:
    """Load model_dir as `options` (glm53.exl3.options.LoadOptions, checked when built; None:
    every default) say. A vram_budget plans exact mode's expert cache and staging with
    plan_vram, as on a card with that much free, so that a small card can be emulated on a large
    one. Two or more `gpus` split the layers over them (glm53.exl3.split)."""
    import torch

    o = options if options is not None else LoadOptions()
    mode, max_chunk, max_batch = o.mode, o.max_chunk, o.max_batch
    cache_tokens, vram_budget, ec_reserve_gb = o.cache_tokens, o.vram_budget, o.ec_reserve_gb
    ec_stage_gb = o.ec_stage_gb
    if o.is_split:
        from glm53.exl3.split import load_split

        return load_split(
            model_dir, mode, list(o.gpus), cache_tokens=cache_tokens, max_batch=max_batch,
            max_chunk=max_chunk, ec_max_slots=o.ec_max_slots, ec_reserve_gb=ec_reserve_gb,
            ec_stage_gb=ec_stage_gb, ec_freq_window=o.ec_freq_window,
            stage_min_rows=o.stage_min_rows, stage_dma=o.stage_dma,
            allow_unsupported=o.allow_unsupported, vram_budget=vram_budget,
        )  # fmt: skip
    nvme_src = None
    if mode == "nvme-exact":  # refusals (store, fingerprint, --ram-cap) before anything loads
        from glm53.tiers.gpu_home import open_home_source

        if o.stage_dma:
            raise Exl3Refused(
                "--stage-dma copies each MoE layer's home arena in one transfer; in nvme-exact "
                "the homes are RAM-tier slots in no layer order: leave --stage-dma unset (the "
                "stage gathers the records), or --ec-stage-gb 0 to turn staging off"
            )
        nvme_src = open_home_source(model_dir, o.store, o.ram_cap, rows=o.rows)
        # prefill staging is on as in exact mode (--ec-stage-gb; 0 turns it off): the waves of
        # glm53.tiers.prefill_ahead read each layer into the RAM tier ahead of its stage
    check_version(o.allow_unsupported)
    hooks.install_hooks()
    from exllamav3 import Cache, Config, Model, Tokenizer

    config = Config.from_directory(model_dir)
    geo = moe_geometry(config.stc)
    if nvme_src is not None:
        _check_store_geometry(nvme_src[0], geo)
    dev = torch.device(o.device)
    # a previous load's tensors held only by reference cycles would be freed while this load
    # runs and make its count negative: collect them first
    gc.collect()
    # the caching allocator's peak is reset below: in a process that has not touched CUDA yet
    # the allocator does not exist and torch raises "Invalid device argument" (H200,
    # 2026-12-05: every in-process load of tests/gpu group a): one allocation creates it
    torch.empty(1, device=dev)
    torch.cuda.reset_peak_memory_stats(dev)
    vram_before = vram_use(dev)
    free, _ = torch.cuda.mem_get_info(dev)
    if vram_budget is not None:
        if vram_budget > free:
            raise Exl3Refused(
                f"--vram-budget {vram_budget / GIB:.2f} GiB is more than the "
                f"{free / GIB:.2f} GiB free on {dev}; pass at most that"
            )
        free = vram_budget
    need = geo.other_bytes + (geo.expert_bytes_total if mode == "stock" else 0)
    if need + ec_reserve_gb * GIB > free:
        raise Exl3Refused(
            f"not enough VRAM on {dev}: {need / GIB:.2f} GiB of weights to place "
            f"({'all experts included' if mode == 'stock' else 'routed experts stay in host RAM'})"
            f" + {ec_reserve_gb:.2f} GiB reserve > {free / GIB:.2f} GiB "
            f"{'free' if vram_budget is None else 'budget (--vram-budget)'}: lower "
            "--ec-reserve-gb, free the GPU of other processes, or use a GPU with more VRAM"
        )
    plan = None
    if vram_budget is not None and mode in ("exact", "nvme-exact"):
        plan = vram_plan_for(
            model_dir, geo, vram_budget, cache_tokens, max_batch, max_chunk, ec_reserve_gb,
            ec_stage_gb, o.ec_max_slots,
        )  # fmt: skip
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=cache_tokens, max_batch_size=max_batch)
    home = None
    if mode != "stock":
        kind = hooks.AbsentExpertHome if nvme_src else hooks.PinnedExpertHome
        home = kind(model_dir, geo.moe_layers, geo.n_experts, geo.part_bytes, dev)
        hooks.register_home(home)
    try:
        model.load(dev, max_chunk_size=max_chunk)
    except Exception:
        if home is not None:
            home.close()
        raise
    finally:
        if home is not None:
            hooks.unregister_home(home)  # only loads go through the hook
    tokenizer = Tokenizer.from_config(config)
    moe = hooks.moe_modules(model)
    loaded = Loaded(mode, config, model, cache, tokenizer, geo, moe, home, vram_plan=plan)
    loaded.vram_before = vram_before
    if mode == "stock":
        return _measured(loaded, dev)

    home_addr = home.home_addresses()
    check_tables_point_home(moe, home_addr, home.geo)
    if mode in ("exact", "nvme-exact"):  # one admission path; nvme-exact moves the home
        from glm53.tiers.vram_cache import DeviceExpertCache

        rb = home.geo.record_bytes
        if plan is None:
            free, _ = torch.cuda.mem_get_info(dev)
            stage_slots = staging_slots(
                free, int(ec_reserve_gb * GIB), home.geo.n_experts, rb, ec_stage_gb
            )
            free -= 2 * stage_slots * rb
            fit = int((free - ec_reserve_gb * GIB) // rb)
        else:
            stage_slots, fit = plan.stage_slots, plan.cache_slots
            free = plan.cache_bytes + plan.free_bytes + plan.reserve_bytes
        slots = o.ec_slots if o.ec_slots is not None else fit
        if o.ec_max_slots is not None:
            slots = min(slots, o.ec_max_slots)
        slots = min(slots, home.geo.n_keys)
        if slots < 1 or slots > fit:
            raise Exl3Refused(
                f"the VRAM expert cache cannot hold {slots} slots of "
                f"{home.geo.record_bytes / 2**20:.1f} MiB: {free / GIB:.2f} GiB free, "
                f"{ec_reserve_gb:.2f} GiB reserved (--ec-reserve-gb) leaves room for {fit}; "
                "lower --ec-reserve-gb, --context or --max-batch"
            )
        if o.stage_loan and stage_slots < 1:
            raise Exl3Refused(
                "--ec-stage-loan lends the prefill staging buffers to the expert cache, but "
                "staging is off here (--ec-stage-gb 0, or too little VRAM for its smallest "
                "buffers): leave --ec-stage-loan out, or give --ec-stage-gb a size"
            )
        # the staging loan (vram_cache.StagingLoan): the buffers are the cache's last slots
        loan_slots = 2 * stage_slots if o.stage_loan else 0
        ec = DeviceExpertCache(
            home.geo, slots + loan_slots, home_addr, hooks.table_addresses(moe), dev,
            freq_window=o.ec_freq_window,
        )  # fmt: skip
        stager = None
        if stage_slots > 0:
            from glm53.tiers.vram_cache import PrefillStager

            dma = False if nvme_src is not None else o.stage_dma  # RAM-tier homes: gathered
            stager = PrefillStager(
                ec, stage_slots, min_rows=o.stage_min_rows, dma=dma, loan=o.stage_loan,
                prefill_layers=hooks.prefill_moe_count(model, moe),
            )  # fmt: skip
        # nvme-exact's stager is driven by its NvmeHome (the routing hook never calls it)
        hooks.attach_cache(moe, ec, stager)
        loaded.ec, loaded.stager = ec, stager
    if nvme_src is not None:
        loaded.nvme = _start_nvme(
            loaded, nvme_src, o.ram_cap, o.read_timeout_s, o.rows, loaded.stager,
            o.nvme_prefetch,
        )  # fmt: skip
        hooks.attach_nvme(moe, loaded.nvme, prefetch=o.nvme_prefetch != "off")
        # prefill and scoring forwards carry NO_LANE: a read fault there fails its one request
        # (raised); in a decode forward it fails only the rows that needed it (read_faults)
        hooks.mark_prefill_exact(loaded.model)
    return _measured(loaded, dev)


def _measured(loaded: Loaded, dev) -> Loaded:
    """The load's VRAM, counted at its very end: the tiers included, and after exllamav3 and
    the home hook have moved the experts out of VRAM."""
    import torch

    torch.cuda.synchronize(dev)
    after = vram_use(dev)
    held = held_vram_bytes(loaded.vram_before, after)
    if held is None:
        log.warning(
            "VRAM accounting: %d bytes were allocated before the load and %d after it; "
            "something freed tensors the load did not allocate while it ran, so its resident "
            "bytes are not known (reported as null)", loaded.vram_before.allocated, after.allocated
        )  # fmt: skip
        held = (None, None)
    loaded.resident_bytes, loaded.load_peak_bytes = held
    return loaded


def _check_store_geometry(store, geo: MoeGeometry) -> None:
    """The store's records must be this checkpoint's experts as exllamav3 lays them out: the
    same MoE layers, experts per layer and trellis sizes (the fingerprint already matched)."""
    from glm53.store.errors import StoreMismatchError
    from glm53.tiers.vram_cache import CacheGeometry

    m = store.manifest
    want = CacheGeometry(len(geo.moe_layers), geo.n_experts, geo.part_bytes)
    got = (store.moe_layers, store.num_experts, tuple(m.trellis_bytes), m.slot_bytes)
    have = (geo.moe_layers, geo.n_experts, tuple(geo.part_bytes), want.record_bytes)
    if got != have:
        raise StoreMismatchError(
            f"the store {store.store_dir} holds MoE layers {got[0]}, {got[1]} experts, trellis "
            f"{got[2]} bytes in slots of {got[3]}; exllamav3 loads {have[0]}, {have[1]}, "
            f"{have[2]} in {have[3]}: repack the store from this checkpoint"
        )


def _start_nvme(loaded: Loaded, nvme_src, ram_cap, read_timeout_s, rows, stager=None,
                prefetch="off"):  # fmt: skip
    """The RAM tier (planned from free memory when --ram-cap is not set), registered with CUDA
    as the experts' home (glm53.exl3.nvme_device.NvmeHome), with prefill staging when a
    stager was planned (glm53.tiers.prefill_ahead) and decode prefetch when asked
    (glm53.tiers.decode_prefetch)."""
    from glm53.exl3.nvme_device import NvmeHome
    from glm53.plan.host_memory import host_memory
    from glm53.plan.ram_cap import planned_cap_bytes
    from glm53.tiers.gpu_home import check_home_cap
    from glm53.tiers.ram_tier import RamTier

    source, working_set, top_k = nvme_src
    cap = ram_cap
    num_records = len(source.moe_layers) * source.num_experts
    if cap is None:
        cap = planned_cap_bytes(host_memory(), source.record_bytes, num_records)
        check_home_cap(cap, source.record_bytes, working_set, top_k, rows)
    limit = hooks.memlock_limit()
    if 0 <= limit < min(cap, num_records * source.record_bytes):
        raise Exl3Refused(
            f"the locked-memory limit is {limit} bytes, but pinning the RAM tier (--ram-cap) "
            f"needs {cap}: raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity in the "
            "systemd unit) or lower --ram-cap"
        )
    return NvmeHome(loaded.ec, RamTier(source, cap, read_timeout_s), loaded.home.address,
                    loaded.ec.device, stager=stager, working_set=working_set,
                    prefetch=prefetch)  # fmt: skip


def heat_path(model_dir: str, cache_dir: str | None = None) -> str:
    """Where the VRAM cache's warm-start heat list of a checkpoint lives (glm53.tiers.heat), under
    glm53's cache directory (None: the default one)."""
    from glm53.tiers.heat import heat_path as path

    return path(model_dir, "vram", cache_dir=cache_dir)
