"""Routing skew for synthetic checkpoints: the target popularity curve, calibration of the
router bias (`e_score_correction_bias`) to it, and measurement of a popularity curve.

GLM-5.3-Flash's decode picks are skewed (facts: exllamav3.md §4.4): per MoE layer the hottest
25 % of the experts serve 73.5 % of the picks, 50 % serve 90.7 % and 75 % serve 98.4 %.
Random router weights pick every expert about equally often, so `glm53` mode gives every
expert a target pick rate on a smooth curve through those points, with the hot experts drawn
per layer, and fits the selection bias until the router's picks follow it.

The router math is the real one (sigmoid scores, the bias added for selection only, top-k;
n_group = 1, so there is no group limit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# (fraction of experts, fraction of picks they serve), hottest first
GLM53_CURVE = ((0.25, 0.735), (0.50, 0.907), (0.75, 0.984))
CURVE_FRACTIONS = tuple(f for f, _ in GLM53_CURVE)
ROUTING_MODES = ("uniform", "glm53")


@dataclass(frozen=True, slots=True)
class PopularityCurve:
    """Share of picks served by the hottest 25/50/75 % of a layer's experts."""

    shares: tuple[float, float, float]
    num_picks: int

    def max_error(self, target: tuple[float, float, float]) -> float:
        return max(abs(a - b) for a, b in zip(self.shares, target, strict=True))

    def __str__(self) -> str:
        pts = " ".join(
            f"{int(f * 100)}%->{s * 100:.1f}%"
            for f, s in zip(CURVE_FRACTIONS, self.shares, strict=True)
        )
        return f"{pts} ({self.num_picks} picks)"


def target_shares(mode: str) -> tuple[float, float, float]:
    if mode == "glm53":
        return tuple(s for _, s in GLM53_CURVE)
    if mode == "uniform":
        return CURVE_FRACTIONS
    raise ValueError(f"routing mode {mode!r} is not one of {ROUTING_MODES}")


