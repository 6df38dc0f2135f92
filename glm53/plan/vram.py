"""Exact mode's VRAM plan on one GPU: where a budget of free VRAM goes (the non-expert weights,
the KV cache of the DSA layers, the KDA layers' recurrent state, one chunk's activations, the
reserve, two prefill staging buffers) and how many expert slots the VRAM cache gets from what
is left. Plain Python (no torch): the GPU engine loads by it (glm53.exl3.loader), the
multi-GPU split plans each device by it (glm53.plan.split), and benchmarks emulate a small card
on a large one with it (--vram-budget).
"""

from __future__ import annotations

import msgspec

from glm53.units import GIB

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


class VramInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What the VRAM plan of exact mode depends on; bytes unless named otherwise."""

    budget_bytes: int  # the VRAM glm53 may use, as the free memory of a card that size
    model_bytes: int  # non-expert weights exllamav3 places in VRAM
    record_bytes: int  # one routed expert's trellis (gate + up + down)
    num_experts: int  # per MoE layer
    num_moe_layers: int
    kv_bytes_per_token: int  # cache of the softmax-attention (DSA) layers
    context_tokens: int  # the cache's token capacity (shared by the batch)
    state_bytes_per_sequence: int  # recurrent (KDA) state of one sequence
    batch: int
    activation_bytes: int  # the largest chunk's activations
    reserve_bytes: int  # kept free for CUDA and workspaces (--ec-reserve-gb)
    stage_gb: float | None = None  # --ec-stage-gb: None sizes staging by STAGE_SHARE
    max_slots: int | None = None  # --ec-max-slots


class VramPlan(msgspec.Struct, frozen=True):
    """Where the budget goes, in bytes, and the expert cache and staging it leaves room for."""

    budget_bytes: int
    model_bytes: int
    kv_bytes: int
    state_bytes: int
    activation_bytes: int
    reserve_bytes: int
    stage_slots: int  # records per staging buffer (two buffers)
    stage_bytes: int
    cache_slots: int
    cache_bytes: int
    free_bytes: int  # budget left over after all of the above (the reserve included above)


def plan_vram(x: VramInputs) -> VramPlan:
    """Exact mode's VRAM plan within a budget, as on a card with budget_bytes free: the model,
    KV cache, recurrent state and activations first, then the staging buffers from what is
    left (staging_slots), then as many expert slots as fit above the reserve (at most
    max_slots, and never more than the checkpoint has experts). Raises ValueError naming the
    shortfall when not even one slot fits."""
    kv = x.kv_bytes_per_token * x.context_tokens
    state = x.state_bytes_per_sequence * x.batch
    fixed = x.model_bytes + kv + state + x.activation_bytes
    free = x.budget_bytes - fixed
    stage = staging_slots(free, x.reserve_bytes, x.num_experts, x.record_bytes, x.stage_gb)
    free -= 2 * stage * x.record_bytes
    slots = max(0, (free - x.reserve_bytes) // x.record_bytes)
    if x.max_slots is not None:
        slots = min(slots, x.max_slots)
    slots = min(slots, x.num_moe_layers * x.num_experts)
    if slots < 1:
        raise ValueError(
            f"a VRAM budget of {x.budget_bytes / GIB:.2f} GiB holds no expert slot: model "
            f"{x.model_bytes / GIB:.2f} + KV {kv / GIB:.2f} + recurrent state {state / GIB:.2f} + "
            f"activations {x.activation_bytes / GIB:.2f} + staging "
            f"{2 * stage * x.record_bytes / GIB:.2f} + reserve {x.reserve_bytes / GIB:.2f} GiB "
            f"leave less than one {x.record_bytes / 2**20:.1f} MiB expert; raise --vram-budget "
            "or lower --context / --max-batch"
        )
    return VramPlan(
        budget_bytes=x.budget_bytes,
        model_bytes=x.model_bytes,
        kv_bytes=kv,
        state_bytes=state,
        activation_bytes=x.activation_bytes,
        reserve_bytes=x.reserve_bytes,
        stage_slots=stage,
        stage_bytes=2 * stage * x.record_bytes,
        cache_slots=slots,
        cache_bytes=slots * x.record_bytes,
        free_bytes=free - x.reserve_bytes - slots * x.record_bytes,
    )


def cache_geometry(text_config: dict) -> tuple[int, int]:
    """(KV bytes per token, recurrent-state bytes per sequence) of a glm5_next text model in
    exllamav3's fp16 cache: the sums over its layers of layer_cache_geometry."""
    per_layer = layer_cache_geometry(text_config)
    return sum(kv for kv, _ in per_layer), sum(state for _, state in per_layer)


def layer_cache_geometry(text_config: dict) -> list[tuple[int, int]]:
    """Per layer, (KV bytes per token, recurrent-state bytes per sequence) in exllamav3's fp16
    cache: a DSA layer keeps its MLA latent (kv_lora_rank) and its indexer key (index_head_dim)
    per token; a KDA layer keeps an fp32 heads x head_dim x head_dim state and the (kernel - 1)
    last q/k/v conv inputs in fp16 per sequence."""
    tc = text_config
    la = tc["linear_attn_config"]
    heads, hd, conv = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    kv = 2 * (tc["kv_lora_rank"] + tc["index_head_dim"])
    state = 4 * heads * hd * hd + 2 * (conv - 1) * 3 * heads * hd
    return [
        (0, state) if t == "linear_attention" else (kv, 0)
        for t in tc["layer_types"][: tc["num_hidden_layers"]]
    ]


def chunk_activation_bytes(text_config: dict, chunk_tokens: int) -> int:
    """The largest live activations of one prefill chunk, in fp16 unless noted: the fp32 mHC
    residual streams, the fused KDA q/k/v, and the dense MLP's gate and up outputs."""
    tc = text_config
    la = tc["linear_attn_config"]
    streams = 4 * tc.get("hc_mult", 4) * tc["hidden_size"]
    qkv = 2 * 3 * la["num_heads"] * la["head_dim"]
    mlp = 2 * 2 * tc["intermediate_size"]
    return chunk_tokens * (streams + qkv + mlp)
