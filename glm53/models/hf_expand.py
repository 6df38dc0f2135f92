"""Expanded DSA keys and values kept with a transformers cache instead of recomputed every step.

transformers' `Glm5NextTextAttention` caches the compressed MLA latents and, on every forward,
expands the whole latent cache through `kv_b_proj` into per-head keys and values
(`expand_kv`). A decode step then redoes `positions x kv_lora_rank x heads x (nope + v)` work for
positions whose expansion has not changed. `memoize_expansion` wraps each DSA layer's
`expand_kv` so that the expansion of positions already seen is kept with the cache layer
(the `DynamicIndexedLayer` of that slot) and only the new positions go through `kv_b_proj`.

The attention itself (indexer, top-k mask, SDPA) stays transformers' own; the keys and values it
gets are the same rows `kv_b_proj` gives, computed once per position (a row of a GEMM rounds the
same way whichever other rows share the call, up to the BLAS kernel's blocking: within fp32
rounding of the full recompute).

A memo is dropped, and the layer expands its whole cache as transformers does, when its
latents no longer extend the memo's (the cache was cropped or replaced) or when it would hold
more than the layer's `glm53_expand_max_bytes`.
"""

from __future__ import annotations

import torch

DEFAULT_MAX_BYTES = 128 << 20  # per DSA layer of one cache


class ExpandedKV:
    """The expanded keys [B, H, capacity, Dk] and values [B, H, capacity, Dv] of positions
    [0, length) of one DSA layer of one cache, and the latent row length - 1 they came from."""

    __slots__ = ("keys", "values", "length", "last_latent")

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self.last_latent: torch.Tensor | None = None

    def extends(self, kv_nope: torch.Tensor) -> bool:
        """Whether kv_nope's first `length` positions are the ones this memo expanded."""
        if self.length == 0:
            return True
        if self.length > kv_nope.shape[2] or self.keys.shape[0] != kv_nope.shape[0]:
            return False
        return torch.equal(self.last_latent, kv_nope[:, :, self.length - 1])

    def append(self, keys: torch.Tensor, values: torch.Tensor, kv_nope: torch.Tensor) -> None:
        total = self.length + keys.shape[2]
        if self.keys is None or total > self.keys.shape[2]:
            capacity = max(total, 2 * (self.keys.shape[2] if self.keys is not None else 0), 64)
            self.keys = self._grow(self.keys, keys, capacity)
            self.values = self._grow(self.values, values, capacity)
        self.keys[:, :, self.length : total].copy_(keys)
        self.values[:, :, self.length : total].copy_(values)
        self.length = total
        self.last_latent = kv_nope[:, :, total - 1].clone()

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, _, d = like.shape
        new = like.new_empty(b, h, capacity, d)
        if old is not None and self.length:
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        return new

    def bytes_for(self, positions: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        per_position = (keys.shape[1] * keys.shape[3] + values.shape[1] * values.shape[3]) * (
            keys.shape[0] * keys.element_size()
        )
        return positions * per_position


def memoize_expansion(model, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Wrap every DSA attention of a Glm5NextTextModel (see the module docstring); returns how
    many layers were wrapped."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    wrapped = 0
    for layer in model.layers:
        attn = layer.self_attn
        if isinstance(attn, Glm5NextTextAttention):
            _wrap(attn, max_bytes)
            wrapped += 1
    return wrapped


def _wrap(attn, max_bytes: int) -> None:
    forward, expand_kv = attn.forward, attn.expand_kv
    attn.glm53_expand_max_bytes = max_bytes
    current: list = [None]  # the cache layer of the forward in progress

    def forward_with_cache(*args, **kwargs):
        cache = kwargs.get("cache")
        current[0] = cache.layers[attn.layer_idx] if cache is not None else None
        try:
            return forward(*args, **kwargs)
        finally:
            current[0] = None

    def expand_kv_memo(kv_nope: torch.Tensor, k_rot: torch.Tensor):
        cache_layer = current[0]
        if cache_layer is None:
            return expand_kv(kv_nope, k_rot)
        memo = getattr(cache_layer, "_glm53_expanded", None)
        if memo is None or not memo.extends(kv_nope):
            memo = ExpandedKV()
        seen, total = memo.length, kv_nope.shape[2]
        keys, values = expand_kv(kv_nope[:, :, seen:], k_rot[:, :, seen:])
        if memo.bytes_for(total, keys, values) > attn.glm53_expand_max_bytes:
            cache_layer._glm53_expanded = None
            return expand_kv(kv_nope, k_rot) if seen else (keys, values)
        memo.append(keys, values, kv_nope)
        cache_layer._glm53_expanded = memo
        return memo.keys[:, :, :total], memo.values[:, :, :total]

    attn.forward = forward_with_cache
    attn.expand_kv = expand_kv_memo
