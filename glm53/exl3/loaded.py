"""What loading a glm5_next EXL3 checkpoint into exllamav3 gives back (Loaded), the MoE geometry
it is loaded with (moe_geometry, from exllamav3's safetensors headers), and the check that
exllamav3's pointer tables point at the experts' home. Shared by the one-GPU load
(glm53.exl3.loader) and the split over several GPUs (glm53.exl3.split).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm53.exl3 import hooks
from glm53.exl3.errors import UnsupportedCheckpoint
from glm53.exl3.version import UnsupportedExllamaV3
from glm53.plan.vram import VramPlan

EMBEDDING_SUFFIX = "embed_tokens.weight"  # exllamav3's embedding module prefers host memory


@dataclass
class MoeGeometry:
    moe_layers: list[int]
    n_experts: int
    part_bytes: tuple[int, int, int]
    expert_bytes_total: int  # routed trellis bytes of the whole checkpoint
    other_bytes: int  # every other tensor
    host_bytes: int  # of other_bytes, what exllamav3 keeps in host memory (the embedding)

    @property
    def vram_model_bytes(self) -> int:
        """Non-expert bytes exllamav3 places in VRAM."""
        return self.other_bytes - self.host_bytes


def moe_geometry(stc) -> MoeGeometry:
    layers: dict[int, set[int]] = {}
    parts: dict[int, int] = {}
    expert_total = other = host = 0
    for key, filename in stc.tensor_file_map.items():
        beg, end = stc.file_headers[filename][key]["data_offsets"]
        m = hooks.EXPERT_TRELLIS.match(key)
        if m is None:
            other += end - beg
            host += end - beg if key.endswith(EMBEDDING_SUFFIX) else 0
            continue
        expert_total += end - beg
        layers.setdefault(int(m["layer"]), set()).add(int(m["expert"]))
        proj = hooks.PROJ_INDEX[m["proj"]]
        if parts.setdefault(proj, end - beg) != end - beg:
            raise UnsupportedCheckpoint(
                f"{key}: {end - beg} bytes, other experts have {parts[proj]}: glm53 serves "
                "checkpoints whose routed experts of a layer share one size; use such a checkpoint"
            )
    if not layers:
        raise UnsupportedCheckpoint(
            f"{stc.directory}: no routed expert trellis found (not an EXL3 MoE?): point --model "
            "at a GLM-5.3-Flash EXL3 checkpoint"
        )
    counts = {len(v) for v in layers.values()}
    if len(counts) != 1 or len(parts) != 3:
        raise UnsupportedCheckpoint(
            f"{stc.directory}: MoE layers disagree on their expert count {counts}: glm53 serves "
            "checkpoints with one expert count for every MoE layer"
        )
    return MoeGeometry(
        sorted(layers), counts.pop(), (parts[0], parts[1], parts[2]), expert_total, other, host
    )


@dataclass(frozen=True, slots=True)
class VramUse:
    """What torch's CUDA caching allocator holds on one device (bytes): `allocated` in live
    tensors, `peak` the most allocated since its peak was last reset. exllamav3 1.6.5's weights
    and KV cache and glm53's VRAM cache, staging and fast-mode buffers are torch tensors; what
    is allocated outside the allocator (the CUDA context, library workspaces) is not counted."""

    allocated: int
    peak: int


@dataclass
class Loaded:
    mode: str
    config: object
    model: object
    cache: object
    tokenizer: object
    geometry: MoeGeometry
    moe: list = field(default_factory=list)
    home: hooks.PinnedExpertHome | None = None
    ec: object | None = None
    stager: object | None = None
    vram_plan: VramPlan | None = None  # with a VRAM budget: where the budget went
    # VRAM the load holds (weights, KV cache, VRAM expert cache, staging), measured at its end:
    # glm53.exl3.loader.held_vram_bytes(vram_before, vram_use(device))
    resident_bytes: int | None = None
    load_peak_bytes: int | None = None  # the most the load held at once, the same way
    vram_before: VramUse | None = None  # the allocator's counts before the load
    split: object | None = None  # --gpus with two or more entries: the SplitPlan (glm53.exl3.split)
    nvme: object | None = None  # nvme-exact: glm53.exl3.nvme_device.NvmeHome

    def close(self) -> None:
        hooks.detach_cache(self.moe)
        if self.nvme is not None:
            self.nvme.close()
        self.model.unload()
        if self.home is not None:
            self.home.close()


def check_tables_point_home(moe, home_addr, geo) -> None:
    """RuntimeError unless every MoE module's pointer tables hold the home's address of each
    expert's gate, up and down trellis (what exllamav3 1.6.5 loads through the home hook)."""
    import numpy as np

    for i, mod in enumerate(moe):
        gate = mod.multi_gate if mod.multi_gate is not None else mod.multi_up
        for p, multi in enumerate((gate, mod.multi_up, mod.multi_down)):
            got = multi.ptrs_trellis.cpu().numpy()
            want = home_addr[i * geo.n_experts : (i + 1) * geo.n_experts] + geo.part_off[p]
            if not np.array_equal(got, want):
                raise UnsupportedExllamaV3(
                    f"{mod.key}: exllamav3's pointer table does not point at the pinned expert "
                    "home; this exllamav3 build loads experts differently than 1.6.5: install "
                    "exllamav3==1.6.5 (`pip install 'glm53[gpu]'`)"
                )
