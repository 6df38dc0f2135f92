"""What every generating endpoint does: sampling settings from a request, tokenizing off the
event loop, admission (429 / context errors), and one run of a job watched for disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import msgspec

from glm53.api.errors import ApiError
from glm53.api.http import DisconnectWatcher, Send, SseWriter
from glm53.api.limits import check_prompt_chars
from glm53.api.schemas import PromptTokensDetails, SamplingFields, TierUsage, Usage
from glm53.api.state import ServerState
from glm53.engine.base import PromptTooLong, Tokenizer
from glm53.engine.grammar import Constraint
from glm53.engine.requests import GenerationRequest, QueueFull, TokenEvent
from glm53.engine.sampling import SamplingParams
from glm53.engine.stream import JobStream

_TOKEN_ID = re.compile(r"[0-9]{1,10}", re.ASCII)
# Prompts longer than this are tokenized (and token-id prompts decoded) on glm53.api.offload's
# threads, so the event loop keeps serving.
_INLINE_TOKENIZE_CHARS = 4096
# A request body longer than this is decoded (and checked) on an offload thread, not the loop:
# two 3 MB bodies and two chats of 4,000 messages arriving together held the loop for about
# 200 ms (bench/health_under_load.py); below it, decoding takes well under a millisecond.
INLINE_BODY_BYTES = 65536


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_choices(state: ServerState, req: SamplingFields) -> None:
    """n parallel choices run as n streams at once, so n may not exceed --max-batch."""
    if req.n > state.settings.max_batch:
        raise ApiError(
            400,
            f"n={req.n} is more than --max-batch {state.settings.max_batch}: the choices run "
            f"as parallel streams; send n <= {state.settings.max_batch} or raise --max-batch",
            param="n",
        )


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs, each id checked."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        # ASCII digits only (str.isdigit and int() also take "²" and "٣"), and few enough
        # of them for int() (which refuses over 4300)
        if _TOKEN_ID.fullmatch(key) is None or int(key) >= vocab_size:
            raise ApiError(
                400,
                f"logit_bias key {key!r} is not a token id: keys are decimal token ids in "
                f"[0, {vocab_size}), written with the digits 0-9",
                param=f"logit_bias.{key}",
            )
        out.append((int(key), float(value)))
    return tuple(out)


def check_top_k(top_k: int | None, vocab_size: int, param: str) -> None:
    """top_k is a count of tokens: at most the vocabulary (-1 or 0: no top-k filter)."""
    if top_k is not None and top_k > vocab_size:
        raise ApiError(
            400,
            f"top_k {top_k} is more than the vocabulary's {vocab_size} tokens: send 1 to "
            f"{vocab_size}, or -1 or 0 for no top-k filter",
            param=param,
        )


def sampling_params(
    defaults: dict[str, float],
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    seed: int | None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    bias: tuple[tuple[int, float], ...] = (),
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
        presence_penalty=float(pick(presence_penalty, "presence_penalty", 0.0)),
        frequency_penalty=float(pick(frequency_penalty, "frequency_penalty", 0.0)),
        repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", 1.0)),
        logit_bias=bias,
    )


def request_sampling(
    defaults: dict[str, float], req: SamplingFields, vocab_size: int
) -> SamplingParams:
    """The SamplingParams of an OpenAI-shaped request (chat or completions)."""
    check_top_k(req.top_k, vocab_size, "top_k")
    return sampling_params(
        defaults,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        bias=logit_bias(req.logit_bias, vocab_size),
    )


def choices(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n copies of a request, one per choice; choice i of a seeded request has seed + i, so
    a seed gives the same n choices every time."""
    if n == 1:
        return [request]
    out = []
    for i in range(n):
        sampling = request.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
        out.append(dataclasses.replace(request, sampling=sampling))
    return out


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


async def encode(
    state: ServerState,
    watcher: DisconnectWatcher,
    tokenizer: Tokenizer,
    text: str,
    param: str,
    within_context: bool = True,
) -> list[int]:
    """`text`'s token ids, after --max-prompt-chars; a long text is tokenized off the loop.
    `within_context`: a prompt that fills the context is refused (400 context_length_exceeded)
    as soon as its length is known, before its ids are listed."""
    check_prompt_chars(state.settings, len(text), param)
    context_length = state.ready_scheduler().context_length if within_context else None
    try:
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return tokenizer.encode(text, context_length)
        return await state.offload.run(watcher, tokenizer.encode, text, context_length)
    except PromptTooLong as exc:
        raise too_long(exc, param) from None


def too_long(exc: PromptTooLong, param: str) -> ApiError:
    return ApiError(400, str(exc), param=param, code="context_length_exceeded")


