"""The step loop: the scheduler's loop for a step engine (glm53.engine.base.Engine: the CPU and
scripted engines), on the engine thread.

Each turn: take new and cancelled jobs, fill free slots from the queue, plan one step (every
decoding stream gets its next token; prompts are fed in chunks of at most `chunk_size` tokens per
step, over all prefilling streams, each stream's chunks cut at multiples of `chunk_size` from its
position 0), run it, sample each stream's token, and post the step's JobEvents to the event loop
in one `Handoff.post` (glm53._handoff).

What the engine thread does between two steps is added to every token (bench/server_overhead.py
measures it), and it runs with caches cold after the wait for the step, so it is kept short:
sampling is one native call (glm53.engine.sampling), the post is one eventfd write with the GIL
held, and a step with no new or cancelled job takes no lock.

Logprobs: a sampled token's come from its sampler (glm53.engine.sampling); a scored prompt's
chunks ask the engine for every position's logits (StreamWork.all_logits), turned into entries
here (glm53.engine.logprobs), only for the jobs that asked.

Prefix cache (glm53.engine.prefix_cache), with an engine that implements PrefixSnapshots and
`prefix_cache_bytes` > 0: a new job whose prompt starts with the tokens of a snapshot is given
that state in its slot and starts prefilling at the snapshot's length (its `num_cached`); every
prefill chunk that ends at a multiple of `chunk_size` leaves a snapshot. Chunks are cut at the
same multiples whether a job resumed or started cold, and whatever other streams prefill in the
same steps, so neither a hit nor a neighbour changes a stream's tokens or logits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from glm53.engine.base import EngineError, FinishReason, StreamWork
from glm53.engine.inbox import EngineLoop
from glm53.engine.logprobs import block_logprobs
from glm53.engine.prefix_cache import PrefixCache, Snapshot, chain_keys
from glm53.engine.sampling import StreamSampler, sample
from glm53.engine.stream import EventKind, Job, JobEvent, JobState

log = logging.getLogger("glm53.scheduler")


@dataclass(slots=True)
class StepPlan:
    """One step: the engine's work, and what to do with its logits."""

    work: list[StreamWork] = field(default_factory=list)
    fed: list[tuple[Job, int]] = field(default_factory=list)  # (job, prompt tokens fed)
    rows: list[Job] = field(default_factory=list)  # jobs that get a logits row to sample
    samplers: list[StreamSampler] = field(default_factory=list)  # theirs, in order
    scored: list[tuple[Job, int, int]] = field(default_factory=list)  # (job, start, length)


