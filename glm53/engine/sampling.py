"""Per-stream token sampling from a step's logits: temperature, top_k, top_p, min_p, seed.

Sampling runs on the host, on the engine thread between two steps, so its cost is added to every
token, and it runs with caches cold after the engine thread's wait for the step. Greedy rows and
plain draws (temperature, min_p) take one call into C for the whole step (glm53._sample,
pyx/sample.h): on a busy 2-core host, after a 40 ms step, one greedy stream went from about 50 us
(numpy argmax) to 25 us and one temperature draw from about 250 us (a dozen numpy calls) to 55 us.
Rows with top_k or top_p, which need a sort, use numpy (`_sample_row`). (numpy's argmax was
already about 100x faster than torch's there: 58 us vs 6.5 ms for 64 x 2048 logits.)
Each stream has its own seeded generator, one uniform draw per sampled token, so a seed gives the
same tokens whatever else runs in the same step. A temperature of 0 (or top_k 1) means greedy:
the argmax, no randomness.

A stream with penalties, logit_bias, logprobs or a grammar is "processed": its row is copied and
changed before the draw (penalties in C, glm53._sample.penalize_row), its logprobs are taken from
the changed row (glm53.engine.logprobs says which logits), a grammar (glm53.engine.grammar)
masks it last, and `accept` records the drawn token.
A step with no processed stream does none of this.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from glm53._sample import FILTERED, GREEDY, PLAIN, penalize_row, sample_rows
from glm53.engine.logprobs import TokenLogprob, log_softmax, token_logprob

if TYPE_CHECKING:
    from glm53.engine.grammar import Constraint

GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one stream picks its tokens. top_k <= 0 and top_p = 1 and min_p = 0 disable those
    filters; presence_penalty = frequency_penalty = 0 and repetition_penalty = 1 disable the
    penalties (semantics in pyx/sample.h); logit_bias adds (token id, bias) to the logits."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# A stream's uniforms are drawn this many at a time: the same sequence as one draw per token
# (a generator's batch and single draws read the same stream), for one generator call in 64.
_UNIFORM_BATCH = 64


@dataclass(slots=True)
class StreamSampler:
    """The sampling state of one stream: its params, its random generator (made on first use),
    and what glm53._sample.sample_rows reads: `mode` (GREEDY, PLAIN: temperature and min_p, in
    C, or FILTERED: top_k or top_p, `draw_filtered` in numpy) and the PLAIN draw's floats.

    `num_logprobs` None: no logprobs; k >= 0: each sampled token's logprob and the k most
    likely tokens (in `last_logprob` after `accept`). `prompt_ids` seed the repetition penalty.
    `constraint` (a glm53.engine.grammar.Constraint) masks the row after the logprobs."""

    params: SamplingParams
    seed: int = -1
    num_logprobs: int | None = None
    prompt_ids: InitVar[Sequence[int]] = ()
    constraint: Constraint | None = None
    _rng: np.random.Generator | None = field(default=None, repr=False)
    mode: int = field(default=GREEDY, init=False)
    temperature: float = field(default=0.0, init=False)
    min_p: float = field(default=0.0, init=False)
    is_processed: bool = field(default=False, init=False)
    last_logprob: TokenLogprob | None = field(default=None, init=False)
    _uniforms: list[float] = field(default_factory=list, init=False, repr=False)
    _seen: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _seen_ids: np.ndarray | None = field(default=None, init=False, repr=False)
    _seen_counts: np.ndarray | None = field(default=None, init=False, repr=False)
    _bias_ids: np.ndarray | None = field(default=None, init=False, repr=False)
    _bias_values: np.ndarray | None = field(default=None, init=False, repr=False)
    _logprobs: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self, prompt_ids: Sequence[int]):
        if self.seed < 0:
            self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.seed &= (1 << 64) - 1  # negative request seeds map onto the generator's range
        p = self.params
        if p.is_greedy:
            self.mode = GREEDY
        elif 0 < p.top_k or p.top_p < 1.0:
            self.mode = FILTERED
        else:
            self.mode = PLAIN
            self.temperature, self.min_p = float(p.temperature), float(p.min_p)
        self.is_processed = bool(
            p.has_penalties
            or p.logit_bias
            or self.num_logprobs is not None
            or self.constraint is not None
        )
        if p.logit_bias:
            self._bias_ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
            self._bias_values = np.array([b for _, b in p.logit_bias], dtype=np.float32)
        if p.has_penalties:
            self._seen_ids = np.zeros(64, dtype=np.int64)
            self._seen_counts = np.zeros(64, dtype=np.int64)
            if p.repetition_penalty != 1.0:  # prompt tokens count for it, with 0 output uses
                for token in dict.fromkeys(prompt_ids):
                    self._see(token, 0)

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng

    def uniform(self) -> float:
        """The stream's next uniform draw in [0, 1): rng.random(), one per sampled token."""
        if not self._uniforms:
            self._uniforms = self.rng.random(_UNIFORM_BATCH).tolist()[::-1]
        return self._uniforms.pop()

    def draw_filtered(self, row: np.ndarray) -> int:
        return _sample_row(row, self.params, self.uniform())

    def _see(self, token: int, uses: int) -> None:
        index = self._seen.get(token)
        if index is None:
            index = self._seen[token] = len(self._seen)
            if index == self._seen_ids.size:
                self._seen_ids = np.concatenate([self._seen_ids, np.zeros_like(self._seen_ids)])
                self._seen_counts = np.concatenate(
                    [self._seen_counts, np.zeros_like(self._seen_counts)]
                )
            self._seen_ids[index] = token
        self._seen_counts[index] += uses

    def process(self, row: np.ndarray) -> None:
        """Change a processed stream's row of logits (float32 [vocab], in place) before the draw."""
        p = self.params
        if self._seen:
            penalize_row(
                row,
                self._seen_ids,
                self._seen_counts,
                len(self._seen),
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            )
        if self._bias_ids is not None:
            row[self._bias_ids] += self._bias_values
        if self.num_logprobs is not None:
            self._logprobs = log_softmax(row)
        if self.constraint is not None:
            self.constraint.mask(row)

    def accept(self, token: int) -> None:
        """Record the token drawn from the row `process` changed."""
        if self._logprobs is not None:
            self.last_logprob = token_logprob(self._logprobs, token, self.num_logprobs)
            self._logprobs = None
        if self._seen_ids is not None:
            self._see(token, 1)
        if self.constraint is not None:
            self.constraint.accept(token)


def _sample_row(row: np.ndarray, p: SamplingParams, u: float) -> int:
    """One draw with top_k or top_p (sorted candidates) at the uniform `u`, in numpy."""
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
    choice = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    choice = min(choice, row.size - 1)
    return int(ids[choice]) if ids is not None else choice


def sample(logits: torch.Tensor | np.ndarray, samplers: Sequence[StreamSampler]) -> list[int]:
    """One token id per row of `logits` [rows, vocab], row i drawn with samplers[i]; processed
    samplers change a copy of their row first and `accept` the token after."""
    if type(logits) is not np.ndarray:  # an ndarray skips the torch check (cold, so not cheap)
        if isinstance(logits, torch.Tensor):
            logits = logits.detach().float().cpu().numpy()
        else:
            logits = np.asarray(logits)
    processed = [r for r, s in enumerate(samplers) if s.is_processed]
    if not processed:
        return sample_rows(logits, samplers)
    logits = np.array(logits, dtype=np.float32, order="C")  # a copy: the engine's may be reused
    for r in processed:
        samplers[r].process(logits[r])
    tokens = sample_rows(logits, samplers)
    for r in processed:
        samplers[r].accept(tokens[r])
    return tokens
