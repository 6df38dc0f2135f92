"""One job and its stream: the scheduler's record of a request (`Job`), what the engine thread
posts about it (`JobEvent`), and the async stream of TokenEvents the caller reads (`JobStream`).

Threads: the engine thread owns a Job (but `is_cancelled`, which the event loop sets) and makes
its JobEvents; the event loop owns the JobStream, which turns events into TokenEvents: it decodes
tokens to text and applies stop strings there, off the engine's critical path.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from glm53.engine.base import FinishReason, IncrementalDecoder, StreamUsage
from glm53.engine.logprobs import TokenLogprob
from glm53.engine.requests import GenerationRequest, TokenEvent
from glm53.engine.sampling import StreamSampler
from glm53.engine.stops import StopMatcher


class JobState(enum.StrEnum):
    """Where a job is, as the engine thread sees it."""

    WAITING = "waiting"  # submitted, not yet in the engine
    RUNNING = "running"  # in the engine: a slot (step engine) or an engine job (job engine)
    FINISHED = "finished"  # out of the engine: done, failed, or dropped after a cancel


class EventKind(enum.StrEnum):
    """What a JobEvent says."""

    TOKEN = "token"  # one new token; `finish` is set on the stream's last
    SCORED = "scored"  # a prompt scored without generation is done (finish LENGTH)
    ERROR = "error"  # the job failed; `error` says why (finish ERROR)


@dataclass(slots=True, eq=False)
class Job:
    """The scheduler's record of one request."""

    request: GenerationRequest
    sampler: StreamSampler
    max_new_tokens: int
    stream: JobStream | None = None
    state: JobState = JobState.WAITING
    slot: int = -1
    num_fed: int = 0  # prompt tokens the engine has seen (restored ones included)
    num_cached: int = 0  # prompt tokens reused from the scheduler's or the engine's prefix cache
    prefix_keys: list[bytes] | None = None  # chain keys of the prompt's whole chunks
    num_generated: int = 0
    last_token: int = -1  # the newest generated token, fed at the next decode step
    is_cancelled: bool = False
    prefill_start_ns: int = 0  # start of the step that ran the first prompt chunk
    usage: StreamUsage | None = None  # the engine's live counters of this stream
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled during prefill


class JobEvent(msgspec.Struct, frozen=True):
    """What the engine thread posts about one job. A msgspec Struct: one is made per token on the
    engine thread between two steps, where it costs less than a dataclass. `time_ns`
    (time.monotonic_ns) is when it left the engine (0 at shutdown). `token` and `logprob` belong
    to TOKEN events, `error` to ERROR events; `finish` set ends the stream."""

    job: Job
    kind: EventKind
    time_ns: int
    token: int | None = None
    finish: FinishReason | None = None
    logprob: TokenLogprob | None = None
    error: str | None = None

    @classmethod
    def failed(cls, job: Job, message: str, time_ns: int) -> JobEvent:
        return cls(job, EventKind.ERROR, time_ns, finish=FinishReason.ERROR, error=message)

    @classmethod
    def scored(cls, job: Job, time_ns: int, finish: FinishReason = FinishReason.LENGTH) -> JobEvent:
        return cls(job, EventKind.SCORED, time_ns, finish=finish)


class JobOwner(Protocol):
    """What a JobStream asks of its scheduler (glm53.engine.scheduler.Scheduler)."""

    def cancel_job(self, job: Job, *, counted: bool) -> None:
        """Free the job's slot at the next step; `counted`: the stream has not yet been
        counted as done (on_stream_done)."""
        ...

    def on_stream_done(self, stream: JobStream) -> None: ...


