import collections
import math

import pytest
import torch

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
