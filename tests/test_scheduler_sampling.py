import collections
import math

import numpy as np
import pytest
import torch

from glm53._sample import FILTERED, GREEDY, PLAIN, sample_rows
from glm53.engine.sampling import SamplingParams, StreamSampler, sample

# probabilities 0.5, 0.3, 0.15, 0.05
LOGITS = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)])


def draws(params: SamplingParams, n: int = 2000) -> collections.Counter:
    sampler = StreamSampler(params)
    return collections.Counter(sample(LOGITS[None, :], [sampler])[0] for _ in range(n))


def test_temperature_zero_and_top_k_one_are_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 5.0]])
    greedy = [
        StreamSampler(SamplingParams(temperature=0.0)),
        StreamSampler(SamplingParams(top_k=1)),
    ]
    assert sample(logits, greedy) == [1, 2]


def test_plain_sampling_follows_the_softmax():
    counts = draws(SamplingParams(temperature=1.0, seed=1), n=4000)
    for token, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_top_k_keeps_the_k_most_likely():
    assert set(draws(SamplingParams(top_k=2, seed=2))) == {0, 1}


@pytest.mark.parametrize(
    "top_p, kept", [(0.5, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    assert set(draws(SamplingParams(top_p=top_p, seed=3))) == kept


def test_min_p_drops_tokens_below_a_share_of_the_top_one():
    assert set(draws(SamplingParams(min_p=0.2, seed=4))) == {0, 1, 2}  # threshold 0.1
    assert set(draws(SamplingParams(min_p=0.7, seed=4))) == {0}  # threshold 0.35


def test_seed_fixes_the_sequence_and_greedy_rows_mix_with_sampled_ones():
    logits = LOGITS.repeat(3, 1)

    def run(seed):
        samplers = [
            StreamSampler(SamplingParams(seed=seed)),
            StreamSampler(SamplingParams(temperature=0.0)),
        ]
        return [sample(logits[:2], samplers) for _ in range(50)]

    first, again, other = run(7), run(7), run(8)
    assert first == again != other
    assert {pair[1] for pair in first} == {0}


def test_row_count_must_match_the_samplers():
    with pytest.raises(ValueError, match="logits has 1 rows for 2 streams"):
        sample(LOGITS[None, :], [StreamSampler(SamplingParams()), StreamSampler(SamplingParams())])


class RowSampler:
    """What glm53._sample.sample_rows reads from a sampler, with fixed uniforms."""

    def __init__(self, mode, temperature=0.0, min_p=0.0, uniforms=()):
        self.mode, self.temperature, self.min_p = mode, temperature, min_p
        self._uniforms = list(uniforms)

    def uniform(self):
        return self._uniforms.pop(0)

    def draw_filtered(self, row):
        return -7  # marks the row as drawn here


def reference_draw(row, temperature, min_p, u):
    """pyx/sample.h's draw, step by step in Python doubles (math.exp is the same libm exp)."""
    xs = [float(x) * (1.0 / temperature) for x in row]
    top = max(xs)
    weights = [math.exp(x - top) for x in xs]
    weights = [0.0 if w < min_p else w for w in weights]
    target, running = u * sum(weights), 0.0
    for i, w in enumerate(weights):
        running += w
        if running > target:
            return i
    return max(i for i, w in enumerate(weights) if w > 0)


def test_native_draw_is_the_inverse_cdf_of_the_softmax():
    rng = np.random.default_rng(5)
    for temperature, min_p in [(1.0, 0.0), (0.7, 0.0), (1.3, 0.05), (0.2, 0.5)]:
        logits = (rng.standard_normal((40, 97)) * 3).astype(np.float32)
        us = rng.random(40).tolist()
        samplers = [RowSampler(PLAIN, temperature, min_p, [u]) for u in us]
        expected = [
            reference_draw(row, temperature, min_p, u) for row, u in zip(logits, us, strict=True)
        ]
        assert sample_rows(logits, samplers) == expected


def test_greedy_rows_take_the_first_maximum_and_a_nan_counts_as_one():
    nan, inf = float("nan"), float("inf")
    logits = np.array(
        [
            [1, 5, 5, 2],
            [nan, 1, 2, 3],
            [1, 2, nan, nan],
            [-inf, -inf, -inf, -inf],
            [0, inf, 1, inf],
        ],
        dtype=np.float32,
    )
    expected = np.argmax(logits, axis=1).tolist()  # numpy's rule: first maximum, NaN wins
    assert expected == [1, 0, 2, 0, 1]
    assert sample_rows(logits, [RowSampler(GREEDY) for _ in range(5)]) == expected


def test_a_draw_without_a_finite_maximum_falls_back_to_the_argmax():
    nan, inf = float("nan"), float("inf")
    logits = np.array([[-inf, -inf, -inf], [1, nan, 2], [0, inf, 1]], dtype=np.float32)
    samplers = [RowSampler(PLAIN, 1.0, 0.0, [0.9]) for _ in range(3)]
    assert sample_rows(logits, samplers) == [0, 1, 1]


def test_rows_of_any_dtype_and_layout_draw_as_float32():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((3, 2, 50)).astype(np.float32)[:, 1, :]  # not contiguous
    us = [0.1, 0.5, 0.9]

    def draw(x):
        return sample_rows(x, [RowSampler(PLAIN, 0.8, 0.0, [u]) for u in us])

    expected = [reference_draw(row, 0.8, 0.0, u) for row, u in zip(logits, us, strict=True)]
    assert draw(logits) == draw(np.ascontiguousarray(logits)) == expected
    assert draw(logits.astype(np.float64)) == expected  # float32 values, so nothing is lost


def test_over_64_rows_and_over_a_million_logits():
    # over 64 rows (parameters on the heap) and over 2**20 logits (the GIL is released)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((300, 4096)).astype(np.float32)
    us = rng.random(300).tolist()
    samplers = [
        RowSampler(GREEDY) if i % 3 == 0 else RowSampler(PLAIN, 1.0, 0.0, [us[i]])
        for i in range(300)
    ]
    got = sample_rows(logits, samplers)
    for i in range(0, 300, 3):
        assert got[i] == int(np.argmax(logits[i]))
    for i in (1, 2, 100, 299):
        assert got[i] == reference_draw(logits[i], 1.0, 0.0, us[i])


def test_filtered_rows_are_drawn_by_their_sampler():
    logits = np.zeros((2, 4), dtype=np.float32)
    assert sample_rows(logits, [RowSampler(GREEDY), RowSampler(FILTERED)]) == [0, -7]


def test_uniforms_are_the_generators_sequence_one_per_token():
    sampler = StreamSampler(SamplingParams(seed=9))
    generator = np.random.Generator(np.random.PCG64(9))
    assert [sampler.uniform() for _ in range(150)] == [generator.random() for _ in range(150)]
