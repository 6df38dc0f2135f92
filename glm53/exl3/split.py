"""Loading a glm5_next EXL3 checkpoint split over two or more `--gpus` entries (issue #20).

RUN ONLY ON ONE GPU, NEVER OVER TWO DISTINCT DEVICES: written against exllamav3 1.6.5's loader
as read (each module loads on a device of its own; `Module.prepare_for_device` moves the hidden
state to it; cache layers allocate on their attention module's device). On an H200 and on an
H100 on 2026-12-05, tests/gpu/test_multi_gpu.py ran it as `--gpus 0,0` (both layer ranges on
that one GPU, this code path): equal to one GPU and to stock exllamav3, in-process and through
the server. Its two-device case was skipped both times (one GPU), and bench/multi_gpu.py has not
run. With every entry on one device (0,0) it is served without a flag; over two or more distinct
devices only with --allow-unrun-modes (glm53.modes.UNRUN["split"]).

How it loads. The plan (glm53.plan.split.plan_split, from each device's free VRAM or --vram-budget
per device) gives each entry a contiguous layer range. exllamav3's own `Model.load(device)` then
runs as on one GPU (its gc freeze, deferred loads with per-device slab arenas, free_mem, the
shared-tensor release and marking the cache initialized all stay exllamav3's), except that each
top-level module's `load` is shadowed, on that instance only and for the duration of the load,
by one that passes its part's device instead (`planned_devices`); a module that prefers host
memory (the embedding) still gets the CPU. The final norm, hc_head and lm_head go with the last
part. exllamav3's autosplit (`use_per_device`) is not used: it cuts where a measuring forward
runs out of memory, not where the plan says. With `--gpus 0,0` every module gets GPU 0: the
exllamav3 load is then the one-GPU load itself.

The experts. The one PinnedExpertHome (pinned, portable, mapped; glm53.exl3.hooks) takes
every routed expert's trellis, whatever device its module is on; each module's pointer tables
get the home's UVA addresses, which every device can read, so there is no second copy in RAM.
Each part with MoE layers gets its own DeviceExpertCache (and PrefillStager) on its device over
its layers' home records and tables; every call into it runs under `torch.cuda.device` of that
device, because glm53's kernels launch on the current device. `--gpus 0,0` runs all of this
with both parts on GPU 0 (exllamav3 then places every module on GPU 0, as one GPU does).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence

from glm53.exl3 import hooks
from glm53.exl3.errors import Exl3Refused, UnsupportedCheckpoint
from glm53.exl3.loaded import Loaded, check_tables_point_home, moe_geometry
from glm53.exl3.patches import assign, shadow, unshadow
from glm53.exl3.version import check_version
from glm53.plan.split import SplitPlan, model_layers, plan_split, split_in_proportion, split_inputs
from glm53.units import GIB

LAYER_MODULE = re.compile(r"\.layers\.(\d+)$")


class OnDevice:
    """A DeviceExpertCache or PrefillStager whose hook-side calls (route, on_layer) run with
    its device current; the rest of it is reached through `inner`."""

    def __init__(self, inner, device):
        self.inner, self.device = inner, device
        self.min_rows = getattr(inner, "min_rows", None)

    def route(self, layer, selected, admit=True):
        import torch

        with torch.cuda.device(self.device):
            self.inner.route(layer, selected, admit=admit)

    def on_layer(self, layer):
        import torch

        with torch.cuda.device(self.device):
            self.inner.on_layer(layer)


class SplitCaches:
    """The per-part VRAM caches seen as one, with the one-GPU cache's interface where the
    engine uses it (state, seed, heat_list). Keys are global (MoE layer index x experts + expert,
    over all MoE layers in order); each part's cache numbers its own layers from 0. `guard(device)`
    is entered around every call into a part (torch.cuda.device on the GPU: glm53's kernels
    launch on the current device)."""

    def __init__(
        self,
        plan: SplitPlan,
        caches: Sequence,
        num_experts: int,
        guard: Callable[[object], contextlib.AbstractContextManager] | None = None,
    ):
        if len(caches) != len(plan.parts):
            raise ValueError(f"{len(caches)} caches for {len(plan.parts)} parts")
        self.plan, self.caches, self.num_experts = plan, list(caches), num_experts
        self.guard = guard or (lambda device: contextlib.nullcontext())
        self.offsets, at = [], 0  # first global MoE index of each part
        for p in plan.parts:
            self.offsets.append(at)
            at += len(p.moe_layers)
        self.num_keys = at * num_experts

    def _live(self):
        for k, (part, cache) in enumerate(zip(self.plan.parts, self.caches, strict=True)):
            if cache is not None:
                yield k, part, cache

    def state(self) -> dict:
        """Summed counters, per-layer hit rates in global layer order, and `per_gpu`: each
        part's own state with its device and layers."""
        from glm53.tiers.vram_cache import COUNTERS

        out: dict = dict.fromkeys(COUNTERS, 0)
        out.update(slots=0, used=0)
        rates: list = []
        per_gpu = []
        for k, part in enumerate(self.plan.parts):
            cache = self.caches[k]
            entry = {
                "entry": part.entry,
                "device": part.device,
                "layers": [part.first_layer, part.end_layer],
                "moe_layers": list(part.moe_layers),
            }
            if cache is None:
                rates += [None] * len(part.moe_layers)
                entry["slots"] = 0
                per_gpu.append(entry)
                continue
            with self.guard(cache.device):
                s = cache.state()
            for name in (*COUNTERS, "slots", "used"):
                out[name] += s[name]
            rates += s["layer_hit_rate"]
            per_gpu.append({**entry, **s})
        looked = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / looked if looked else None
        out["layer_hit_rate"] = rates
        out["per_gpu"] = per_gpu
        return out

    def seed(self, keys) -> int:
        """Warm start: each part takes the keys of its layers, in the given order."""
        per: list[list[int]] = [[] for _ in self.caches]
        for key in (int(k) for k in keys):
            if not 0 <= key < self.num_keys:
                raise ValueError(f"heat-list key {key} is outside [0, {self.num_keys})")
            layer = key // self.num_experts
            k = max(i for i, off in enumerate(self.offsets) if off <= layer)
            per[k].append(key - self.offsets[k] * self.num_experts)
        placed = 0
        for k, _, cache in self._live():
            with self.guard(cache.device):
                placed += cache.seed(per[k])
        return placed

    def empty(self, forget: bool = False) -> None:
        """Every part's cache emptied (DeviceExpertCache.empty)."""
        for _, _, cache in self._live():
            with self.guard(cache.device):
                cache.empty(forget)

    def heat_list(self) -> list[int]:
        """Every part's heat list in global keys, interleaved one key of each part in turn
        (each part's own order kept), so that a one-GPU start takes a mix of both."""
        lists = []
        for k, _, cache in self._live():
            with self.guard(cache.device):
                own = cache.heat_list()
            lists.append([key + self.offsets[k] * self.num_experts for key in own])
        out = []
        for i in range(max((len(x) for x in lists), default=0)):
            out += [x[i] for x in lists if i < len(x)]
        return out