class JobStream:
    """The async stream of one job's TokenEvents (event-loop side). Iterate it; call `cancel()`
    when the consumer stops early (a client disconnect), or the slot stays busy until done."""

    def __init__(self, owner: JobOwner, job: Job, decoder: IncrementalDecoder, stops: StopMatcher):
        self._owner = owner
        self._job = job
        self._decoder = decoder
        self._stops = stops
        self._pending: list[JobEvent] = []
        self._ready = asyncio.Event()
        self._num_generated = 0
        self.is_done = False
        self.submitted_ns = time.monotonic_ns()
        self.first_token_ns = 0
        self.last_token_ns = 0
        self.finish_reason: FinishReason | None = None

    @property
    def request(self) -> GenerationRequest:
        return self._job.request

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._job.request.prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused from a prefix cache (set before the first token is posted)."""
        return self._job.num_cached

    def usage(self) -> StreamUsage:
        """What this stream cost in each tier so far (the engine's counts; zeros from an engine
        that does not count per stream, see `is_counted`), with its prefill and decode seconds."""
        job = self._job
        counted = job.usage
        usage = StreamUsage() if counted is None else msgspec.structs.replace(counted)
        usage.prefix_cached_tokens = job.num_cached
        if self.first_token_ns and job.prefill_start_ns:
            usage.prefill_seconds = (self.first_token_ns - job.prefill_start_ns) / 1e9
            usage.decode_seconds = (self.last_token_ns - self.first_token_ns) / 1e9
        return usage

    @property
    def is_counted(self) -> bool:
        """Whether the engine counted this stream's tiers (`usage` holds its counts)."""
        return self._job.usage is not None

    def cancel(self) -> None:
        if not self.is_done:
            self.is_done = True
            self.finish_reason = self.finish_reason or FinishReason.CANCELLED
            self._owner.cancel_job(self._job, counted=True)
            self._ready.set()

    def push(self, event: JobEvent) -> None:
        """Take one of this job's events (event loop; the scheduler delivers them)."""
        self._pending.append(event)
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self.is_done:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        events, self._pending = self._pending, []
        if self.is_done:  # cancelled while tokens were in flight
            raise StopAsyncIteration
        return self._assemble(events)

    def _assemble(self, events: list[JobEvent]) -> TokenEvent:
        job, stop_ids = self._job, self._job.request.stop_token_ids
        parts: list[str] = []
        token_ids: list[int] = []
        wants_logprobs = job.request.logprobs is not None
        logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        finish = matched = error = None
        time_ns = 0
        for event in events:
            time_ns = event.time_ns
            if event.kind is EventKind.ERROR:
                finish, error = FinishReason.ERROR, event.error
                break
            if event.kind is EventKind.SCORED:  # a scored prompt without generation
                finish = event.finish
                break
            token = event.token
            token_ids.append(token)
            if wants_logprobs:
                logprobs.append(event.logprob)
            self.first_token_ns = self.first_token_ns or time_ns
            self.last_token_ns = time_ns
            if event.finish == FinishReason.STOP and token in stop_ids:
                finish, matched = FinishReason.STOP, token
                break
            text, matched = self._stops.feed(self._decoder.step(token))
            parts.append(text)
            if matched is not None:
                finish = FinishReason.STOP
                self._owner.cancel_job(job, counted=False)  # free the slot now
                break
            if event.finish is not None:
                finish = event.finish
                break
        if finish in (FinishReason.STOP, FinishReason.LENGTH) and not isinstance(matched, str):
            # the decoder's held-back bytes (a character cut by the end) count as text too
            text, matched_tail = self._stops.feed(self._decoder.finish())
            parts.append(text)
            if matched_tail is not None:
                finish, matched = FinishReason.STOP, matched_tail
            else:
                parts.append(self._stops.flush())
        prompt_logprobs = None
        if (
            job.prompt_logprobs is not None
            and self._num_generated == 0
            and finish != FinishReason.ERROR
        ):
            prompt_logprobs, job.prompt_logprobs = job.prompt_logprobs, None
        self._num_generated += len(token_ids)
        if finish is not None:
            self.is_done = True
            self.finish_reason = finish
            self._owner.on_stream_done(self)
        return TokenEvent(
            text="".join(parts),
            token_ids=token_ids,
            num_prompt_tokens=len(job.request.prompt_ids),
            num_generated_tokens=self._num_generated,
            finish_reason=finish,
            num_cached_tokens=job.num_cached,
            matched_stop=matched,
            error=error,
            time_ns=time_ns,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
