"""Penalties, logit_bias and logprobs of the sampler against plain numpy references written
here from the published semantics (OpenAI's presence/frequency penalties, HF/vLLM's repetition
penalty, log-softmax), not from glm53's code."""

import math

import numpy as np
import pytest

from glm53._sample import penalize_row
from glm53.engine.logprobs import block_logprobs, log_softmax, top_k
from glm53.engine.sampling import SamplingParams, StreamSampler, sample


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's order: repetition on prompt + output tokens (divide a positive logit, multiply a
    negative one), then frequency (times the output count) and presence (once per output token)."""
    out = logits.astype(np.float64)
    seen = set(prompt) | set(output) if repetition != 1.0 else set(output)
    for token in seen:
        x = out[token]
        if repetition != 1.0:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(token)
        if count:
            x -= count * frequency + presence
        out[token] = x
    return out.astype(np.float32)


def reference_log_softmax(row):
    row = np.asarray(row, dtype=np.float64)
    return row - (row.max() + math.log(np.exp(row - row.max()).sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "presence, frequency, repetition",
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.3, 0.2, 1.3), (0, 0, 0.8)],
)
def test_sampler_penalties_match_the_numpy_reference(seed, presence, frequency, repetition):
    rng = np.random.default_rng(seed)
    vocab = 97
    prompt = rng.integers(0, vocab, 12).tolist()
    params = SamplingParams(
        temperature=0.0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
    )
    sampler = StreamSampler(params, num_logprobs=5, prompt_ids=prompt)
    output: list[int] = []
    for _ in range(30):
        logits = rng.normal(0, 3, (1, vocab)).astype(np.float32)
        expected = reference_penalties(logits[0], prompt, output, presence, frequency, repetition)
        token = sample(logits, [sampler])[0]
        assert token == int(np.argmax(expected)), (seed, output)
        lp = reference_log_softmax(expected)
        assert sampler.last_logprob.logprob == pytest.approx(lp[token], abs=1e-9)
        assert sampler.last_logprob.top_ids == np.argsort(-lp, kind="stable")[:5].tolist()
        output.append(token)


def test_penalize_row_is_exactly_the_reference_in_float32():
    rng = np.random.default_rng(7)
    row = rng.normal(0, 2, 50).astype(np.float32)
    ids = np.array([3, 10, 11, 40], dtype=np.int64)
    counts = np.array([0, 1, 4, 2], dtype=np.int64)
    expected = reference_penalties(row, [3], [10, 11, 11, 11, 11, 40, 40], 0.4, 0.25, 1.2)
    penalize_row(row, ids, counts, 4, 0.4, 0.25, 1.2)
    assert row.tobytes() == expected.tobytes()


def test_penalize_row_refuses_an_id_outside_the_row():
    row = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="outside"):
        penalize_row(row, np.array([4], dtype=np.int64), np.array([1], dtype=np.int64), 1, 1, 0, 1)


def test_logit_bias_is_added_before_the_draw_and_the_logprobs():
    logits = np.log(np.array([[0.5, 0.3, 0.2]], dtype=np.float32))
    sampler = StreamSampler(SamplingParams(temperature=0.0, logit_bias=((2, 5.0),)), num_logprobs=1)
    assert sample(logits, [sampler]) == [2]
    biased = logits[0].astype(np.float64) + np.array([0, 0, 5.0])
    assert sampler.last_logprob.logprob == pytest.approx(reference_log_softmax(biased)[2])


def test_a_processed_row_leaves_the_engine_logits_untouched():
    logits = np.zeros((2, 8), dtype=np.float32)
    biased = StreamSampler(SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)))
    plain = StreamSampler(SamplingParams(temperature=0.0))
    assert sample(logits, [biased, plain]) == [5, 0]
    assert not logits.any()


def test_seeded_draws_with_penalties_repeat():
    logits = np.zeros((1, 16), dtype=np.float32)

    def run():
        sampler = StreamSampler(SamplingParams(seed=11, frequency_penalty=0.5))
        return [sample(logits, [sampler])[0] for _ in range(20)]

    assert run() == run()


def test_log_softmax_and_top_k_follow_the_definition():
    rng = np.random.default_rng(3)
    row = rng.normal(0, 4, 300).astype(np.float32)
    np.testing.assert_allclose(log_softmax(row), reference_log_softmax(row), atol=1e-12)
    ids, values = top_k(log_softmax(row), 4)
    assert ids == np.argsort(-row, kind="stable")[:4].tolist()
    assert values == sorted(values, reverse=True)
    assert top_k(np.zeros(5), 3) == ([0, 1, 2], [0.0, 0.0, 0.0])  # ties by id


def test_block_logprobs_score_each_next_token():
    rng = np.random.default_rng(4)
    block = rng.normal(0, 1, (3, 20)).astype(np.float32)
    entries = block_logprobs(block, [5, 7], 2)
    assert [e.token_id for e in entries] == [5, 7]
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(reference_log_softmax(block[i])[e.token_id])
        assert len(e.top_ids) == 2


def test_the_checkpoints_penalties_are_the_defaults_and_a_request_overrides_them(tmp_path):
    from glm53.api.generation import sampling_params
    from glm53.engine.tokenizer import read_generation_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.3}'
    )
    defaults = read_generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.3}
    base = dict(temperature=None, top_p=None, top_k=None, min_p=None, seed=None)
    params = sampling_params(defaults, **base)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.1,
        0.3,
        0.0,
    )
    params = sampling_params(defaults, **base, repetition_penalty=1.0, presence_penalty=0.0)
    assert not params.has_penalties