async def decode(
    state: ServerState, watcher: DisconnectWatcher, tokenizer: Tokenizer, token_ids: list[int]
) -> str:
    """The text of a prompt given as token ids (for echo); a long one is decoded off the loop."""
    if len(token_ids) <= _INLINE_TOKENIZE_CHARS:
        return tokenizer.decode(token_ids)
    return await state.offload.run(watcher, tokenizer.decode, token_ids)


def check_token_ids(
    state: ServerState, token_ids: Sequence[int], vocab_size: int, param: str
) -> None:
    """Refuse a token-id prompt longer than the context (before looking at each id) or with
    an id outside the vocabulary."""
    context_length = state.ready_scheduler().context_length
    if len(token_ids) >= context_length:
        raise ApiError(
            400,
            str(PromptTooLong(len(token_ids), context_length)),
            param=param,
            code="context_length_exceeded",
        )
    check_vocab(token_ids, vocab_size, param)


def check_vocab(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Refuse a token id outside the vocabulary (a prompt's, or a stop list's)."""
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
        raise too_long(exc, prompt_param) from None


def submit_all(
    state: ServerState,
    requests: Sequence[GenerationRequest],
    prompt_param: str,
    constraints: list[Constraint] | None = None,
) -> list[JobStream]:
    """Submit every choice's request as one group (all or none; they reach the engine
    together, in order, see Scheduler.submit_many), with their grammar matchers built off the
    event loop when they have a grammar."""
    scheduler = state.ready_scheduler()
    try:
        return scheduler.submit_many(list(requests), constraints)
    except QueueFull as exc:
        raise ApiError(
            429,
            f"server busy: {exc}; retry after {exc.retry_after_s} s",
            code="queue_full",
            headers=((b"retry-after", str(exc.retry_after_s).encode()),),
        ) from None
    except PromptTooLong as exc:
        raise too_long(exc, prompt_param) from None


class Run:
    """One request being answered: its choices' events, cancellation when the client leaves,
    and metrics. `streams[i]` is choice i."""

    def __init__(
        self,
        state: ServerState,
        streams: JobStream | list[JobStream],
        watcher: DisconnectWatcher,
    ):
        """`watcher`: the request's DisconnectWatcher (started before the prompt was prepared);
        from here on a disconnect cancels the streams."""
        self.state = state
        self.streams = streams if isinstance(streams, list) else [streams]
        self.stream = self.streams[0]
        self.watcher = watcher
        self.watcher.on_gone = self._cancel
        if self.watcher.gone.is_set():
            self._cancel()
        self.created = int(time.time())
        self._sse: SseWriter | None = None

    def _cancel(self) -> None:
        for stream in self.streams:
            stream.cancel()

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

    async def choice_events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(choice index, event) as they come, over every choice."""
        if len(self.streams) == 1:
            async for event in self.stream:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: JobStream) -> None:
            try:
                async for event in stream:
                    queue.put_nowait((index, event))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, event = await queue.get()
                if event is None:
                    remaining -= 1
                else:
                    yield index, event
        finally:
            for task in tasks:
                task.cancel()

    def usage(self, lasts: Sequence[TokenEvent]) -> Usage:
        """The answer's `usage` over its choices (their last events): the prompt once, every
        choice's generated tokens, the prompt's cached tokens, and the tier counts summed in
        `usage.glm53` (the longest prefill and decode seconds)."""
        n_prompt = lasts[0].num_prompt_tokens
        n_gen = sum(last.num_generated_tokens for last in lasts)
        return Usage(
            n_prompt,
            n_gen,
            n_prompt + n_gen,
            PromptTokensDetails(lasts[0].num_cached_tokens),
            glm53=self.tier_usage(),
        )

    def tier_usage(self) -> TierUsage:
        total: dict = {}
        for stream in self.streams:
            for name, value in msgspec.structs.asdict(stream.usage()).items():
                if name.endswith("_seconds"):
                    total[name] = max(total.get(name, 0.0), value)
                elif name == "prefix_cached_tokens":
                    total[name] = max(total.get(name, 0), value)
                else:
                    total[name] = total.get(name, 0) + value
        counted = all(stream.is_counted for stream in self.streams)
        return TierUsage(**total, tiers_counted=counted)

    def close(self) -> None:
        self.watcher.close()
        self._cancel()
        if self._sse is not None:
            self._sse.stop()
        metrics = self.state.metrics
        for stream in self.streams:
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
                metrics.count_tiers(self.state.settings.mode, stream.usage())
        metrics.request_seconds.observe((time.monotonic_ns() - self.stream.submitted_ns) / 1e9)


def check_model(state: ServerState, model: str) -> None:
    served = state.settings.served_name
    if model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
