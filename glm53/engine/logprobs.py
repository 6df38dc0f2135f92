"""Log-probabilities of tokens from a step's logits: the sampled token's, a prompt token's, and
the k most likely tokens at the same position, as the API's logprobs fields need them.

Which logits: the log-softmax of the logits the sampler drew from, after logit_bias and the
repetition, frequency and presence penalties, and before temperature, top-k, top-p, min-p and
a structured-output grammar's mask (so the sampled token always has a logprob, and a greedy
request's logprobs are the model's). A request without bias or penalties therefore gets the
model's own (vLLM's default "raw") logprobs; prompt logprobs are always the model's own.
Computed in float64 from the float32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class TokenLogprob:
    """One position: `token_id` and its `logprob`, and the `top_ids` / `top_logprobs` of the
    k most likely tokens there (largest first, ties by id; empty for k = 0)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (a row of all -inf gives NaN)."""
    x = np.asarray(logits, dtype=np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    shifted = x - top
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def top_k(logprobs: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k largest of a row [vocab] as (ids, values), largest first, ties by the smaller id."""
    if k <= 0:
        return [], []
    k = min(k, logprobs.size)
    kth = np.partition(logprobs, logprobs.size - k)[logprobs.size - k]  # the k-th largest
    above = np.flatnonzero(logprobs > kth)
    ids = np.concatenate([above, np.flatnonzero(logprobs == kth)[: k - above.size]])
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return ids.tolist(), logprobs[ids].tolist()


def token_logprob(logprobs: np.ndarray, token_id: int, k: int) -> TokenLogprob:
    """The entry for `token_id` from one row of log-softmax values [vocab]."""
    ids, values = top_k(logprobs, k)
    return TokenLogprob(token_id, float(logprobs[token_id]), ids, values)


def block_logprobs(logits: np.ndarray, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Entries for a block of positions: row i of `logits` [n, vocab] scores `next_ids[i]`
    (len(next_ids) <= n; the rows past it are ignored)."""
    n = len(next_ids)
    if n == 0:
        return []
    lp = log_softmax(logits[:n])
    picked = lp[np.arange(n), np.asarray(next_ids, dtype=np.int64)]
    return [TokenLogprob(next_ids[i], float(picked[i]), *top_k(lp[i], k)) for i in range(n)]


def device_logprobs(logits, token, k: int):
    """On the logits' device (the GPU engine's device-logprob sampler), one row's logprobs as
    above: the float64 log-softmax of the float32 logits [vocab], the drawn `token`'s value and the k most
    likely tokens, largest first with ties by the smaller id (a stable sort of the row: the
    log-softmax is the row less one constant, so it orders the tokens as the logits do). Returns
    one float64 tensor [1 + 2k]: the token's logprob, the k values, the k ids; no host sync."""
    import torch

    row = logits.reshape(-1).float()
    lp = row.double() - torch.logsumexp(row.double(), 0)
    parts = [lp[token.reshape(-1)[:1].long()]]
    if k > 0:
        ids = torch.sort(row, descending=True, stable=True).indices[:k]
        parts += [lp[ids], ids.double()]
    return torch.cat(parts)


def unpack_logprobs(packed, token: int, k: int):
    """The TokenLogprob of one `device_logprobs` result (on the host)."""
    values = packed.tolist()
    k = (len(values) - 1) // 2 if k > 0 else 0
    return TokenLogprob(token, values[0], [int(i) for i in values[1 + k :]], values[1 : 1 + k])
