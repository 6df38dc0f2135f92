"""Loading a glm5_next EXL3 checkpoint into stock exllamav3 1.6.5, three ways:

- `stock`:      exllamav3 as shipped, every routed expert in VRAM (the ceiling, and the
                reference that exact mode must match bit for bit);
- `zerocopy`:   routed experts' trellis in pinned host memory, read over PCIe by the MoE
                kernels, no cache (the floor);
- `exact`:      the same pinned home plus the device-side CLOCK cache in VRAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from glm53.tiers import exl3_hooks

GIB = 1 << 30


@dataclass
class MoeGeometry:
    moe_layers: list[int]
    n_experts: int
    part_bytes: tuple[int, int, int]
    expert_bytes_total: int  # routed trellis bytes of the whole checkpoint
    other_bytes: int  # every other tensor


def moe_geometry(stc) -> MoeGeometry:
    layers: dict[int, set[int]] = {}
    parts: dict[int, int] = {}
    expert_total = other = 0
    for key, filename in stc.tensor_file_map.items():
        beg, end = stc.file_headers[filename][key]["data_offsets"]
        m = exl3_hooks.EXPERT_TRELLIS.match(key)
        if m is None:
            other += end - beg
            continue
        expert_total += end - beg
        layers.setdefault(int(m["layer"]), set()).add(int(m["expert"]))
        proj = exl3_hooks.PROJ_INDEX[m["proj"]]
        if parts.setdefault(proj, end - beg) != end - beg:
            raise RuntimeError(f"{key}: {end - beg} bytes, other experts have {parts[proj]}")
    if not layers:
        raise RuntimeError(f"{stc.directory}: no routed expert trellis found (not an EXL3 MoE?)")
    counts = {len(v) for v in layers.values()}
    if len(counts) != 1 or len(parts) != 3:
        raise RuntimeError(f"{stc.directory}: MoE layers disagree on their expert count {counts}")
    return MoeGeometry(
        sorted(layers), counts.pop(), (parts[0], parts[1], parts[2]), expert_total, other
    )


@dataclass
class Loaded:
    mode: str
    config: object
    model: object
    cache: object
    tokenizer: object
    geometry: MoeGeometry
    moe: list = field(default_factory=list)
    home: exl3_hooks.PinnedExpertHome | None = None
    ec: object | None = None
    stager: object | None = None

    def close(self) -> None:
        exl3_hooks.detach_cache(self.moe)
        self.model.unload()
        if self.home is not None:
            self.home.close()


STAGE_SHARE = 0.25  # of the VRAM left after the model, at most, for the default staging buffers
MIN_STAGE_SLOTS = 8  # below this many records per buffer the default turns staging off


def staging_slots(
    free: int, reserve: int, n_experts: int, record_bytes: int, stage_gb: float | None
) -> int:
    """Records per prefill staging buffer (two buffers). `stage_gb` None is the default: two
    whole MoE layers when they take at most STAGE_SHARE of the VRAM left (free - reserve), else
    as many records as that share holds (GLM-5.3-Flash with 10 GiB free and the 1 GiB reserve: 128
    of each layer's 288 experts), or none when that is under MIN_STAGE_SLOTS; 0 turns staging off."""
    if stage_gb is not None:
        return min(n_experts, int(stage_gb * GIB // (2 * record_bytes)))
    budget = STAGE_SHARE * max(0, free - reserve)
    slots = min(n_experts, int(budget // (2 * record_bytes)))
    return slots if slots >= MIN_STAGE_SLOTS else 0


def load(
    model_dir: str,
    mode: str = "exact",
    device: str = "cuda:0",
    cache_tokens: int = 8192,
    max_batch: int = 4,
    max_chunk: int = 2048,
    ec_slots: int | None = None,
    ec_max_slots: int | None = None,
    ec_reserve_gb: float = 1.0,
    ec_stage_gb: float | None = None,
    ec_freq_window: int | None = None,
    stage_min_rows: int = 256,
    stage_dma: bool | None = None,
    allow_unsupported: bool = False,
) -> Loaded:
    import torch

    if mode not in ("stock", "zerocopy", "exact"):
        raise ValueError(f"unknown load mode {mode!r}: stock, zerocopy or exact")
    exl3_hooks.check_exllamav3(allow_unsupported)
    exl3_hooks.install_hooks()
    from exllamav3 import Cache, Config, Model, Tokenizer

    config = Config.from_directory(model_dir)
    geo = moe_geometry(config.stc)
    dev = torch.device(device)
    free, _ = torch.cuda.mem_get_info(dev)
    need = geo.other_bytes + (geo.expert_bytes_total if mode == "stock" else 0)
    if need + ec_reserve_gb * GIB > free:
        raise RuntimeError(
            f"not enough VRAM on {dev}: {need / GIB:.2f} GiB of weights to place "
            f"({'all experts included' if mode == 'stock' else 'routed experts stay in host RAM'})"
            f" + {ec_reserve_gb:.2f} GiB reserve > {free / GIB:.2f} GiB free"
        )
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=cache_tokens, max_batch_size=max_batch)
    home = None
    if mode != "stock":
        home = exl3_hooks.PinnedExpertHome(
            model_dir, geo.moe_layers, geo.n_experts, geo.part_bytes, dev
        )
        exl3_hooks.register_home(home)
    try:
        model.load(dev, max_chunk_size=max_chunk)
    except Exception:
        if home is not None:
            home.close()
        raise
    finally:
        if home is not None:
            exl3_hooks.unregister_home(home)  # only loads go through the hook
    tokenizer = Tokenizer.from_config(config)
    moe = exl3_hooks.moe_modules(model)
    loaded = Loaded(mode, config, model, cache, tokenizer, geo, moe, home)
    if mode == "stock":
        return loaded

    home_addr = home.home_addresses()
    _check_tables_point_home(moe, home_addr, home.geo)
    if mode == "exact":
        from glm53.tiers.vram_cache import DeviceExpertCache

        torch.cuda.synchronize(dev)
        free, _ = torch.cuda.mem_get_info(dev)
        rb = home.geo.record_bytes
        stage_slots = staging_slots(
            free, int(ec_reserve_gb * GIB), home.geo.n_experts, rb, ec_stage_gb
        )
        free -= 2 * stage_slots * rb
        fit = int((free - ec_reserve_gb * GIB) // rb)
        slots = ec_slots if ec_slots is not None else fit
        if ec_max_slots is not None:
            slots = min(slots, ec_max_slots)
        slots = min(slots, home.geo.n_keys)
        if slots < 1 or slots > fit:
            raise RuntimeError(
                f"the VRAM expert cache cannot hold {slots} slots of "
                f"{home.geo.record_bytes / 2**20:.1f} MiB: {free / GIB:.2f} GiB free, "
                f"{ec_reserve_gb:.2f} GiB reserved (--ec-reserve-gb) leaves room for {fit}"
            )
        ec = DeviceExpertCache(
            home.geo, slots, home_addr, exl3_hooks.table_addresses(moe), dev,
            freq_window=ec_freq_window,
        )  # fmt: skip
        stager = None
        if stage_slots > 0:
            from glm53.tiers.vram_cache import PrefillStager

            stager = PrefillStager(ec, stage_slots, min_rows=stage_min_rows, dma=stage_dma)
        exl3_hooks.attach_cache(moe, ec, stager)
        loaded.ec, loaded.stager = ec, stager
    return loaded


def _check_tables_point_home(moe, home_addr, geo) -> None:
    import numpy as np

    for i, mod in enumerate(moe):
        gate = mod.multi_gate if mod.multi_gate is not None else mod.multi_up
        for p, multi in enumerate((gate, mod.multi_up, mod.multi_down)):
            got = multi.ptrs_trellis.cpu().numpy()
            want = home_addr[i * geo.n_experts : (i + 1) * geo.n_experts] + geo.part_off[p]
            if not np.array_equal(got, want):
                raise RuntimeError(
                    f"{mod.key}: exllamav3's pointer table does not point at the pinned expert "
                    "home; this exllamav3 build loads experts differently than 1.6.5"
                )


def heat_path(model_dir: str) -> str:
    """Where the warm-start heat list of a checkpoint lives (by config fingerprint)."""
    import hashlib

    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(base, "glm53", "heat", f"{digest}.json")
