"""A glm5_next EXL3 checkpoint as transformers' `Glm5NextTextModel` (CPU, fp32).

Maps checkpoint tensor names to transformers' module names (the fused KDA `qkv_proj` split into
q/k/v, the three short convolutions fused into `conv1d`, the forget-gate parameters moved under
`forget_gate`, mHC `hc_attn_fn` -> `attn_hc.fn`, experts stacked) and decodes every EXL3 linear
once to a dense fp32 weight with the reference decoder.

Dense weights are computed in fp64 from the decoded fp16 tiles, `W = diag(suh) H Wq H diag(svh)`,
and rounded once to fp32, so they differ from the EXL3 math only by that one rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from glm53.models.checkpoint import Checkpoint
from glm53.models.exl3 import HAD_DIM, Exl3Weights, hadamard128

PREFIX = "model.language_model."


def exl3_weights(ckpt: Checkpoint, key: str) -> Exl3Weights:
    """The reference decoder's view of EXL3 linear `key`."""
    lin = ckpt.linear(key)
    return Exl3Weights(
        ckpt.read(lin.trellis.key), ckpt.read(lin.suh.key), ckpt.read(lin.svh.key), lin.codebook
    )


def _hadamard_rows(w: np.ndarray) -> np.ndarray:
    """H (block-diagonal, 128-point, 1/sqrt(128)) applied along axis 0 of w [k, n], fp64."""
    k, n = w.shape
    h = hadamard128() / np.sqrt(HAD_DIM)
    return np.matmul(h, w.reshape(k // HAD_DIM, HAD_DIM, n)).reshape(k, n)


def dense_weight(lin: Exl3Weights) -> torch.Tensor:
    """nn.Linear weight [out, in] fp32 of an EXL3 linear (one fp64 -> fp32 rounding)."""
    wq = lin.inner_weight().astype(np.float64)
    w = _hadamard_rows(wq) * lin.suh.astype(np.float64)[:, None]
    w = _hadamard_rows(w.T).T * lin.svh.astype(np.float64)[None, :]
    return torch.from_numpy(np.ascontiguousarray(w.T, dtype=np.float32))


def text_config(ckpt: Checkpoint):
    """transformers' Glm5NextTextConfig from the checkpoint's text_config (sdpa attention)."""
    from transformers import Glm5NextTextConfig

    fields = {k: v for k, v in ckpt.text_config.items() if k not in ("model_type", "architectures")}
    config = Glm5NextTextConfig(**fields)
    config._attn_implementation = "sdpa"
    return config


def _f32(ckpt: Checkpoint, key: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ckpt.read_f32(key)))


def _linear(ckpt: Checkpoint, key: str) -> torch.Tensor:
    """Dense [out, in] fp32 of linear `key`, EXL3 or plain `.weight`."""
    if ckpt.is_exl3(key):
        return dense_weight(exl3_weights(ckpt, key))
    return _f32(ckpt, f"{key}.weight")


def _attention(ckpt: Checkpoint, src: str, dst: str, kind: str, out: dict) -> None:
    if kind == "linear_attention":
        q, k, v = torch.chunk(_linear(ckpt, f"{src}.qkv_proj"), 3, dim=0)
        out[f"{dst}.q_proj.weight"], out[f"{dst}.k_proj.weight"] = q.contiguous(), k.contiguous()
        out[f"{dst}.v_proj.weight"] = v.contiguous()
        out[f"{dst}.conv1d.weight"] = torch.cat(
            [_f32(ckpt, f"{src}.{c}_conv1d.weight") for c in "qkv"], dim=0
        )
        for name in ("f_a_proj", "f_b_proj"):
            out[f"{dst}.forget_gate.{name}.weight"] = _linear(ckpt, f"{src}.{name}")
        for name in ("dt_bias", "A_log"):
            out[f"{dst}.forget_gate.{name}"] = _f32(ckpt, f"{src}.{name}").reshape(-1)
        for name in ("b_proj", "g_a_proj", "g_b_proj", "o_proj"):
            out[f"{dst}.{name}.weight"] = _linear(ckpt, f"{src}.{name}")
        out[f"{dst}.o_norm.weight"] = _f32(ckpt, f"{src}.o_norm.weight")
        return
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        out[f"{dst}.{name}.weight"] = _linear(ckpt, f"{src}.{name}")
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        out[f"{dst}.{name}.weight"] = _f32(ckpt, f"{src}.{name}.weight")
    for name in ("wq_b", "wk", "weights_proj"):
        out[f"{dst}.indexer.{name}.weight"] = _linear(ckpt, f"{src}.indexer.{name}")
    for name in (
        "k_norm.weight",
        "k_norm.bias",
        "index_kpool_compress_gate",
        "index_kpool_compress_ape",
    ):
        out[f"{dst}.indexer.{name}"] = _f32(ckpt, f"{src}.indexer.{name}")


def _mlp(ckpt: Checkpoint, src: str, dst: str, out: dict) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{dst}.{name}.weight"] = _linear(ckpt, f"{src}.{name}")


def stacked_experts(ckpt: Checkpoint, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' stacked expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    gate_up, down = [], []
    for expert in ckpt.experts(layer):
        gate, up, dn = (dense_weight(exl3_weights(ckpt, lin.key)) for lin in expert.linears)
        gate_up.append(torch.cat([gate, up], dim=0))
        down.append(dn)
    return torch.stack(gate_up), torch.stack(down)


def text_state_dict(ckpt: Checkpoint, include_experts: bool) -> dict[str, torch.Tensor]:
    """Glm5NextTextModel's state dict (fp32). Without experts, the routed-expert parameters of
    every MoE layer are left out (the tiered MoE module serves them)."""
    tc = ckpt.text_config
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": _f32(ckpt, f"{PREFIX}embed_tokens.weight"),
        "norm.weight": _f32(ckpt, f"{PREFIX}norm.weight"),
    }
    moe_layers = set(ckpt.moe_layers)
    for i in range(ckpt.num_layers):
        src, dst = f"{PREFIX}layers.{i}", f"layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}.{norm}.weight"] = _f32(ckpt, f"{src}.{norm}.weight")
        for site in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                out[f"{dst}.{site}_hc.{part}"] = _f32(ckpt, f"{src}.hc_{site}_{part}")
        _attention(ckpt, f"{src}.self_attn", f"{dst}.self_attn", tc["layer_types"][i], out)
        if i not in moe_layers:
            _mlp(ckpt, f"{src}.mlp", f"{dst}.mlp", out)
            continue
        out[f"{dst}.mlp.gate.weight"] = _f32(ckpt, f"{src}.mlp.gate.weight")
        out[f"{dst}.mlp.gate.e_score_correction_bias"] = _f32(
            ckpt, f"{src}.mlp.gate.e_score_correction_bias"
        )
        _mlp(ckpt, f"{src}.mlp.shared_experts", f"{dst}.mlp.shared_experts", out)
        if include_experts:
            gate_up, down = stacked_experts(ckpt, i)
            out[f"{dst}.mlp.experts.gate_up_proj"] = gate_up
            out[f"{dst}.mlp.experts.down_proj"] = down
    return out