class StepLoop(EngineLoop):
    """Plans and runs the steps of a step engine; keeps prefix snapshots in `prefix_cache`
    (None: the engine takes none, or the cache is off)."""

    def __init__(self, *args, chunk_size: int, prefix_cache: PrefixCache | None):
        super().__init__(*args)
        self.chunk_size = chunk_size
        self.prefix_cache = prefix_cache
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    def run(self) -> None:
        while True:
            # Unlocked test first: what comes in just after it is taken at the next step.
            if self.inbox.has_news or not self.running:
                cancels = self.take_inbox()
                if self.inbox.is_stopping:
                    return
                for job in cancels:
                    self._drop(job)
            while self.free_slots and (job := self.next_waiting()) is not None:
                job.slot = self.free_slots.pop()
                job.state = JobState.RUNNING
                self.running.append(job)
                if self.prefix_cache is not None:
                    self._resume_prefix(job)
            if self.running:
                self._run_step()

    def _drop(self, job: Job) -> None:
        if job.state is JobState.RUNNING:
            self._retire(job)
        elif job.state is JobState.WAITING:
            self.waiting.remove(job)
            job.state = JobState.FINISHED

    def _retire(self, job: Job) -> None:
        """Take a running job out of the engine: free its slot."""
        self.running.remove(job)
        job.state = JobState.FINISHED
        try:
            self.engine.release(job.slot)
        except Exception:  # noqa: BLE001 - a failed release must not stop the other streams
            log.exception("engine.release(%d) failed", job.slot)
        self.free_slots.append(job.slot)
        job.slot = -1

    def _resume_prefix(self, job: Job) -> None:
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
            self._retire(job)
            message = f"engine error: restoring the cached prefix failed: {exc}"
            self.post([JobEvent.failed(job, message, time.monotonic_ns())])
            return
        job.num_fed = job.num_cached = snap.num_tokens
        self.counters["cached_prompt_tokens"] += snap.num_tokens
        self.counters["requests_prefix_hit"] += 1

    def _take_snapshot(self, job: Job) -> None:
        """Keep the state of a job whose prefill just reached a chunk boundary, unless held."""
        key = job.prefix_keys[job.num_fed // self.chunk_size - 1]
        if self.prefix_cache.has(key):
            return
        try:
            state, num_bytes = self.engine.snapshot(job.slot)
        except Exception:  # noqa: BLE001 - a missing snapshot costs a later prefill, not output
            self.counters["snapshot_errors"] += 1
            log.exception("engine.snapshot(%d) failed", job.slot)
            return
        self.prefix_cache.store(key, Snapshot(state, job.num_fed, num_bytes))

    def _plan(self) -> StepPlan:
        plan = StepPlan()
        budget = self.chunk_size
        for job in self.running:
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
                chunk = prompt[job.num_fed : job.num_fed + n]
                plan.work.append(StreamWork(job.slot, chunk, job.num_fed, samples, scores))
                plan.fed.append((job, n))
                if scores:
                    plan.scored.append((job, job.num_fed, n))
                if samples:
                    plan.rows.append(job)
                    plan.samplers.append(job.sampler)
            else:
                pos = len(prompt) + job.num_generated - 1
                plan.work.append(StreamWork(job.slot, [job.last_token], pos, True))
                plan.rows.append(job)
                plan.samplers.append(job.sampler)
        return plan

    def _score_prompts(self, logits, plan: StepPlan) -> np.ndarray:
        """Turn the step's all-position rows into the scored jobs' prompt logprobs; return
        the rows to sample (each item's last row where it asked for one)."""
        if isinstance(logits, torch.Tensor):
            logits = logits.detach().float().cpu().numpy()
        pick: list[int] = []
        blocks: dict[int, int] = {}  # slot -> first row of its block
        num_rows = 0
        for w in plan.work:
            if w.all_logits:
                blocks[w.slot] = num_rows
                num_rows += len(w.token_ids)
                if w.want_logits:
                    pick.append(num_rows - 1)
            elif w.want_logits:
                pick.append(num_rows)
                num_rows += 1
        for job, start, n in plan.scored:
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

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        # An EngineError naming slots left the other streams untouched: they run again next
        # step. Any other failure fails every stream of the step.
        slots = exc.slots if isinstance(exc, EngineError) else ()
        slots = slots or tuple(w.slot for w in plan.work)
        failed = [j for j in self.running if j.slot in slots]
        self.counters["step_errors"] += 1
        log.exception("engine step failed for slots %s", [j.slot for j in failed])
        events = []
        for job in failed:
            self._retire(job)
            events.append(JobEvent.failed(job, f"engine error: {exc}", time.monotonic_ns()))
        self.post(events)

    def _run_step(self) -> None:
        plan = self._plan()
        if not plan.work:
            return
        step_start_ns = time.monotonic_ns()
        try:
            logits = self.engine.step(plan.work)
            if plan.scored:
                logits = self._score_prompts(logits, plan)
            tokens = sample(logits, plan.samplers)
        except Exception as exc:  # noqa: BLE001 - fail the streams concerned, keep serving
            self._fail_step(plan, exc)
            return
        now_ns = time.monotonic_ns()
        counters = self.counters
        counters["steps"] += 1
        events = []
        for job, n in plan.fed:
            if job.num_fed == 0:  # the stream's first step: its counters exist from here on
                job.prefill_start_ns = step_start_ns
                job.usage = self.engine.stream_usage(job.slot)
            job.num_fed += n
            counters["prompt_tokens"] += n
            if self.prefix_cache is not None and job.num_fed % self.chunk_size == 0:
                self._take_snapshot(job)
            if job.max_new_tokens == 0 and job.num_fed == len(job.request.prompt_ids):
                self._retire(job)  # scored, nothing to generate
                events.append(JobEvent.scored(job, now_ns))
        for job, token in zip(plan.rows, tokens, strict=True):
            job.num_generated += 1
            job.last_token = token
            finish = None
            if token in job.request.stop_token_ids:
                finish = FinishReason.STOP
            elif job.num_generated >= job.max_new_tokens:
                finish = FinishReason.LENGTH
            if finish is not None:
                self._retire(job)
            events.append(
                JobEvent(job, EventKind.TOKEN, now_ns, token, finish, job.sampler.last_logprob)
            )
        counters["generated_tokens"] += len(plan.rows)
        self._handoff.post(self._deliver, events)  # not through post: one call less here