def module_devices(modules, plan: SplitPlan) -> list[int]:
    """The device of each of exllamav3's top-level modules: a decoder layer its part's, what
    comes before the first layer (the embedding) the first part's, what comes after the last
    (final norm, lm_head) the last part's."""
    out, seen_layer = [], False
    for mod in modules:
        m = LAYER_MODULE.search(getattr(mod, "key", "") or "")
        if m is not None:
            layer = int(m[1])
            if not plan.parts[0].first_layer <= layer < plan.parts[-1].end_layer:
                raise UnsupportedCheckpoint(
                    f"exllamav3 module {mod.key}: layer {layer} is outside the plan's layers "
                    f"0-{plan.parts[-1].end_layer - 1} (num_hidden_layers of config.json): the "
                    "checkpoint's config.json disagrees with its tensors; fix or re-download it"
                )
            out.append(plan.part_of_layer(layer).device)
            seen_layer = True
        else:
            out.append(plan.parts[-1].device if seen_layer else plan.parts[0].device)
    if not seen_layer:
        raise UnsupportedCheckpoint(
            "exllamav3's model has no `.layers.N` modules: cannot split it over --gpus; name "
            "one GPU"
        )
    return out


@contextlib.contextmanager
def planned_devices(modules, devices: list[int]):
    """While inside, each module's `load(device, ...)` loads on its planned CUDA device instead
    of the one exllamav3 passes (a CPU device, for a module that prefers host memory, is kept).
    Instance attributes only: exllamav3's classes are untouched, and the shadows are removed on
    the way out."""
    import torch

    def on_plan(load, planned):
        def load_on_plan(device, *args, **kwargs):
            device = torch.device(device)
            return load(planned if device.type == "cuda" else device, *args, **kwargs)

        return load_on_plan

    if len(modules) != len(devices):
        raise ValueError(f"{len(devices)} devices for {len(modules)} modules")
    try:
        for mod, d in zip(modules, devices, strict=True):
            shadow(mod, "Module.load", on_plan(mod.load, torch.device("cuda", d)))
        yield
    finally:
        for mod in modules:
            unshadow(mod, "Module.load")