def lm_head_weight(ckpt: Checkpoint) -> torch.Tensor:
    """[vocab, hidden] fp32 (EXL3 `lm_head`, or the embedding when tied and absent)."""
    if ckpt.is_exl3("lm_head") or "lm_head.weight" in ckpt.tensors:
        return _linear(ckpt, "lm_head")
    if ckpt.config.get("tie_word_embeddings"):
        return _f32(ckpt, f"{PREFIX}embed_tokens.weight")
    raise KeyError(f"{ckpt.directory} has no lm_head and does not tie it to the embedding")


def build_text_model(ckpt: Checkpoint, moe_factory=None):
    """Glm5NextTextModel (eval, fp32, CPU) with the checkpoint's weights.

    `moe_factory(layer, hf_moe_module)`: the module that replaces each MoE block; it receives
    the transformers block (router and shared expert loaded, experts not). Without a factory,
    the experts are loaded dense into transformers' own MoE blocks (the reference model)."""
    from transformers import Glm5NextTextModel

    config = text_config(ckpt)
    with torch.device("meta"):
        model = Glm5NextTextModel(config)
    state = text_state_dict(ckpt, include_experts=moe_factory is None)
    if moe_factory is not None:
        for i in ckpt.moe_layers:
            experts = model.layers[i].mlp.experts
            model.layers[i].mlp.experts = None
            del experts
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{ckpt.directory}: the checkpoint does not fill transformers' Glm5NextTextModel: "
            f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}"
        )
    if moe_factory is not None:
        for i in ckpt.moe_layers:
            model.layers[i].mlp = moe_factory(i, model.layers[i].mlp)
    return model.requires_grad_(False).eval()
