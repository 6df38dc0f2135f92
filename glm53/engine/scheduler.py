"""The scheduler: a job queue in front of one engine, driven by the engine's own thread.

The event loop side (this module): `submit` admits requests (up to `max_batch` running and
`queue_limit` waiting; QueueFull beyond) and returns their JobStreams (glm53.engine.stream),
`stats` reports, `close` stops. Requests and cancels reach the engine thread through one Inbox
(glm53.engine.inbox); the engine thread loads the engine and runs one of two loops over it,
which post JobEvents back to the event loop through a Handoff (glm53._handoff):
- a step engine (the CPU and scripted engines): glm53.engine.step_loop plans the steps, feeds
  prompts in chunks and samples;
- a job engine (`drives_jobs`: the GPU engine over exllamav3's Generator): glm53.engine.job_loop
  starts whole requests in it and iterates it.
Nothing here blocks the event loop.

A stream finishes on a stop token id (finish STOP), a stop string (the text is cut before it;
the engine slot is freed at the next step), its max_new_tokens or the end of the context
(LENGTH), an engine error (ERROR), or a cancel (the slot is freed at the next step).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from typing import Any

from glm53._handoff import Handoff
from glm53.engine.base import Engine, JobEngine, PrefixSnapshots, PromptTooLong
from glm53.engine.grammar import Constraint
from glm53.engine.inbox import STEP_COUNTERS, EngineLoop, Inbox
from glm53.engine.job_loop import JobLoop
from glm53.engine.prefix_cache import PrefixCache
from glm53.engine.requests import GenerationRequest, QueueFull, TokenEvent
from glm53.engine.sampling import StreamSampler
from glm53.engine.step_loop import StepLoop
from glm53.engine.stops import StopMatcher
from glm53.engine.stream import Job, JobEvent, JobStream

log = logging.getLogger("glm53.scheduler")

__all__ = [
    "GenerationRequest",
    "JobStream",
    "PromptTooLong",
    "QueueFull",
    "Scheduler",
    "TokenEvent",
]


class Scheduler:
    """Admits jobs (up to `max_batch` running, `queue_limit` waiting) and drives `engine`;
    keeps prefix snapshots in up to `prefix_cache_bytes` when the engine can take them.
    The event loop owns this object but `step_counters` and `prefix_cache`, which the engine
    thread writes (readers see values one step old)."""

    def __init__(
        self,
        engine: Engine | JobEngine,
        *,
        max_batch: int,
        chunk_size: int,
        queue_limit: int,
        prefix_cache_bytes: int = 0,
    ):
        if max_batch < 1 or chunk_size < 1 or queue_limit < 0:
            raise ValueError(
                f"max_batch ({max_batch}) and chunk_size ({chunk_size}) must be >= 1, "
                f"queue_limit ({queue_limit}) >= 0"
            )
        self.engine = engine
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.queue_limit = queue_limit
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_cache: PrefixCache | None = None  # engine thread; set after load
        self.num_slots = 0
        self.context_length = 0
        self.is_ready = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handoff: Handoff | None = None  # engine thread -> event loop
        self._inbox = Inbox()
        self._engine_loop: EngineLoop | None = None  # the engine thread's, once the engine loaded
        self._thread: threading.Thread | None = None
        self._num_active = 0
        self._job_seconds = 2.0  # moving average of a job's duration, for Retry-After
        self.counters: collections.Counter[str] = collections.Counter()  # event loop only
        self.step_counters = dict.fromkeys(STEP_COUNTERS, 0)  # engine thread only

    # --- event loop side ---------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread and wait for the engine to load (raises what load raised)."""
        self._loop = asyncio.get_running_loop()
        self._handoff = Handoff(self._loop)
        loaded = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(loaded,), name="glm53-engine", daemon=True
        )
        self._thread.start()
        await loaded
        self.is_ready = True

    def submit(self, request: GenerationRequest) -> JobStream:
        return self.submit_many([request])[0]

    def submit_many(
        self,
        requests: list[GenerationRequest],
        constraints: list[Constraint | None] | None = None,
    ) -> list[JobStream]:
        """Submit requests as one group: all are admitted or none (QueueFull, PromptTooLong and
        ValueError name the first bad one), and they reach the engine thread together, in order,
        so a job engine starts them in the same iteration when it has the slots.

        `constraints[i]` is request i's grammar matcher, built by the caller off the event loop
        (glm53.engine.grammar.build_constraints: a large grammar's takes up to a second); when
        `constraints` is None, those of the requests with a grammar are built here."""
        if not self.is_ready:
            raise RuntimeError("internal error: the scheduler is not started")
        for request in requests:
            num_prompt = len(request.prompt_ids)
            if num_prompt == 0:
                raise ValueError("the prompt is empty")
            if num_prompt >= self.context_length:
                raise PromptTooLong(num_prompt, self.context_length)
            if request.max_new_tokens == 0 and request.prompt_logprobs is None:
                raise ValueError("max_new_tokens 0 generates nothing: ask for prompt_logprobs")
        if self._num_active + len(requests) > self.num_slots + self.queue_limit:
            self.counters["requests_rejected"] += len(requests)
            raise QueueFull(
                f"all {self.num_slots} slots are busy and {self.queue_limit} requests are waiting",
                self.retry_after_s(),
            )
        if constraints is None:
            constraints = [
                None if r.grammar is None else Constraint(r.grammar, self.engine.tokenizer)
                for r in requests
            ]
        elif len(constraints) != len(requests):
            raise ValueError(f"{len(constraints)} constraints for {len(requests)} requests")
        jobs = [self._new_job(r, c) for r, c in zip(requests, constraints, strict=True)]
        self._num_active += len(jobs)
        self.counters["requests_submitted"] += len(jobs)
        self._inbox.put(jobs)
        return [job.stream for job in jobs]

    def _new_job(self, request: GenerationRequest, constraint: Constraint | None) -> Job:
        room = self.context_length - len(request.prompt_ids)
        max_new = room if request.max_new_tokens is None else min(request.max_new_tokens, room)
        sampler = StreamSampler(
            request.sampling,
            num_logprobs=request.logprobs,
            prompt_ids=request.prompt_ids,
            constraint=constraint,
        )
        job = Job(request, sampler, max_new)
        if request.prompt_logprobs is not None:
            job.prompt_logprobs = [None] if request.prompt_logprobs_from == 0 else []
        job.stream = JobStream(
            self, job, self.engine.tokenizer.new_decoder(), StopMatcher(request.stop_strings)
        )
        return job

    def retry_after_s(self) -> int:
        waves = (self._num_active - self.num_slots + 1) / max(1, self.num_slots)
        return max(1, min(60, math.ceil(self._job_seconds * max(1.0, waves))))

    def on_stream_done(self, stream: JobStream) -> None:
        """A stream ended (JobStream calls it once, on the event loop)."""
        self._num_active -= 1
        self.counters[f"requests_{stream.finish_reason}"] += 1
        seconds = (time.monotonic_ns() - stream.submitted_ns) / 1e9
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * seconds

    def cancel_job(self, job: Job, *, counted: bool) -> None:
        """Drop `job` from the engine at its next step (JobStream calls it on the event loop);
        `counted`: count the stream as done here."""
        if counted:
            self.on_stream_done(job.stream)
        job.is_cancelled = True
        self._inbox.cancel(job)

    def _deliver(self, events: list[JobEvent]) -> None:
        for event in events:
            stream = event.job.stream
            if not stream.is_done:
                stream.push(event)

    def stats(self) -> dict[str, Any]:
        loop = self._engine_loop
        return {
            "num_slots": self.num_slots,
            "max_batch": self.max_batch,
            "chunk_size": self.chunk_size,
            "queue_limit": self.queue_limit,
            "num_running": len(loop.running) if loop is not None else 0,
            "num_waiting": len(loop.waiting) if loop is not None else 0,
            "num_active": self._num_active,
            **self.step_counters,
            **self.counters,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    async def close(self) -> None:
        self._inbox.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._handoff is not None:  # the engine thread is gone: nothing posts any more
            self._handoff.close()

    # --- engine thread -----------------------------------------------------------------------
    def _thread_main(self, loaded: asyncio.Future) -> None:
        try:
            self.engine.load()
            self.num_slots = min(self.max_batch, self.engine.num_slots)
            self.context_length = self.engine.context_length
            loop = self._new_loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            self._close_engine()
            self._handoff.post(_set_exception, loaded, exc)
            return
        self._engine_loop = loop
        self._handoff.post(_set_result, loaded)
        try:
            loop.run()
        finally:
            message = "the server is shutting down"
            events = [JobEvent.failed(j, message, 0) for j in loop.all_jobs()]
            events += [JobEvent.failed(j, message, 0) for j in self._inbox.pending()]
            if events:
                self._handoff.post(self._deliver, events)
            self._close_engine()

    def _new_loop(self) -> EngineLoop:
        args = (
            self.engine,
            self._inbox,
            self._handoff,
            self._deliver,
            self.step_counters,
            self.num_slots,
        )
        if self.engine.drives_jobs:
            return JobLoop(*args)
        if self.prefix_cache_bytes > 0 and isinstance(self.engine, PrefixSnapshots):
            self.prefix_cache = PrefixCache(self.chunk_size, self.prefix_cache_bytes)
        return StepLoop(*args, chunk_size=self.chunk_size, prefix_cache=self.prefix_cache)

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - closing is best effort at shutdown
            log.exception("engine.close() failed")


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
