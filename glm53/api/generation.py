"""What every generating endpoint does: sampling settings from a request, tokenizing off the
event loop, admission (429 / context errors), and one run of a job watched for disconnects."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from glm53.api.errors import ApiError
from glm53.api.http import DisconnectWatcher, Receive, Send, SseWriter
from glm53.api.schemas import PromptTokensDetails, SamplingFields, Usage
from glm53.api.state import ServerState
from glm53.engine.base import Tokenizer
from glm53.engine.sampling import SamplingParams
from glm53.engine.scheduler import (
    GenerationRequest,
    JobStream,
    PromptTooLong,
    QueueFull,
    TokenEvent,
)

# Prompts longer than this are tokenized on a worker thread so the event loop keeps serving.
_INLINE_TOKENIZE_CHARS = 4096


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def reject_unsupported(req: SamplingFields) -> None:
    if req.n != 1:
        raise ApiError(400, f"n={req.n}: glm53 returns one choice per request; send n=1", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise ApiError(
                400, f"{name} is not supported by glm53's sampler; leave it out or 0", param=name
            )
    if req.repetition_penalty not in (None, 1, 1.0):
        raise ApiError(
            400,
            "repetition_penalty is not supported by glm53's sampler; leave it out or 1",
            param="repetition_penalty",
        )


def sampling_params(
    defaults: dict[str, float],
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
) -> SamplingParams:
    """Request values, else the checkpoint's generation_config, else OpenAI's defaults."""

    def pick(value, name, fallback):
        return value if value is not None else defaults.get(name, fallback)

    return SamplingParams(
        temperature=float(pick(temperature, "temperature", 1.0)),
        top_p=float(pick(top_p, "top_p", 1.0)),
        top_k=int(pick(top_k, "top_k", 0)),
        min_p=float(pick(min_p, "min_p", 0.0)),
        seed=seed,
    )


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


async def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text)
    return await asyncio.to_thread(tokenizer.encode, text)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise ApiError(
                400,
                f"token id {token} is outside the vocabulary [0, {vocab_size})",
                param=f"{param}[{i}]",
            )


def submit(state: ServerState, request: GenerationRequest, prompt_param: str) -> JobStream:
    scheduler = state.ready_scheduler()
    try:
        return scheduler.submit(request)
    except QueueFull as exc:
        raise ApiError(
            429,
            f"server busy: {exc}; retry after {exc.retry_after_s} s",
            code="queue_full",
            headers=((b"retry-after", str(exc.retry_after_s).encode()),),
        ) from None
    except PromptTooLong as exc:
        raise ApiError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None


class Run:
    """One job being answered: its events, cancellation when the client leaves, and metrics."""

    def __init__(self, state: ServerState, stream: JobStream, receive: Receive):
        self.state = state
        self.stream = stream
        self.watcher = DisconnectWatcher(receive, stream.cancel)
        self.created = int(time.time())
        self._sse: SseWriter | None = None

    def sse(self, send: Send) -> SseWriter:
        """The SSE writer of this run's answer; `close` stops its keep-alive comments."""
        self._sse = SseWriter(send)
        return self._sse

    @property
    def is_gone(self) -> bool:
        return self.watcher.gone.is_set()

    async def events(self) -> AsyncIterator[TokenEvent]:
        async for event in self.stream:
            yield event

    def close(self) -> None:
        self.watcher.close()
        self.stream.cancel()
        if self._sse is not None:
            self._sse.stop()
        stream, metrics = self.stream, self.state.metrics
        metrics.count_tokens(
            stream.request.request_id,
            stream.num_prompt_tokens,
            stream.num_generated_tokens,
            stream.num_cached_tokens,
        )
        if stream.first_token_ns:
            metrics.time_to_first_token_s.observe(
                (stream.first_token_ns - stream.submitted_ns) / 1e9
            )
        metrics.request_seconds.observe((time.monotonic_ns() - stream.submitted_ns) / 1e9)


def usage(event: TokenEvent) -> Usage:
    """The usage of a finished run, from its last TokenEvent."""
    n_prompt, n_gen = event.num_prompt_tokens, event.num_generated_tokens
    return Usage(n_prompt, n_gen, n_prompt + n_gen, PromptTokensDetails(event.num_cached_tokens))


def check_model(state: ServerState, model: str) -> None:
    served = state.settings.served_name
    if model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