def load_split(
    model_dir: str,
    mode: str,
    gpus: list[int],
    cache_tokens: int = 8192,
    max_batch: int = 4,
    max_chunk: int = 2048,
    ec_max_slots: int | None = None,
    ec_reserve_gb: float = 1.0,
    ec_stage_gb: float | None = None,
    ec_freq_window: int | None = None,
    stage_min_rows: int = 256,
    stage_dma: bool | None = None,
    allow_unsupported: bool = False,
    vram_budget: int | None = None,
) -> Loaded:
    """glm53.exl3.loader.load over `gpus` (two or more entries); vram_budget applies to each.
    `mode` is exact or zerocopy (glm53.exl3.options.LoadOptions refuses the others)."""
    import json
    import os

    import torch

    check_version(allow_unsupported)
    hooks.install_hooks()
    from exllamav3 import Cache, Config, Model, Tokenizer

    count = torch.cuda.device_count()
    free: dict[int, int] = {}
    for g in dict.fromkeys(gpus):
        if not 0 <= g < count:
            raise Exl3Refused(
                f"--gpus names GPU {g}, but torch sees {count} CUDA device(s) (0..{count - 1}); "
                "check CUDA_VISIBLE_DEVICES"
            )
        have = torch.cuda.mem_get_info(torch.device("cuda", g))[0]
        if vram_budget is not None and vram_budget > have:
            raise Exl3Refused(
                f"--vram-budget {vram_budget / GIB:.2f} GiB is more than the {have / GIB:.2f} "
                f"GiB free on cuda:{g}; pass at most that"
            )
        free[g] = have if vram_budget is None else vram_budget

    config = Config.from_directory(model_dir)
    geo = moe_geometry(config.stc)
    sizes = {}
    for key, filename in config.stc.tensor_file_map.items():
        beg, end = config.stc.file_headers[filename][key]["data_offsets"]
        sizes[key] = end - beg
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        text_config = json.load(f)["text_config"]
    layers = model_layers(sizes, text_config)
    plan = plan_split(
        split_inputs(
            layers,
            gpus,
            free,
            text_config,
            cache_tokens,
            max_batch,
            max_chunk,
            ec_reserve_gb,
            ec_stage_gb,
            ec_max_slots,
        )  # fmt: skip
    )
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=cache_tokens, max_batch_size=max_batch)
    first = torch.device("cuda", plan.parts[0].device)
    home = hooks.PinnedExpertHome(model_dir, geo.moe_layers, geo.n_experts, geo.part_bytes, first)
    hooks.register_home(home)
    try:
        with planned_devices(model.modules, module_devices(model.modules, plan)):
            model.load(first, max_chunk_size=max_chunk)
        assign(model, "Model.active_devices", list(dict.fromkeys(p.device for p in plan.parts)))
    except Exception:
        home.close()
        raise
    finally:
        hooks.unregister_home(home)
    tokenizer = Tokenizer.from_config(config)
    moe = hooks.moe_modules(model)
    loaded = Loaded(mode, config, model, cache, tokenizer, geo, moe, home, split=plan)
    home_addr = home.home_addresses()
    check_tables_point_home(moe, home_addr, home.geo)
    if mode == "exact":
        loaded.ec = _attach_caches(
            plan, moe, geo, home, home_addr, ec_freq_window, stage_min_rows, stage_dma,
            ec_reserve_gb, hooks.prefill_moe_count(model, moe),
        )  # fmt: skip
    return loaded


def _attach_caches(plan, moe, geo, home, home_addr, freq_window, min_rows, dma, reserve_gb,
                   prefill_moe: int):  # fmt: skip
    """One DeviceExpertCache (+ PrefillStager) per part with MoE layers, over its layers'
    home records and pointer tables; the planned slots, fewer where the device has less free
    now than planned (shared in proportion among the parts on one device). `prefill_moe`: the
    MoE layers a prefill forward runs (hooks.prefill_moe_count), counted from the first."""
    import torch

    from glm53.tiers.vram_cache import CacheGeometry, DeviceExpertCache, PrefillStager

    rb, n_e = home.geo.record_bytes, home.geo.n_experts
    index = {layer: i for i, layer in enumerate(geo.moe_layers)}
    slots_of = {}
    for dev in plan.devices:
        parts = [p for p in plan.parts if p.device == dev.device]
        torch.cuda.synchronize(dev.device)
        room = torch.cuda.mem_get_info(torch.device("cuda", dev.device))[0]
        room -= int(reserve_gb * GIB) + sum(p.stage_bytes for p in parts)
        fit = max(0, room // rb)
        want = sum(p.cache_slots for p in parts)
        got = split_in_proportion(min(fit, want), [p.cache_slots for p in parts])
        slots_of.update({p.entry: s for p, s in zip(parts, got, strict=True)})
    caches = []
    for part in plan.parts:
        slots = slots_of[part.entry]
        if not part.moe_layers or slots < 1:
            caches.append(None)  # its MoE layers (if any) read every expert zero-copy
            continue
        mods = [moe[index[layer]] for layer in part.moe_layers]
        first = index[part.moe_layers[0]]
        keys = slice(first * n_e, (first + len(mods)) * n_e)
        dev = torch.device("cuda", part.device)
        with torch.cuda.device(dev):
            ec = DeviceExpertCache(
                CacheGeometry(len(mods), n_e, home.geo.part_bytes), slots, home_addr[keys],
                hooks.table_addresses(mods), dev, freq_window=freq_window,
            )  # fmt: skip
            stager = None
            if part.stage_slots > 0:
                ran = max(0, min(len(mods), prefill_moe - first))  # of this part's layers
                stager = OnDevice(
                    PrefillStager(ec, part.stage_slots, min_rows, dma, prefill_layers=ran), dev
                )
        hooks.attach_cache(mods, OnDevice(ec, dev), stager)
        caches.append(ec)
    return SplitCaches(plan, caches, n_e, guard=torch.cuda.device)
