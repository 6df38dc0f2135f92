"""The model geometry the cost model plans for: layers, MoE layers, experts per layer, top-k,
the bytes of one routed expert and the non-expert weights a decode step reads.

The default is GLM-5.3-Flash itself. `geometry_of(DIR)` reads a checkpoint's own (the slice and
deep synthetic presets, or a cut of the real model), so that `glm53 doctor --model DIR` and the
GPU benchmarks predict what that checkpoint does, not what the full model would.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from glm53.models.checkpoint import Checkpoint

EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.(\w+)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EMBEDDING_SUFFIX = "embed_tokens.weight"  # exllamav3 keeps it in host memory; one row per token


class Geometry(msgspec.Struct, frozen=True):
    """Bytes are tensor data as stored (EXL3 at its bits per weight)."""

    name: str
    num_layers: int
    num_moe_layers: int
    experts_per_layer: int
    top_k: int
    expert_bytes: int  # one routed expert's trellis: gate + up + down
    non_expert_bytes: int  # every other weight a decode step reads (no embedding, no expert)
    expert_bits: int
    hidden_size: int = 4096  # with hc_mult: the residual streams between layers (mHC)
    hc_mult: int = 4

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.experts_per_layer

    @property
    def prefill_moe_layers(self) -> int:
        """The MoE layers a prefill forward runs: all but the last. exllamav3's prefill stops
        in the last KV block after its attention (its MLP only ever runs in decode), and in
        glm5_next the dense layers come first, so that block's MLP is the last MoE layer
        (glm53.exl3.hooks.prefill_moe_count; the slice's layer-major staging test counts it)."""
        return max(0, self.num_moe_layers - 1)


def _flash_non_expert_bytes() -> int:
    """GLM-5.3-Flash at K=3 with its 6-bit lm_head, from the block sizes of the layouts that
    loaded on the H200 (exllamav3-glm5next-checkpoint.md §4): 34 KDA and 11 DSA attention
    blocks, 3 dense MLPs, 42 routers with their shared expert, 45 layers of norms and mHC, the
    final norm, and a 4096 x 154,880 lm_head (trellis [256, 9680, 96] int16 plus its scales)."""
    lm_head = 256 * 9680 * 96 * 2 + 2 * (4096 + 154_880) + 4
    return (
        34 * 57_459_464
        + 11 * 76_136_980
        + 3 * 56_721_420
        + 42 * 11_834_508
        + 45 * 3_162_328
        + 2 * 4096
        + lm_head
    )


GLM53_FLASH = Geometry(
    name="GLM-5.3-Flash",
    num_layers=45,
    num_moe_layers=42,
    experts_per_layer=288,
    top_k=8,
    expert_bytes=3 * 4096 * 2048 * 3 // 8,
    non_expert_bytes=_flash_non_expert_bytes(),
    expert_bits=3,
)


def geometry_of(directory: str | Path) -> Geometry:
    """The geometry of the glm5_next EXL3 checkpoint in `directory` (config and headers only)."""
    ckpt = Checkpoint(directory)
    tc = ckpt.text_config
    moe_layers = ckpt.moe_layers
    if not moe_layers:
        raise ValueError(f"{directory}: no MoE layer in the checkpoint; glm53 serves MoE models")
    experts = ckpt.expert_keys()
    counts = {len(v) for v in experts.values()}
    if len(counts) != 1:
        raise ValueError(f"{directory}: MoE layers disagree on their expert count {counts}")
    expert_bytes: set[int] = set()
    non_expert = 0
    per_expert: dict[tuple[str, str], int] = {}
    for key, info in ckpt.tensors.items():
        m = EXPERT_TENSOR.search(key)
        if m is None:
            non_expert += 0 if key.endswith(EMBEDDING_SUFFIX) else info.nbytes
        elif m[2] == "trellis":
            prefix = key[: m.start(1)]
            per_expert[(prefix, m[1])] = info.nbytes
    for prefix in {p for p, _ in per_expert}:
        expert_bytes.add(sum(per_expert.get((prefix, proj), 0) for proj in PROJECTIONS))
    if len(expert_bytes) != 1:
        raise ValueError(f"{directory}: routed experts differ in size {sorted(expert_bytes)}")
    (one,) = expert_bytes
    gate = next(i for (p, proj), i in per_expert.items() if proj == "gate_proj")
    hidden, inner = int(tc["hidden_size"]), int(tc["moe_intermediate_size"])
    return Geometry(
        name=Path(directory).name,
        num_layers=ckpt.num_layers,
        num_moe_layers=len(moe_layers),
        experts_per_layer=counts.pop(),
        top_k=int(tc.get("num_experts_per_tok", 8)),
        expert_bytes=one,
        non_expert_bytes=non_expert,
        expert_bits=gate * 8 // (hidden * inner),
        hidden_size=hidden,
        hc_mult=int(tc.get("hc_mult", 4)) if tc.get("mhc", True) else 1,
    )


def model_geometry(model_dir: str | None) -> Geometry:
    """The geometry to plan for: the checkpoint's own when --model names one, else
    GLM-5.3-Flash's (the model glm53 download fetches)."""
    if model_dir and os.path.isfile(os.path.join(model_dir, "config.json")):
        return geometry_of(model_dir)
    return GLM53_FLASH
