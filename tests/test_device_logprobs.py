"""The GPU engine's on-device logprobs (glm53.engine.logprobs.device_logprobs, run here on torch's CPU
device) against a pure-Python fp64 reference (exactly summed) and glm53.engine.logprobs, the host
definition the CPU engine and the host sampler use: the same token logprob, the same top ids in the same order (ties by the smaller id) and the
same values to float64 rounding, on rows with ties at and across the k-th place and masked
(-inf) tokens."""

import math

import numpy as np
import pytest
import torch

from glm53.engine.logprobs import device_logprobs, log_softmax, token_logprob, unpack_logprobs


def _rows():
    rng = np.random.default_rng(3)
    plain = rng.standard_normal(4096).astype(np.float32) * 4
    # fp16-rounded logits, as exllamav3's head gives them: many exact ties
    coarse = np.round(rng.standard_normal(4096) * 64).astype(np.float32) / 16
    tie_at_k = plain.copy()
    order = np.argsort(-plain, kind="stable")
    tie_at_k[order[2:9]] = plain[order[2]]  # seven tokens share the 3rd place
    masked = plain.copy()
    masked[order[:3]] = -np.inf  # a grammar or logit mask removed the top three
    return {"plain": plain, "coarse": coarse, "tie_at_k": tie_at_k, "masked": masked}


def _reference(row: np.ndarray, token: int, k: int):
    """Pure Python, exactly summed (math.fsum) fp64 log-softmax and the k largest by (value
    desc, id asc): the definition, with neither numpy nor torch."""
    xs = [float(x) for x in row]
    top = max(xs)
    log_z = top + math.log(math.fsum(math.exp(x - top) for x in xs))
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], i))[:k]
    return xs[token] - log_z, order, [xs[i] - log_z for i in order]


@pytest.mark.parametrize("name", list(_rows()))
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_device_logprobs_match_the_host_definition(name, k):
    row = _rows()[name]
    token = int(np.argmax(row))
    want = token_logprob(log_softmax(row), token, k)
    packed = device_logprobs(torch.from_numpy(row).view(1, 1, -1), torch.tensor([[token]]), k)
    got = unpack_logprobs(packed, token, k)
    ref_lp, ref_ids, ref_values = _reference(row, token, k)
    assert got.top_ids == ref_ids
    np.testing.assert_allclose(got.logprob, ref_lp, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.top_logprobs, ref_values, rtol=1e-12, atol=1e-12)
    assert got.token_id == want.token_id
    assert got.top_ids == want.top_ids
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-12, atol=1e-12)


def test_a_drawn_token_outside_the_top_k_has_its_own_logprob():
    row = _rows()["plain"]
    token = int(np.argmin(row))
    packed = device_logprobs(torch.from_numpy(row), torch.tensor(token), 5)
    got = unpack_logprobs(packed, token, 5)
    want = token_logprob(log_softmax(row), token, 5)
    assert token not in got.top_ids
    np.testing.assert_allclose(got.logprob, want.logprob, rtol=1e-12)
