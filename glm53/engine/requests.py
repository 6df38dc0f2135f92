"""Request types: what goes into the scheduler and what comes back out.

A `GenerationRequest` goes in (glm53.engine.scheduler.Scheduler.submit); `TokenEvent`s come out
of its JobStream (glm53.engine.stream), each with a `FinishReason` (glm53.engine.base) on the
last. `QueueFull` is the refusal when every slot and the queue are taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm53.engine.base import FinishReason
from glm53.engine.grammar import GrammarSpec
from glm53.engine.logprobs import TokenLogprob
from glm53.engine.sampling import SamplingParams
from glm53.errors import Glm53Error


class QueueFull(RuntimeError, Glm53Error):
    """Every slot is busy and the queue is at its limit; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a prompt, how to sample, and when to stop. max_new_tokens None = up to the
    end of the context; 0 only scores the prompt (needs prompt_logprobs).

    `logprobs` None: none; k: each generated token's logprob and top k (TokenEvent.logprobs).
    `prompt_logprobs` None: none; k: the prompt tokens' from position `prompt_logprobs_from`
    on, each with its top k (TokenEvent.prompt_logprobs; position 0 has none: None).
    `grammar`: structured output (glm53.engine.grammar), None for free text."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    request_id: str = ""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 0
    grammar: GrammarSpec | None = None


@dataclass(slots=True)
class TokenEvent:
    """New output of one stream. `text` is final (decoded, stop strings applied); `time_ns`
    (time.monotonic_ns) is when the newest of `token_ids` left the engine."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: FinishReason | None = None  # stop, length or error
    num_cached_tokens: int = 0  # prompt tokens reused from a prefix cache, not computed
    matched_stop: str | int | None = None
    error: str | None = None
    time_ns: int = 0
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first event only, when asked
