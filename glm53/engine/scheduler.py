"""The scheduler: a job queue in front of one Engine, driven by the engine's own thread.

Threads: the engine thread owns the engine and the waiting/running lists; it loads the engine,
then loops: take new and cancelled jobs, fill free slots from the queue, plan one step (every
decoding stream gets its next token; prompts are fed in chunks of at most `chunk_size` tokens per
step, over all prefilling streams, each stream's chunks cut at multiples of `chunk_size` from its
position 0), run it, sample each stream's token, and post the step's tokens
to the event loop in one `Handoff.post` (glm53._handoff). The event loop owns each job's
`JobStream`: it decodes tokens to text and applies stop strings there, off the engine's critical
path. Nothing here blocks the event loop.

What the engine thread does between two steps is added to every token (bench/server_overhead.py
measures it), and it runs with caches cold after the wait for the step, so it is kept short:
sampling is one native call (glm53.engine.sampling), the post is one eventfd write with the GIL
held (glm53._handoff), and a step with no new or cancelled job takes no lock.

Logprobs: a sampled token's come from its sampler (glm53.engine.sampling, which logits in
glm53.engine.logprobs); a scored prompt's chunks ask the engine for every position's logits
(StreamWork.all_logits) and are turned into entries here, only for the jobs that asked.

A stream finishes on a stop token id (finish "stop"), a stop string (the text is cut before it;
the engine slot is freed at the next step), its max_new_tokens or the end of the context
("length"), an engine error ("error"), or a cancel (the slot is freed at the next step).

Prefix cache (glm53.engine.prefix_cache), with an engine that implements PrefixSnapshots and
`prefix_cache_bytes` > 0: a new job whose prompt starts with the tokens of a snapshot is given
that state in its slot and starts prefilling at the snapshot's length (its `num_cached`); every
prefill chunk that ends at a multiple of `chunk_size` leaves a snapshot. Chunks are cut at the
same multiples whether a job resumed or started cold, and whatever other streams prefill in the
same steps, so neither a hit nor a neighbour changes a stream's tokens or logits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from glm53._handoff import Handoff
from glm53.engine.base import (
    Engine,
    EngineError,
    PrefixSnapshots,
    PromptTooLong,
    StreamUsage,
    StreamWork,
)
from glm53.engine.grammar import Constraint, GrammarSpec
from glm53.engine.logprobs import TokenLogprob, block_logprobs
from glm53.engine.prefix_cache import PrefixCache, Snapshot, chain_keys
from glm53.engine.sampling import SamplingParams, StreamSampler, sample
from glm53.engine.stops import StopMatcher
from glm53.errors import Glm53Error

log = logging.getLogger("glm53.scheduler")


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
    finish_reason: str | None = None  # "stop" | "length" | "error"
    num_cached_tokens: int = 0  # prompt tokens reused from a prefix cache, not computed
    matched_stop: str | int | None = None
    error: str | None = None
    time_ns: int = 0
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first event only, when asked


@dataclass(slots=True, eq=False)
class _Job:
    request: GenerationRequest
    sampler: StreamSampler
    max_new_tokens: int
    stream: JobStream | None = None
    slot: int = -1
    num_fed: int = 0  # prompt tokens the engine has seen (restored ones included)
    num_cached: int = 0  # prompt tokens reused from the scheduler's or the engine's prefix cache
    prefix_keys: list[bytes] | None = None  # chain keys of the prompt's whole chunks
    num_generated: int = 0
    last_token: int = -1
    is_cancelled: bool = False
    prefill_start_ns: int = 0  # start of the step that ran the first prompt chunk
    usage: StreamUsage | None = None  # the engine's live counters of this stream
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled during prefill


class JobStream:
    """The async stream of one job's TokenEvents (event-loop side). Iterate it; call `cancel()`
    when the consumer stops early (a client disconnect), or the slot stays busy until done."""

    def __init__(self, scheduler: Scheduler, job: _Job, decoder, stops: StopMatcher):
        self._scheduler = scheduler
        self._job = job
        self._decoder = decoder
        self._stops = stops
        self._pending: list[tuple[int | None, str | None, str | None, int, Any]] = []
        self._ready = asyncio.Event()
        self._num_generated = 0
        self.is_done = False
        self.submitted_ns = time.monotonic_ns()
        self.first_token_ns = 0
        self.last_token_ns = 0
        self.finish_reason: str | None = None

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
            self.finish_reason = self.finish_reason or "cancelled"
            self._scheduler._cancel(self._job, counted=True)
            self._ready.set()

    def _push(
        self,
        token: int | None,
        finish: str | None,
        error: str | None,
        time_ns: int,
        logprob: TokenLogprob | None,
    ) -> None:
        self._pending.append((token, finish, error, time_ns, logprob))
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self.is_done:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        items, self._pending = self._pending, []
        if self.is_done:  # cancelled while tokens were in flight
            raise StopAsyncIteration
        return self._assemble(items)

    def _assemble(self, items) -> TokenEvent:
        job, stop_ids = self._job, self._job.request.stop_token_ids
        parts: list[str] = []
        token_ids: list[int] = []
        wants_logprobs = job.request.logprobs is not None
        logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        finish = matched = error = None
        time_ns = 0
        for token, step_finish, step_error, item_ns, logprob in items:
            time_ns = item_ns
            if step_finish == "error":
                finish, error = "error", step_error
                break
            if token is None:  # a scored prompt without generation
                finish = step_finish
                break
            token_ids.append(token)
            if wants_logprobs:
                logprobs.append(logprob)
            self.first_token_ns = self.first_token_ns or item_ns
            self.last_token_ns = item_ns
            if step_finish == "stop" and token in stop_ids:
                finish, matched = "stop", token
                break
            text, matched = self._stops.feed(self._decoder.step(token))
            parts.append(text)
            if matched is not None:
                finish = "stop"
                self._scheduler._cancel(job, counted=False)  # free the slot now
                break
            if step_finish is not None:
                finish = step_finish
                break
        if finish in ("stop", "length") and not isinstance(matched, str):
            # the decoder's held-back bytes (a character cut by the end) count as text too
            text, matched_tail = self._stops.feed(self._decoder.finish())
            parts.append(text)
            if matched_tail is not None:
                finish, matched = "stop", matched_tail
            else:
                parts.append(self._stops.flush())
        prompt_logprobs = None
        if job.prompt_logprobs is not None and self._num_generated == 0 and finish != "error":
            prompt_logprobs, job.prompt_logprobs = job.prompt_logprobs, None
        self._num_generated += len(token_ids)
        if finish is not None:
            self.is_done = True
            self.finish_reason = finish
            self._scheduler._on_done(self)
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


class Scheduler:
    """Admits jobs (up to `max_batch` running, `queue_limit` waiting) and drives `engine`;
    keeps prefix snapshots in up to `prefix_cache_bytes` when the engine can take them."""

    def __init__(
        self,
        engine: Engine,
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
        self._cv = threading.Condition()
        self._inbox: list[_Job] = []
        self._cancels: list[_Job] = []
        self._is_stopping = False
        self._thread: threading.Thread | None = None
        # An engine without per-stream counters (the GPU engine so far) reports none.
        self._stream_usage = getattr(engine, "stream_usage", None)
        # engine thread
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: list[_Job] = []
        # event loop
        self._num_active = 0
        self._job_seconds = 2.0  # moving average of a job's duration, for Retry-After
        self.counters: collections.Counter[str] = collections.Counter()  # event loop only
        # engine thread only; fixed keys, so a reader on another thread never sees the dict grow
        self.step_counters = {
            "steps": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "step_errors": 0,
            "cached_prompt_tokens": 0,
            "requests_prefix_hit": 0,
            "snapshot_errors": 0,
        }

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
            raise RuntimeError("the scheduler is not started")
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
        jobs, streams = [], []
        for request, constraint in zip(requests, constraints, strict=True):
            room = self.context_length - len(request.prompt_ids)
            max_new = room if request.max_new_tokens is None else min(request.max_new_tokens, room)
            sampler = StreamSampler(
                request.sampling,
                num_logprobs=request.logprobs,
                prompt_ids=request.prompt_ids,
                constraint=constraint,
            )
            job = _Job(request, sampler, max_new)
            if request.prompt_logprobs is not None:
                job.prompt_logprobs = [None] if request.prompt_logprobs_from == 0 else []
            job.stream = JobStream(
                self, job, self.engine.tokenizer.new_decoder(), StopMatcher(request.stop_strings)
            )
            jobs.append(job)
            streams.append(job.stream)
        self._num_active += len(jobs)
        self.counters["requests_submitted"] += len(jobs)
        with self._cv:
            self._inbox.extend(jobs)
            self._cv.notify()
        return streams

    def retry_after_s(self) -> int:
        waves = (self._num_active - self.num_slots + 1) / max(1, self.num_slots)
        return max(1, min(60, math.ceil(self._job_seconds * max(1.0, waves))))

    def _on_done(self, stream: JobStream) -> None:
        self._num_active -= 1
        self.counters[f"requests_{stream.finish_reason}"] += 1
        seconds = (time.monotonic_ns() - stream.submitted_ns) / 1e9
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * seconds

    def _cancel(self, job: _Job, *, counted: bool) -> None:
        if counted:
            self._on_done(job.stream)
        job.is_cancelled = True
        with self._cv:
            self._cancels.append(job)
            self._cv.notify()

    def _deliver(self, outputs) -> None:
        for job, token, finish, error, time_ns, logprob in outputs:
            if not job.stream.is_done:
                job.stream._push(token, finish, error, time_ns, logprob)

    def stats(self) -> dict[str, Any]:
        return {
            "num_slots": self.num_slots,
            "max_batch": self.max_batch,
            "chunk_size": self.chunk_size,
            "queue_limit": self.queue_limit,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "num_active": self._num_active,
            **self.step_counters,
            **self.counters,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
        }

    async def close(self) -> None:
        with self._cv:
            self._is_stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._handoff is not None:  # the engine thread is gone: nothing posts any more
            self._handoff.close()

    # --- engine thread -----------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        self._handoff.post(fn, *args)

    def _thread_main(self, loaded: asyncio.Future) -> None:
        try:
            self.engine.load()
            self.num_slots = min(self.max_batch, self.engine.num_slots)
            self.context_length = self.engine.context_length
            if self.prefix_cache_bytes > 0 and isinstance(self.engine, PrefixSnapshots):
                self.prefix_cache = PrefixCache(self.chunk_size, self.prefix_cache_bytes)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            self._close_engine()
            self._post(_set_exception, loaded, exc)
            return
        self._post(_set_result, loaded)
        try:
            if getattr(self.engine, "drives_jobs", False):
                self._job_loop()
            else:
                self._engine_loop(list(range(self.num_slots - 1, -1, -1)))
        finally:
            outputs = [
                (j, -1, "error", "the server is shutting down", 0, None) for j in self._all_jobs()
            ]
            if outputs:
                self._post(self._deliver, outputs)
            self._close_engine()

    def _engine_loop(self, free_slots: list[int]) -> None:
        while True:
            # Unlocked test first: submit and cancel only append (under the GIL), and what comes
            # in just after the test is taken at the next step. Idle, it waits under the lock.
            if self._inbox or self._cancels or self._is_stopping or not self._running:
                with self._cv:
                    while not (
                        self._is_stopping
                        or self._inbox
                        or self._cancels
                        or self._running
                        or self._waiting
                    ):
                        self._cv.wait()
                    if self._is_stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                self._waiting.extend(inbox)
                for job in cancels:
                    self._drop(job, free_slots)
            while self._waiting and free_slots:
                job = self._waiting.popleft()
                if job.is_cancelled:
                    continue
                job.slot = free_slots.pop()
                self._running.append(job)
                if self.prefix_cache is not None:
                    self._resume_prefix(job, free_slots)
            if self._running:
                self._run_step(free_slots)

    def _take_inbox(self) -> tuple[list[_Job], bool]:
        """Wait while idle; move new jobs to the waiting list; return the cancels and whether
        the scheduler is stopping."""
        with self._cv:
            while not (
                self._is_stopping or self._inbox or self._cancels or self._running or self._waiting
            ):
                self._cv.wait()
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        self._waiting.extend(inbox)
        return cancels, self._is_stopping

    # --- job engines (glm53.engine.base.JobEngine: the GPU engine over exllamav3's Generator) ----
    def _job_loop(self) -> None:
        """The loop for an engine that runs whole requests: admit up to num_slots jobs, start
        them in the engine, iterate it, and post each job's new tokens. Admission is FIFO, so
        jobs submitted together start together, in submission order."""
        while True:
            if self._inbox or self._cancels or self._is_stopping or not self._running:
                cancels, stopping = self._take_inbox()
                if stopping:
                    return
                for job in cancels:
                    if job in self._running:
                        self._cancel_in_engine(job)  # before it leaves the running count
                        self._running.remove(job)
                    elif job in self._waiting:
                        self._waiting.remove(job)
            while self._waiting and len(self._running) < self.num_slots:
                job = self._waiting.popleft()
                if job.is_cancelled:
                    continue
                self._start_in_engine(job)
            if self._running:
                self._run_iteration()

    def _start_in_engine(self, job: _Job) -> None:
        try:
            self.engine.start(id(job), job.request, job.max_new_tokens, job.sampler)
        except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
            log.exception("starting a job in the engine failed")
            self._post(self._deliver, [(job, -1, "error", f"engine error: {exc}", 0, None)])
            return
        job.slot = len(self._running)
        job.prefill_start_ns = time.monotonic_ns()  # job engines count no tiers per stream yet
        self._running.append(job)

    def _cancel_in_engine(self, job: _Job) -> None:
        try:
            self.engine.cancel(id(job))
        except Exception:  # noqa: BLE001 - a failed cancel must not stop the other streams
            log.exception("engine.cancel failed")

    def _run_iteration(self) -> None:
        counters = self.step_counters
        try:
            outs = self.engine.iterate()
        except Exception as exc:  # noqa: BLE001 - fail the jobs, keep serving
            counters["step_errors"] += 1
            log.exception("engine iteration failed for %d jobs", len(self._running))
            failed, self._running = self._running, []
            now_ns = time.monotonic_ns()
            for job in failed:
                self._cancel_in_engine(job)
            self._post(
                self._deliver,
                [(j, -1, "error", f"engine error: {exc}", now_ns, None) for j in failed],
            )
            return
        now_ns = time.monotonic_ns()
        counters["steps"] += 1
        by_key = {id(job): job for job in self._running}
        outputs = []
        for out in outs:
            job = by_key.get(out.key)
            if job is None:
                continue
            if out.cached_tokens is not None:
                job.num_cached = out.cached_tokens
                job.num_fed = len(job.request.prompt_ids)
                counters["prompt_tokens"] += job.num_fed - out.cached_tokens
                counters["cached_prompt_tokens"] += out.cached_tokens
                counters["requests_prefix_hit"] += int(out.cached_tokens > 0)
            if out.prompt_logits is not None and job.prompt_logprobs is not None:
                prompt, req = job.request.prompt_ids, job.request
                first = max(1, req.prompt_logprobs_from)  # row i predicts prompt token i + 1
                if first < len(prompt):
                    rows = out.prompt_logits[first - 1 : len(prompt) - 1]
                    if isinstance(rows, torch.Tensor):
                        rows = rows.detach().float().cpu().numpy()
                    job.prompt_logprobs.extend(
                        block_logprobs(rows, prompt[first:], req.prompt_logprobs)
                    )
            last = len(out.token_ids) - 1
            for i, token in enumerate(out.token_ids):
                job.num_generated += 1
                job.last_token = token
                finish = out.finish if i == last and out.finish != "error" else None
                logprob = out.logprobs[i] if out.logprobs is not None else None
                outputs.append((job, token, finish, None, now_ns, logprob))
            counters["generated_tokens"] += len(out.token_ids)
            if out.finish == "error":
                outputs.append((job, -1, "error", out.error, now_ns, None))
            elif out.finish is not None and not out.token_ids:  # a scored prompt, nothing made
                outputs.append((job, None, out.finish, None, now_ns, None))
            if out.finish is not None:
                self._running.remove(job)
        if outputs:
            self._handoff.post(self._deliver, outputs)

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - closing is best effort at shutdown
            log.exception("engine.close() failed")

    def _all_jobs(self) -> list[_Job]:
        return [*self._running, *self._waiting, *self._inbox]

    def _drop(self, job: _Job, free_slots: list[int]) -> None:
        if job in self._running:
            self._running.remove(job)
            self._release(job, free_slots)
        elif job in self._waiting:
            self._waiting.remove(job)

    def _release(self, job: _Job, free_slots: list[int]) -> None:
        try:
            self.engine.release(job.slot)
        except Exception:  # noqa: BLE001 - a failed release must not stop the other streams
            log.exception("engine.release(%d) failed", job.slot)
        free_slots.append(job.slot)
        job.slot = -1

    def _resume_prefix(self, job: _Job, free_slots: list[int]) -> None:
        """Restore the longest cached prefix of the job's prompt into its slot, if any."""
        prompt = job.request.prompt_ids
        job.prefix_keys = chain_keys(prompt, self.chunk_size)
        if job.request.prompt_logprobs is not None:
            return  # a scored prompt needs the logits of every position: compute them all
        snap = self.prefix_cache.lookup(job.prefix_keys, len(prompt))
        if snap is None:
            return
        try:
            self.engine.restore(job.slot, snap.state)
        except Exception as exc:  # noqa: BLE001 - this stream fails, the others keep serving
            log.exception("engine.restore(%d) failed", job.slot)
            self._running.remove(job)
            self._release(job, free_slots)
            message = f"engine error: restoring the cached prefix failed: {exc}"
            self._post(self._deliver, [(job, -1, "error", message, time.monotonic_ns(), None)])
            return
        job.num_fed = job.num_cached = snap.num_tokens
        self.step_counters["cached_prompt_tokens"] += snap.num_tokens
        self.step_counters["requests_prefix_hit"] += 1

    def _take_snapshot(self, job: _Job) -> None:
        """Keep the state of a job whose prefill just reached a chunk boundary, unless held."""
        key = job.prefix_keys[job.num_fed // self.chunk_size - 1]
        if self.prefix_cache.has(key):
            return
        try:
            state, num_bytes = self.engine.snapshot(job.slot)
        except Exception:  # noqa: BLE001 - a missing snapshot costs a later prefill, not output
            self.step_counters["snapshot_errors"] += 1
            log.exception("engine.snapshot(%d) failed", job.slot)
            return
        self.prefix_cache.store(key, Snapshot(state, job.num_fed, num_bytes))

    def _plan(
        self,
    ) -> tuple[
        list[StreamWork],
        list[tuple[_Job, int]],
        list[_Job],
        list[StreamSampler],
        list[tuple[_Job, int, int]],
    ]:
        work: list[StreamWork] = []
        fed: list[tuple[_Job, int]] = []  # (job, prompt tokens fed in this step)
        rows: list[_Job] = []  # jobs that get a logits row to sample, in order
        samplers: list[StreamSampler] = []  # theirs
        scored: list[tuple[_Job, int, int]] = []  # (job, chunk start, chunk length): all rows
        budget = self.chunk_size
        for job in self._running:
            prompt = job.request.prompt_ids
            if job.num_fed < len(prompt):
                # the chunk ends at the next multiple of chunk_size (or the prompt's end); when the
                # step has less room left, the stream waits for the next step rather than being
                # cut elsewhere. The first prefilling stream always fits: it starts the budget.
                to_boundary = self.chunk_size - job.num_fed % self.chunk_size
                n = min(to_boundary, len(prompt) - job.num_fed)
                if n > budget:
                    continue
                budget -= n
                is_last = job.num_fed + n == len(prompt)
                samples = is_last and job.max_new_tokens > 0
                scores = job.prompt_logprobs is not None
                work.append(
                    StreamWork(
                        job.slot,
                        prompt[job.num_fed : job.num_fed + n],
                        job.num_fed,
                        samples,
                        scores,
                    )
                )
                fed.append((job, n))
                if scores:
                    scored.append((job, job.num_fed, n))
                if samples:
                    rows.append(job)
                    samplers.append(job.sampler)
            else:
                pos = len(prompt) + job.num_generated - 1
                work.append(StreamWork(job.slot, [job.last_token], pos, True))
                rows.append(job)
                samplers.append(job.sampler)
        return work, fed, rows, samplers, scored

    def _score_prompts(
        self, logits, work: list[StreamWork], scored: list[tuple[_Job, int, int]]
    ) -> np.ndarray:
        """Turn the step's all-position rows into the scored jobs' prompt logprobs; return
        the rows to sample (each item's last row where it asked for one)."""
        if isinstance(logits, torch.Tensor):
            logits = logits.detach().float().cpu().numpy()
        pick: list[int] = []
        blocks: dict[int, int] = {}  # slot -> first row of its block
        num_rows = 0
        for w in work:
            if w.all_logits:
                blocks[w.slot] = num_rows
                num_rows += len(w.token_ids)
                if w.want_logits:
                    pick.append(num_rows - 1)
            elif w.want_logits:
                pick.append(num_rows)
                num_rows += 1
        for job, start, n in scored:
            prompt, req = job.request.prompt_ids, job.request
            # row i predicts the prompt token at start + i + 1
            first = max(start + 1, req.prompt_logprobs_from, 1)
            last = min(start + n, len(prompt) - 1)  # the last predicted position
            if first > last:
                continue
            offset = blocks[job.slot] + first - 1 - start
            block = logits[offset : offset + last - first + 1]
            job.prompt_logprobs.extend(
                block_logprobs(block, prompt[first : last + 1], req.prompt_logprobs)
            )
        return logits[pick]

    def _run_step(self, free_slots: list[int]) -> None:
        work, fed, rows, samplers, scored = self._plan()
        if not work:
            return
        step_start_ns = time.monotonic_ns()
        try:
            logits = self.engine.step(work)
            if scored:
                logits = self._score_prompts(logits, work, scored)
            tokens = sample(logits, samplers)
        except Exception as exc:  # noqa: BLE001 - fail the streams concerned, keep serving
            # An EngineError naming slots left the other streams untouched: they run again next
            # step. Any other failure fails every stream of the step.
            slots = exc.slots if isinstance(exc, EngineError) else ()
            slots = slots or tuple(w.slot for w in work)
            failed = [j for j in self._running if j.slot in slots]
            self.step_counters["step_errors"] += 1
            log.exception("engine step failed for slots %s", [j.slot for j in failed])
            outputs = []
            for job in failed:
                self._running.remove(job)
                self._release(job, free_slots)
                outputs.append(
                    (job, -1, "error", f"engine error: {exc}", time.monotonic_ns(), None)
                )
            self._post(self._deliver, outputs)
            return
        now_ns = time.monotonic_ns()
        counters = self.step_counters
        counters["steps"] += 1
        outputs = []
        for job, n in fed:
            if job.num_fed == 0:  # the stream's first step: its counters exist from here on
                job.prefill_start_ns = step_start_ns
                if self._stream_usage is not None:
                    job.usage = self._stream_usage(job.slot)
            job.num_fed += n
            counters["prompt_tokens"] += n
            if self.prefix_cache is not None and job.num_fed % self.chunk_size == 0:
                self._take_snapshot(job)
            if job.max_new_tokens == 0 and job.num_fed == len(job.request.prompt_ids):
                self._running.remove(job)  # scored, nothing to generate
                self._release(job, free_slots)
                outputs.append((job, None, "length", None, now_ns, None))
        for job, token in zip(rows, tokens, strict=True):
            job.num_generated += 1
            job.last_token = token
            finish = None
            if token in job.request.stop_token_ids:
                finish = "stop"
            elif job.num_generated >= job.max_new_tokens:
                finish = "length"
            if finish is not None:
                self._running.remove(job)
                self._release(job, free_slots)
            outputs.append((job, token, finish, None, now_ns, job.sampler.last_logprob))
        counters["generated_tokens"] += len(rows)
        self._handoff.post(self._deliver, outputs)  # not through _post: one call less here


def _set_result(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
