"""The worker threads for the CPU-heavy part of large requests: rendering a long conversation,
tokenizing a long prompt, compiling a large grammar and building its matchers.

They are few and apart from asyncio's default pool, so that large requests queue behind each
other and never take the threads that small requests' short work uses (six 20-second renders on
the default pool made every other request that needed a thread wait). A job waits for a thread
only while its client is connected: a client that leaves cancels its job if it has not started,
and is answered at once if it has (the job then runs to its end; the limits in glm53.api.limits
bound how long that is). When every thread is busy and `max_waiting` jobs wait, a new large
request gets 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from glm53.api.errors import ApiError
from glm53.api.http import ClientGone, DisconnectWatcher

T = TypeVar("T")

NUM_THREADS = 2
MAX_WAITING = 8


class Offload:
    """Owned by the event loop; `run` is called from it."""

    def __init__(self, num_threads: int = NUM_THREADS, max_waiting: int = MAX_WAITING):
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="glm53-offload")
        self.num_threads = num_threads
        self.max_waiting = max_waiting
        self.num_jobs = 0  # submitted and not yet finished or cancelled

    async def run(self, watcher: DisconnectWatcher, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a worker thread; raises ClientGone when the watcher's client leaves
        first, and ApiError 429 when the queue is full."""
        if self.num_jobs >= self.num_threads + self.max_waiting:
            raise ApiError(
                429,
                f"server busy: {self.num_jobs} large requests are being prepared; retry after 1 s",
                code="queue_full",
                headers=((b"retry-after", b"1"),),
            )
        loop = asyncio.get_running_loop()
        self.num_jobs += 1
        job: Future = self._pool.submit(fn, *args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished))
        result = asyncio.wrap_future(job)
        gone = asyncio.ensure_future(watcher.gone.wait())
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not result.done():
            job.cancel()  # a job not yet started never runs; a running one ends on its own
            result.cancel()
            raise ClientGone()
        return result.result()

    def _finished(self) -> None:
        self.num_jobs -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
