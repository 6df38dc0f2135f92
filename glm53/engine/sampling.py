"""Per-stream token sampling from a step's logits: temperature, top_k, top_p, min_p, seed.

Each stream has its own seeded torch.Generator, so a seed gives the same tokens whatever else runs
in the same step. A temperature of 0 (or top_k 1) means greedy: the argmax, no randomness.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    _generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    row = row.float() / p.temperature
    ids = None
    if 0 < p.top_k < row.numel():
        row, ids = torch.topk(row, p.top_k)  # sorted, largest first
    elif p.top_p < 1.0:
        row, ids = torch.sort(row, descending=True)
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    if p.top_p < 1.0:
        # probs are sorted here: keep the smallest prefix whose mass reaches top_p
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(mass_before < p.top_p * probs.sum(), probs, 0.0)
    choice = int(torch.multinomial(probs, 1, generator=gen))
    return int(ids[choice]) if ids is not None else choice


def sample(logits: torch.Tensor, samplers: Sequence[StreamSampler]) -> list[int]:
    """One token id per row of `logits` [rows, vocab], row i drawn with samplers[i]."""
    if logits.shape[0] != len(samplers):
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(samplers)} streams")
    greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy]
    out = [0] * len(samplers)
    if len(greedy) == len(samplers):
        return logits.argmax(dim=-1).tolist()
    if greedy:
        picks = logits[greedy].argmax(dim=-1).tolist()
        for i, token in zip(greedy, picks, strict=True):
            out[i] = token
    for i, s in enumerate(samplers):
        if not s.params.is_greedy:
            out[i] = _sample_row(logits[i], s.params, s.generator(logits.device))
    return out
