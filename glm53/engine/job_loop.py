"""The job loop: the scheduler's loop for a job engine (glm53.engine.base.JobEngine: the GPU
engine over exllamav3's Generator), on the engine thread.

The engine runs whole requests: this loop admits up to `num_slots` jobs, starts them in the
engine, calls `iterate` and posts each job's new tokens (the engine's JobOutputs, as JobEvents)
to the event loop. Admission is FIFO, so jobs submitted together start together, in submission
order. A job the engine fails alone fails alone; an exception out of `iterate` fails every
running job, and the loop goes on serving.
"""

from __future__ import annotations

import logging
import time

import torch

from glm53.engine.base import FinishReason, JobOutput
from glm53.engine.inbox import EngineLoop
from glm53.engine.logprobs import block_logprobs
from glm53.engine.stream import EventKind, Job, JobEvent, JobState

log = logging.getLogger("glm53.scheduler")


class JobLoop(EngineLoop):
    """Starts, iterates and cancels the jobs of a job engine."""

    def run(self) -> None:
        while True:
            if self.inbox.has_news or not self.running:
                cancels = self.take_inbox()
                if self.inbox.is_stopping:
                    return
                for job in cancels:
                    if job.state is JobState.RUNNING:
                        self._cancel_in_engine(job)  # before it leaves the running count
                        self._retire(job)
                    elif job.state is JobState.WAITING:
                        self.waiting.remove(job)
                        job.state = JobState.FINISHED
            while len(self.running) < self.num_slots and (job := self.next_waiting()) is not None:
                self._start_in_engine(job)
            if self.running:
                self._run_iteration()

    def _retire(self, job: Job) -> None:
        self.running.remove(job)
        job.state = JobState.FINISHED

    def _start_in_engine(self, job: Job) -> None:
        try:
            self.engine.start(id(job), job.request, job.max_new_tokens, job.sampler)
        except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
            log.exception("starting a job in the engine failed")
            job.state = JobState.FINISHED
            self.post([JobEvent.failed(job, f"engine error: {exc}", 0)])
            return
        job.slot = len(self.running)
        job.state = JobState.RUNNING
        job.prefill_start_ns = time.monotonic_ns()  # job engines count no tiers per stream yet
        self.running.append(job)

    def _cancel_in_engine(self, job: Job) -> None:
        try:
            self.engine.cancel(id(job))
        except Exception:  # noqa: BLE001 - a failed cancel must not stop the other streams
            log.exception("engine.cancel failed")

    def _fail_all(self, exc: Exception) -> None:
        self.counters["step_errors"] += 1
        log.exception("engine iteration failed for %d jobs", len(self.running))
        failed, self.running = self.running, []
        now_ns = time.monotonic_ns()
        for job in failed:
            job.state = JobState.FINISHED
            self._cancel_in_engine(job)
        self.post([JobEvent.failed(job, f"engine error: {exc}", now_ns) for job in failed])

    def _run_iteration(self) -> None:
        try:
            outs = self.engine.iterate()
        except Exception as exc:  # noqa: BLE001 - fail the jobs, keep serving
            self._fail_all(exc)
            return
        now_ns = time.monotonic_ns()
        self.counters["steps"] += 1
        by_key = {id(job): job for job in self.running}
        events: list[JobEvent] = []
        for out in outs:
            job = by_key.get(out.key)
            if job is not None:
                self._take_output(job, out, now_ns, events)
        if events:
            self.post(events)

    def _take_output(self, job: Job, out: JobOutput, now_ns: int, events: list[JobEvent]) -> None:
        """Turn one JobOutput into the job's events (appended to `events`)."""
        counters = self.counters
        finish = None if out.finish is None else FinishReason(out.finish)
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
            token_finish = finish if i == last and finish is not FinishReason.ERROR else None
            logprob = out.logprobs[i] if out.logprobs is not None else None
            events.append(JobEvent(job, EventKind.TOKEN, now_ns, token, token_finish, logprob))
        counters["generated_tokens"] += len(out.token_ids)
        if finish is FinishReason.ERROR:
            events.append(JobEvent.failed(job, out.error, now_ns))
        elif finish is not None and not out.token_ids:  # a scored prompt, nothing made
            events.append(JobEvent.scored(job, now_ns, finish))
        if finish is not None:
            self._retire(job)
