"""Per-stream token sampling from a step's logits: temperature, top_k, top_p, min_p, seed.

Sampling runs in numpy on the host: a few rows per step, and numpy's single-threaded argmax is
about 100x faster than torch's on a busy 2-core host (58 us vs 6.5 ms for 64 x 2048 logits).
Each stream has its own seeded generator, so a seed gives the same tokens whatever else runs in
the same step. A temperature of 0 (or top_k 1) means greedy: the argmax, no randomness.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one stream picks its tokens. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@dataclass(slots=True)
class StreamSampler:
    """The sampling state of one stream: its params and its random generator (made on first use)."""

    params: SamplingParams
    seed: int = -1
    _rng: np.random.Generator | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.seed &= (1 << 64) - 1  # negative request seeds map onto the generator's range

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng


def _sample_row(row: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    row = row.astype(np.float64) / p.temperature
    ids = None
    if 0 < p.top_k < row.size:
        ids = np.argpartition(row, -p.top_k)[-p.top_k :]
        ids = ids[np.argsort(-row[ids], kind="stable")]  # largest first
        row = row[ids]
    elif p.top_p < 1.0:
        ids = np.argsort(-row, kind="stable")
        row = row[ids]
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    if p.top_p < 1.0:
        # probs are sorted here: keep the smallest prefix whose mass reaches top_p
        mass_before = np.cumsum(probs) - probs
        probs[mass_before >= p.top_p * probs.sum()] = 0.0
    cumulative = np.cumsum(probs)
    choice = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    choice = min(choice, row.size - 1)
    return int(ids[choice]) if ids is not None else choice


def sample(logits: torch.Tensor | np.ndarray, samplers: Sequence[StreamSampler]) -> list[int]:
    """One token id per row of `logits` [rows, vocab], row i drawn with samplers[i]."""
    if logits.shape[0] != len(samplers):
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(samplers)} streams")
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().float().cpu().numpy()
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy]
    if len(greedy) == len(samplers):
        return logits.argmax(axis=1).tolist()
    out = [0] * len(samplers)
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(axis=1).tolist(), strict=True):
            out[i] = token
    for i, s in enumerate(samplers):
        if not s.params.is_greedy:
            out[i] = _sample_row(logits[i], s.params, s.rng)
    return out
