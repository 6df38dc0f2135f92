"""The tensor plan and config files of synthetic GLM-5.3-Flash EXL3 checkpoints.

The plan lists every tensor (key, dtype, shape, how to fill it) in file order, without data,
following what exllamav3 1.6.5's `glm5_next` text model loads (facts:
exllamav3-glm5next-checkpoint.md §4) and the real layer cycle (KDA x3 + DSA, dense first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm53.models.tokenizer import TokenIds
from glm53.synth.shapes import SynthShape

ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I16": 2, "I32": 4}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One planned tensor. `fill` names how synth.py generates it; `scale` parametrizes it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    fill: str
    scale: float = 0.0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ELEMENT_BYTES[self.dtype]


def exl3_linear(key: str, k: int, n: int, bits: int) -> list[TensorSpec]:
    # suh = svh = +-k^(-1/4): a unit-variance mul1 weight then keeps rms(y) ~= rms(x)
    scale = float(k) ** -0.25
    return [
        TensorSpec(f"{key}.trellis", "I16", (k // 16, n // 16, 16 * bits), "trellis"),
        TensorSpec(f"{key}.suh", "F16", (k,), "signs", scale),
        TensorSpec(f"{key}.svh", "F16", (n,), "signs", scale),
        TensorSpec(f"{key}.mul1", "I32", (), "mul1"),
    ]


def fp16_linear(key: str, k: int, n: int) -> TensorSpec:
    return TensorSpec(f"{key}.weight", "F16", (n, k), "normal", float(k) ** -0.5)


def norm(key: str, width: int, dtype: str = "BF16") -> TensorSpec:
    return TensorSpec(f"{key}.weight", dtype, (width,), "ones")


def _kda(s: SynthShape, p: str) -> list[TensorSpec]:
    h, d, hd = s.hidden_size, s.kda_dim, s.kda_head_dim
    out = exl3_linear(f"{p}.qkv_proj", h, 3 * d, s.bits)
    out += exl3_linear(f"{p}.o_proj", d, h, s.bits)
    out += [
        fp16_linear(f"{p}.b_proj", h, s.kda_heads),
        fp16_linear(f"{p}.f_a_proj", h, hd),
        fp16_linear(f"{p}.f_b_proj", hd, d),
        fp16_linear(f"{p}.g_a_proj", h, hd),
        fp16_linear(f"{p}.g_b_proj", hd, d),
    ]
    for c in "qkv":
        out.append(
            TensorSpec(f"{p}.{c}_conv1d.weight", "BF16", (d, 1, s.conv_kernel), "normal", 0.5)
        )
    out += [
        TensorSpec(f"{p}.A_log", "F32", (s.kda_heads,), "log_uniform_1_16"),
        TensorSpec(f"{p}.dt_bias", "F32", (d,), "normal", 0.1),
        norm(f"{p}.o_norm", hd, "F32"),
    ]
    return out


def _dsa(s: SynthShape, p: str) -> list[TensorSpec]:
    h, nh = s.hidden_size, s.attn_heads
    ih, idim = s.index_heads, s.index_head_dim
    out = exl3_linear(f"{p}.q_a_proj", h, s.q_lora_rank, s.bits)
    out.append(norm(f"{p}.q_a_layernorm", s.q_lora_rank))
    out += exl3_linear(f"{p}.q_b_proj", s.q_lora_rank, nh * s.qk_nope_head_dim, s.bits)
    out += exl3_linear(f"{p}.kv_a_proj_with_mqa", h, s.kv_lora_rank, s.bits)
    out.append(norm(f"{p}.kv_a_layernorm", s.kv_lora_rank))
    kv_b_rows = nh * (s.qk_nope_head_dim + s.v_head_dim)
    out.append(fp16_linear(f"{p}.kv_b_proj", s.kv_lora_rank, kv_b_rows))
    out += exl3_linear(f"{p}.o_proj", nh * s.v_head_dim, h, s.bits)
    out += exl3_linear(f"{p}.indexer.wq_b", s.q_lora_rank, ih * idim, s.bits)
    out += [
        fp16_linear(f"{p}.indexer.wk", h, idim),
        norm(f"{p}.indexer.k_norm", idim),
        TensorSpec(f"{p}.indexer.k_norm.bias", "BF16", (idim,), "zeros"),
        fp16_linear(f"{p}.indexer.weights_proj", h, ih),
        TensorSpec(f"{p}.indexer.index_kpool_compress_gate", "BF16", (idim, h), "normal", h**-0.5),
        TensorSpec(
            f"{p}.indexer.index_kpool_compress_ape", "F32", (s.index_kpool, idim), "normal", 0.1
        ),
    ]
    return out


def _mlp(key: str, h: int, inner: int, bits: int) -> list[TensorSpec]:
    out = exl3_linear(f"{key}.gate_proj", h, inner, bits)
    out += exl3_linear(f"{key}.up_proj", h, inner, bits)
    out += exl3_linear(f"{key}.down_proj", inner, h, bits)
    return out


def _hc_site(s: SynthShape, key: str) -> list[TensorSpec]:
    hc = s.hc_mult
    rows = (2 + hc) * hc
    fn_std = 0.5 / (hc * s.hidden_size) ** 0.5
    return [
        TensorSpec(f"{key}_fn", "F32", (rows, hc * s.hidden_size), "normal", fn_std),
        TensorSpec(f"{key}_base", "F32", (rows,), "hc_base"),
        TensorSpec(f"{key}_scale", "F32", (3,), "ones"),
    ]


def router_keys(layer: int, prefix: str = "model.language_model") -> tuple[str, str]:
    base = f"{prefix}.layers.{layer}.mlp.gate"
    return f"{base}.weight", f"{base}.e_score_correction_bias"


def layer_tensors(s: SynthShape, layer: int) -> list[TensorSpec]:
    p = f"model.language_model.layers.{layer}"
    h = s.hidden_size
    out = [norm(f"{p}.input_layernorm", h), norm(f"{p}.post_attention_layernorm", h)]
    out += _hc_site(s, f"{p}.hc_attn") + _hc_site(s, f"{p}.hc_ffn")
    if s.layer_type(layer) == "linear_attention":
        out += _kda(s, f"{p}.self_attn")
    else:
        out += _dsa(s, f"{p}.self_attn")
    if not s.is_moe(layer):
        return out + _mlp(f"{p}.mlp", h, s.intermediate_size, s.bits)
    gate_key, bias_key = router_keys(layer)
    out += [
        TensorSpec(gate_key, "F16", (s.num_experts, h), "normal", h**-0.5),
        TensorSpec(bias_key, "F32", (s.num_experts,), "zeros"),
    ]
    shared = s.moe_intermediate_size * s.num_shared_experts
    out += _mlp(f"{p}.mlp.shared_experts", h, shared, s.bits)
    for e in range(s.num_experts):
        out += _mlp(f"{p}.mlp.experts.{e}", h, s.moe_intermediate_size, s.bits)
    return out


def plan(s: SynthShape) -> list[list[TensorSpec]]:
    """Tensor groups in file order: embedding, one group per layer, then norm + lm_head."""
    h = s.hidden_size
    groups = [
        [
            TensorSpec(
                "model.language_model.embed_tokens.weight", "BF16", (s.vocab_size, h), "normal", 1.0
            )
        ]
    ]
    groups += [layer_tensors(s, i) for i in range(s.num_layers)]
    groups.append(
        [norm("model.language_model.norm", h)]
        + exl3_linear("lm_head", h, s.vocab_size, s.head_bits)
    )
    return groups


def text_config(s: SynthShape, ids: TokenIds) -> dict:
    return {
        "model_type": "glm5_next_text",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_layers,
        "layer_types": [s.layer_type(i) for i in range(s.num_layers)],
        "mlp_layer_types": ["sparse" if s.is_moe(i) else "dense" for i in range(s.num_layers)],
        "first_k_dense_replace": s.num_dense_layers,
        "indexer_types": ["full"] * s.num_layers,
        "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "n_routed_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "n_shared_experts": s.num_shared_experts,
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "moe_router_dtype": "float32",
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "num_attention_heads": s.attn_heads,
        "num_key_value_heads": s.attn_heads,
        "q_lora_rank": s.q_lora_rank,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": 0,
        "qk_head_dim": s.qk_nope_head_dim,
        "v_head_dim": s.v_head_dim,
        "head_dim": 0,
        "mla_use_nope": True,
        "attention_bias": False,
        "index_n_heads": s.index_heads,
        "index_head_dim": s.index_head_dim,
        "index_topk": s.index_topk,
        "index_kpool": s.index_kpool,
        "index_kpool_compress": True,
        "index_kpool_always_select_tail": True,
        "indexer_rope_interleave": True,
        "linear_attn_config": {
            "num_heads": s.kda_heads,
            "head_dim": s.kda_head_dim,
            "short_conv_kernel_size": s.conv_kernel,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i in range(s.num_layers) if i % 4 != 3],
            "full_attn_layers": [i for i in range(s.num_layers) if i % 4 == 3],
        },
        "mhc": True,
        "hc_mult": s.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": s.max_position_embeddings,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "pad_token_id": ids.pad,
        "eos_token_id": list(ids.eos),
    }


def vision_config() -> dict:
    # Read (not used) by exllamav3 even for text-only loading; the real tower's values.
    return {
        "model_type": "glm5_next_vision",
        "depth": 24,
        "hidden_size": 1024,
        "hidden_act": "silu",
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 4096,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "attention_bias": True,
        "image_size": 448,
        "rms_norm_eps": 1e-5,
        "projection_intermediate_size": 10240,
        "swiglu_limit": 10.0,
    }


def processor_config() -> dict:
    clip_mean = [0.48145466, 0.4578275, 0.40821073]
    clip_std = [0.26862954, 0.26130258, 0.27577711]
    image = {
        "image_processor_type": "Glm5NextImageProcessor",
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": clip_mean,
        "image_std": clip_std,
        "min_image_tokens": 4,
        "max_image_tokens": 16384,
    }
    return {"image_processor": image, "video_processor": dict(image)}


def quantization_config(s: SynthShape) -> dict:
    return {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": float(s.bits),
        "head_bits": s.head_bits,
        "calibration": {"rows": 0, "cols": 0},
        "out_scales": "auto",
        "codebook": "mul1",
        "synthetic": True,
    }


def model_config(s: SynthShape, ids: TokenIds) -> dict:
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text_config(s, ids),
        "vision_config": vision_config(),
        "vocab_size": s.vocab_size,
        "image_token_id": ids.image,
        "video_token_id": ids.video,
        "image_start_token_id": ids.image_start,
        "image_end_token_id": ids.image_end,
        "video_start_token_id": ids.video_start,
        "video_end_token_id": ids.video_end,
        "pad_token_id": ids.pad,
        "eos_token_id": list(ids.eos),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "5.16.1",
        "quantization_config": quantization_config(s),
    }
