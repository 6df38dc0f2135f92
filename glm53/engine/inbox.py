"""The inbox between the event loop and the engine thread, and what both engine loops share.

`Inbox`: the event loop puts new jobs and cancels in and says stop; the engine thread takes
them between two steps, and waits on it while it has nothing to run. `EngineLoop` is the base
of the two loops that run on the engine thread (glm53.engine.step_loop for step engines,
glm53.engine.job_loop for job engines): the job lists, the counters, and the post of JobEvents
to the event loop.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from glm53._handoff import Handoff
from glm53.engine.stream import Job, JobEvent, JobState

# The engine thread's counters (Scheduler.step_counters); fixed keys, so that a reader on another
# thread never sees the dict grow.
STEP_COUNTERS = (
    "steps",
    "prompt_tokens",
    "generated_tokens",
    "step_errors",
    "cached_prompt_tokens",
    "requests_prefix_hit",
    "snapshot_errors",
)


class Inbox:
    """New jobs and cancels, in order, from the event loop to the engine thread. `put`, `cancel`
    and `stop` take the lock and wake the engine thread; `has_news` is read without it (they
    only append, under the GIL, and what comes in just after the read is taken next step)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._cancels: list[Job] = []
        self.is_stopping = False

    def put(self, jobs: list[Job]) -> None:
        with self._cv:
            self._jobs.extend(jobs)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            self._cancels.append(job)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self.is_stopping = True
            self._cv.notify()

    @property
    def has_news(self) -> bool:
        return bool(self._jobs or self._cancels or self.is_stopping)

    def take(self, *, is_busy: bool) -> tuple[list[Job], list[Job]]:
        """The new jobs and the cancels, emptied; while there are none and the caller is not
        `is_busy` (has no job to run), wait for some or for `stop`."""
        with self._cv:
            while not (self.is_stopping or self._jobs or self._cancels or is_busy):
                self._cv.wait()
            jobs, self._jobs = self._jobs, []
            cancels, self._cancels = self._cancels, []
        return jobs, cancels

    def pending(self) -> list[Job]:
        """The jobs put in and not yet taken."""
        with self._cv:
            return list(self._jobs)


class EngineLoop:
    """A loop over one engine, on the engine thread, which owns `running`, `waiting` and every
    Job's state. `run` returns when the inbox says stop; `all_jobs` are the ones it leaves."""

    def __init__(
        self,
        engine: Any,
        inbox: Inbox,
        handoff: Handoff,
        deliver: Callable[[list[JobEvent]], None],
        counters: dict[str, int],
        num_slots: int,
    ):
        self.engine = engine
        self.inbox = inbox
        self.counters = counters
        self.num_slots = num_slots
        self.running: list[Job] = []
        self.waiting: collections.deque[Job] = collections.deque()
        self._handoff = handoff
        self._deliver = deliver

    def run(self) -> None:
        raise NotImplementedError

    def post(self, events: list[JobEvent]) -> None:
        """Hand `events` to the event loop (the scheduler delivers them to their streams)."""
        self._handoff.post(self._deliver, events)

    def take_inbox(self) -> list[Job]:
        """Move new jobs to `waiting` (waiting first while there is nothing to run); return the
        cancels, for the caller to drop."""
        jobs, cancels = self.inbox.take(is_busy=bool(self.running or self.waiting))
        self.waiting.extend(jobs)
        return cancels

    def next_waiting(self) -> Job | None:
        """The oldest waiting job that is not cancelled, out of `waiting`; None when none is."""
        while self.waiting:
            job = self.waiting.popleft()
            if not job.is_cancelled:
                return job
            job.state = JobState.FINISHED
        return None

    def all_jobs(self) -> list[Job]:
        return [*self.running, *self.waiting]
