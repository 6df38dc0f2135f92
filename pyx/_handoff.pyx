# Engine thread -> event loop hand-off through one eventfd (Linux).
#
# The scheduler's engine thread hands each step's tokens to the event loop. A post appends to a
# deque and writes the eventfd, holding the GIL: loop.call_soon_threadsafe does the same write
# through uvloop's Python-level handle machinery, about 10 us more per post after the engine
# thread's wait for a step (caches cold) on a 2-vCPU VM. os.eventfd_write would release the GIL
# around the write, and the event loop it wakes could then take the GIL and run its whole turn
# (about 0.7 ms for one token, cold) before the engine thread got it back.
from libc.errno cimport errno
from posix.unistd cimport close as c_close

import collections
import logging
import os

log = logging.getLogger("glm53.scheduler")


cdef extern from "sys/eventfd.h" nogil:
    int eventfd(unsigned int initval, int flags)
    int eventfd_read(int fd, unsigned long long *value)
    int eventfd_write(int fd, unsigned long long value)
    enum:
        EFD_NONBLOCK
        EFD_CLOEXEC


cdef class Handoff:
    """post(fn, *args) from any thread runs fn(*args) on `loop`, in the order posted. Make it on
    the loop; close() it there once no thread posts any more."""

    cdef int _fd
    cdef object _loop
    cdef object _queue

    def __cinit__(self, loop):
        self._fd = -1

    def __init__(self, loop):
        self._loop = loop
        self._queue = collections.deque()
        cdef int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if fd < 0:
            raise OSError(errno, f"eventfd: {os.strerror(errno)}")
        self._fd = fd
        try:
            loop.add_reader(fd, self._drain)
        except BaseException:
            c_close(fd)
            self._fd = -1
            raise

    def post(self, fn, *args):
        """Queue fn(*args) for the loop and wake it (the GIL is held throughout). After close()
        it does nothing: nobody is listening any more."""
        if self._fd < 0:
            return
        self._queue.append((fn, args))
        eventfd_write(self._fd, 1)  # cannot fail before 2**64 - 2 unread posts

    def _drain(self):
        cdef unsigned long long count
        if self._fd >= 0:
            eventfd_read(self._fd, &count)  # reset before taking, so no post goes unseen
        queue = self._queue
        while queue:
            fn, args = queue.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("a callback posted by the engine thread failed")

    def close(self):
        """Run what is queued and stop watching the eventfd."""
        if self._fd < 0:
            return
        self._drain()
        self._loop.remove_reader(self._fd)
        c_close(self._fd)
        self._fd = -1

    def __dealloc__(self):
        if self._fd >= 0:
            c_close(self._fd)
