"""glm53's two subclasses of exllamav3 1.6.5's Sampler (patch points `Sampler.__init__` and
`Sampler.forward`). This module imports exllamav3 at its top, so it is imported only when a
request needs one of them (glm53.exl3.samplers), on a host where exllamav3 is loaded. What each
draw means is glm53's and comes in as callables, so this module knows exllamav3, not the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from exllamav3.generator.sampler import Sampler


class DeviceLogprobSampler(Sampler):
    """Draws with `inner` (an exllamav3 sampler) and computes each draw's logprobs on the device
    with `logprobs(logits, token, k)`; `take(n)` unpacks the first n with `unpack(packed, token,
    k)` on the host."""

    def __init__(self, inner, vocab: int, k: int, logprobs: Callable, unpack: Callable):
        super().__init__()
        self.inner, self.vocab, self.k = inner, vocab, k
        self.logprobs_fn, self.unpack_fn = logprobs, unpack
        self.reqs_past_ids = inner.reqs_past_ids
        self.reqs_torch_seed = inner.reqs_torch_seed
        self.pending: list = []  # (token tensor, packed logprobs), on the device

    def forward(self, logits, *args, **kwargs):
        token = self.inner.forward(logits, *args, **kwargs)
        self.pending.append((token, self.logprobs_fn(logits[..., : self.vocab], token, self.k)))
        return token

    def take(self, n: int) -> list:
        done, self.pending = self.pending[:n], self.pending[n:]
        return [
            self.unpack_fn(packed.cpu(), int(token.reshape(-1)[0]), self.k)
            for token, packed in done
        ]


class HostSampler(Sampler):
    """Draws on the host: `sample(row [1, vocab] float32, [ss])` gives the token, and `ss`
    (glm53's StreamSampler) its `last_logprob`."""

    def __init__(self, ss, vocab: int, sample: Callable):
        super().__init__()
        self.ss, self.vocab, self.sample = ss, vocab, sample
        self.logprobs: list = []  # one per drawn token, in order, until emitted

    def forward(self, logits, *args, **kwargs):
        row = logits.reshape(-1)[: self.vocab].float().cpu().numpy()[None]
        token = self.sample(row, [self.ss])[0]
        self.logprobs.append(self.ss.last_logprob)
        return torch.tensor([token], dtype=torch.long).view(logits.shape[:-1])

    def take(self, n: int) -> list:
        done, self.logprobs = self.logprobs[:n], self.logprobs[n:]
        return done if self.ss.num_logprobs is not None else []
