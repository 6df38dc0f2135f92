"""Shapes and presets of synthetic GLM-5.3-Flash EXL3 checkpoints: every width, the layer
counts and the EXL3 bits, checked against what EXL3 and exllamav3 1.6.5 accept."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class SynthShape:
    """Every width of a synthetic checkpoint. Quantized dims must be multiples of 128."""

    name: str
    hidden_size: int
    num_layers: int
    num_dense_layers: int  # the first layers have a dense MLP, the rest are MoE
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    vocab_size: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    attn_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    hc_mult: int
    bits: int
    head_bits: int
    max_position_embeddings: int

    @property
    def kda_dim(self) -> int:
        return self.kda_heads * self.kda_head_dim

    def layer_type(self, layer: int) -> str:
        """The real cycle: layer i is DSA iff i % 4 == 3, else KDA."""
        return "deepseek_sparse_attention" if layer % 4 == 3 else "linear_attention"

    def is_moe(self, layer: int) -> bool:
        return layer >= self.num_dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe(i)]

    def check(self) -> None:
        quantized = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "kda_heads*kda_head_dim": self.kda_dim,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "attn_heads*qk_nope_head_dim": self.attn_heads * self.qk_nope_head_dim,
            "attn_heads*v_head_dim": self.attn_heads * self.v_head_dim,
            "index_heads*index_head_dim": self.index_heads * self.index_head_dim,
            "vocab_size": self.vocab_size,
        }
        for name, value in quantized.items():
            if value <= 0 or value % 128:
                raise ValueError(f"{name} = {value}: EXL3 needs a positive multiple of 128")
        if not 0 <= self.num_dense_layers <= self.num_layers or self.num_layers < 1:
            raise ValueError(
                f"num_dense_layers {self.num_dense_layers} must lie in [0, num_layers "
                f"{self.num_layers}] and num_layers must be >= 1"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"top-k {self.num_experts_per_tok} must lie in [1, experts {self.num_experts}]"
            )
        if not 1 <= self.bits <= 8 or not 1 <= self.head_bits <= 8:
            raise ValueError(f"bits {self.bits} / head_bits {self.head_bits} must be 1..8")
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk {self.index_topk} must divide by kpool {self.index_kpool}"
            )


# demo: the smallest widths exllamav3 takes (hidden 256; quantized dims are multiples of 128)
# and attention cut to 2 heads so that the CPU engine decodes fast; the MLA latent and head
# widths (kv_lora 512, nope/v 256) and the indexer head width stay real.
DEMO = SynthShape(
    name="demo",
    hidden_size=256,
    num_layers=8,
    num_dense_layers=2,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=4,
    num_shared_experts=1,
    vocab_size=2048,
    kda_heads=2,
    kda_head_dim=128,
    conv_kernel=4,
    attn_heads=2,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_heads=4,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=4,
    hc_mult=4,
    bits=3,
    head_bits=6,
    max_position_embeddings=65536,
)

# slice: GLM-5.3-Flash's real widths and attention sizes, fewer layers.
SLICE = SynthShape(
    name="slice",
    hidden_size=4096,
    num_layers=8,
    num_dense_layers=2,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_experts=288,
    num_experts_per_tok=8,
    num_shared_experts=1,
    vocab_size=2048,
    kda_heads=64,
    kda_head_dim=128,
    conv_kernel=4,
    attn_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    index_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_kpool=4,
    hc_mult=4,
    bits=3,
    head_bits=6,
    max_position_embeddings=1048576,
)

# deep: GLM-5.3-Flash's real 45-layer cycle (34 KDA + 11 DSA, 3 dense then 42 MoE) at the real
# widths, with fewer routed experts per layer than the real 288 so that it fits a benchmark
# host's disk (--experts); its non-MoE work per token is the real model's, but for the
# 2,048-token vocabulary (the real lm_head is 154,880 wide).
DEEP = replace(SLICE, name="deep", num_layers=45, num_dense_layers=3, num_experts=64)

PRESETS = {"demo": DEMO, "slice": SLICE, "deep": DEEP}


def preset(name: str, **overrides) -> SynthShape:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    shape = replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})
    shape.check()
    return shape