def _monotone_cubic(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fritsch-Carlson monotone cubic interpolation of increasing data (ys non-decreasing)."""
    h = np.diff(xs)
    delta = np.diff(ys) / h
    d = np.zeros_like(ys)
    for i in range(1, len(xs) - 1):
        if delta[i - 1] * delta[i] > 0:
            w1, w2 = 2 * h[i] + h[i - 1], h[i] + 2 * h[i - 1]
            d[i] = (w1 + w2) / (w1 / delta[i - 1] + w2 / delta[i])
    d[0] = max(0.0, ((2 * h[0] + h[1]) * delta[0] - h[0] * delta[1]) / (h[0] + h[1]))
    d[-1] = max(0.0, ((2 * h[-1] + h[-2]) * delta[-1] - h[-1] * delta[-2]) / (h[-1] + h[-2]))
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    t = (x - xs[i]) / h[i]
    h00, h10 = 2 * t**3 - 3 * t**2 + 1, t**3 - 2 * t**2 + t
    h01, h11 = -2 * t**3 + 3 * t**2, t**3 - t**2
    return h00 * ys[i] + h10 * h[i] * d[i] + h01 * ys[i + 1] + h11 * h[i] * d[i + 1]


def target_pick_rates(mode: str, num_experts: int, top_k: int) -> np.ndarray:
    """Per-rank pick probability (hottest first); sums to top_k, each in (0, 1]."""
    if mode == "uniform":
        return np.full(num_experts, top_k / num_experts)
    pts = ((0.0, 0.0),) + GLM53_CURVE + ((1.0, 1.0),)
    xs = np.array([p[0] for p in pts])
    ys = np.array([p[1] for p in pts])
    grid = np.arange(num_experts + 1) / num_experts
    cumulative = _monotone_cubic(xs, ys, grid)
    shares = np.maximum(np.diff(cumulative), 1e-4)
    rates = top_k * shares / shares.sum()
    if rates.max() > 1.0:
        raise ValueError(
            f"{num_experts} experts with top-{top_k} cannot follow the glm53 curve: the hottest "
            f"expert would need pick rate {rates.max():.2f} > 1; use more experts"
        )
    return rates


def hot_order(num_experts: int, seed: int, layer: int) -> np.ndarray:
    """Expert ids hottest first: a different permutation per layer (and per seed)."""
    rng = np.random.default_rng([seed, 0x407, layer])
    return rng.permutation(num_experts)


def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(x W^T) in float32: [tokens, experts]."""
    return torch.sigmoid(x.detach().float() @ weight.detach().float().t())


def select(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k expert ids on scores + bias (selection only): [tokens, top_k]."""
    return torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices


def pick_counts(picks: torch.Tensor, num_experts: int) -> np.ndarray:
    return torch.bincount(picks.reshape(-1), minlength=num_experts).numpy()


def fit_bias(
    scores: torch.Tensor,
    target_rates: np.ndarray,
    top_k: int,
    steps: int = 100,
) -> torch.Tensor:
    """Bias [experts] so that topk(scores + bias) picks expert e at rate target_rates[e].

    Fixed-point iteration on the empirical pick rates of the given score rows, with a step
    that shrinks so that it settles instead of oscillating between ties."""
    num_tokens, num_experts = scores.shape
    target = torch.from_numpy(np.asarray(target_rates, dtype=np.float64))
    spread = float(scores.std())
    bias = torch.zeros(num_experts, dtype=torch.float64)
    for step in range(steps):
        picks = select(scores, bias.float(), top_k)
        rates = torch.bincount(picks.reshape(-1), minlength=num_experts).double() / num_tokens
        lr = 2.0 * spread * (0.02 + 0.98 * (1.0 - step / steps))
        bias += (
            lr
            * (target - rates)
            / torch.clamp(target, min=1.0 / num_tokens)
            * (top_k / num_experts)
        )
        bias -= bias.mean()
    return bias.float()


def popularity_curve(counts: np.ndarray) -> PopularityCurve:
    """Share of all picks taken by the hottest 25/50/75 % of experts (sorted by count)."""
    counts = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no picks to measure")
    n = len(counts)
    cum = np.cumsum(counts)
    shares = tuple(float(cum[max(1, round(f * n)) - 1] / total) for f in CURVE_FRACTIONS)
    return PopularityCurve(shares, total)


def reuse_rate(picks: torch.Tensor) -> float:
    """Fraction of token t's picks that token t-1 also picked (decode locality)."""
    if picks.shape[0] < 2:
        return 0.0
    prev, cur = picks[:-1], picks[1:]
    hit = (cur.unsqueeze(-1) == prev.unsqueeze(-2)).any(-1)
    return float(hit.float().mean())


def hidden_like_inputs(num_tokens: int, hidden_size: int, seed: int, layer: int) -> torch.Tensor:
    """Stand-in router inputs when the model cannot be run: RMS-normalized Gaussian rows with
    token-to-token correlation (AR(1), 0.6), like post-norm hidden states of a decode."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    noise = torch.randn(num_tokens, hidden_size, generator=gen)
    x = noise.clone()
    for t in range(1, num_tokens):
        x[t] = 0.6 * x[t - 1] + 0.8 * noise[t]
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True))


def stand_in_decode_picks(
    mode: str,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    num_tokens: int,
    seed: int,
    layer: int,
    num_streams: int = 1,
    fit_tokens: int = 1024,
) -> np.ndarray:
    """One MoE layer's decode picks on stand-in router inputs, as a synthetic checkpoint's
    router makes them: a random gate weight (std hidden_size**-0.5), the selection bias fitted
    to `mode`'s curve on `fit_tokens` stand-in rows, then top-k over fresh stand-in rows (AR(1),
    so a token reuses many of the previous token's picks). Returns int64
    [num_streams, num_tokens, top_k], each stream its own rows."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * layer + 1)
    weight = torch.randn(num_experts, hidden_size, generator=gen) * hidden_size**-0.5
    target = np.empty(num_experts)
    target[hot_order(num_experts, seed, layer)] = target_pick_rates(mode, num_experts, top_k)
    fit_x = hidden_like_inputs(fit_tokens, hidden_size, seed, layer)
    bias = fit_bias(router_scores(fit_x, weight), target, top_k)
    out = np.empty((num_streams, num_tokens, top_k), dtype=np.int64)
    for stream in range(num_streams):
        x = hidden_like_inputs(num_tokens, hidden_size, seed + 1 + stream, layer)
        out[stream] = select(router_scores(x, weight), bias, top_k).numpy()
    return out
