# O_DIRECT batch reader and writer: the Python door to pyx/odirect.c; and sha256_many, the
# door to the multi-buffer SHA-256 of pyx/sha256mb.h that the store hashes records with.
#
# Reader and Writer queue requests (file offset, length, buffer, tag) for a pool of native
# threads; the GIL is released while they wait. A request's buffer (and done-flag word) stays
# referenced until its completion is collected from the native queue. One thread owns each
# Reader/Writer: methods are not meant to be called from several Python threads at once.
cimport cython
from cpython.buffer cimport (
    PyBUF_ANY_CONTIGUOUS,
    PyBUF_WRITABLE,
    PyBuffer_FillInfo,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from posix.stdlib cimport posix_memalign

from odirect cimport *
from sha256mb cimport *

import enum
import errno
import operator
import os
import time

import numpy as np

FIX = "put the store on local xfs or ext4"
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_WAIT_SLICE_NS = 100_000_000  # wake this often to let Ctrl-C through

cdef enum:
    DRAIN_BATCH = 256


class ODirectError(OSError):
    """An O_DIRECT open, probe, read or write failed. `offset` is the file offset where a
    transfer failed (None for open and probe errors)."""

    def __init__(self, errno_, message, offset=None):
        super().__init__(errno_, message)
        self.offset = offset


class Priority(enum.IntEnum):
    DEMAND = G53_OD_DEMAND
    PREFETCH = G53_OD_PREFETCH


class DoneFlag(enum.IntEnum):
    """Values the reader stores in a request's done-flag word (uint32)."""

    PENDING = G53_OD_PENDING
    OK = G53_OD_OK
    FAILED = G53_OD_FAILED


class Completion:
    """A finished request: status is 0 or -errno; error is the ODirectError when it failed."""

    __slots__ = ("tag", "status", "error")

    def __init__(self, tag, status, error):
        self.tag = tag
        self.status = status
        self.error = error

    @property
    def ok(self):
        return self.status == 0

    def check(self):
        if self.error is not None:
            raise self.error

    def __repr__(self):
        return f"Completion(tag={self.tag!r}, status={self.status})"


# ---- filesystem facts and probe ---------------------------------------------------------------

def _unescape_mount(field):
    # /proc/mounts writes space, tab, newline and backslash as \ooo octal
    out, i = [], 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_of(path, mounts_text=None):
    """(fstype, mount point) of the mount holding path: the longest mount-point prefix of its
    real path in /proc/mounts (or in mounts_text, same format). ("unknown", "") if none."""
    real = os.path.realpath(os.fspath(path))
    if mounts_text is None:
        with open("/proc/mounts") as f:
            mounts_text = f.read()
    best_type, best_mount = "unknown", ""
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = _unescape_mount(fields[1])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        # a later line for the same point is mounted over the earlier one, hence >=
        if inside and len(mount) >= len(best_mount):
            best_type, best_mount = fields[2], mount
    return best_type, best_mount


def _refusal(path, err):
    fstype, mount = filesystem_of(path)
    return ODirectError(
        err, f"{path} ({fstype} at {mount}) does not support O_DIRECT: {os.strerror(err)}; {FIX}"
    )


def probe(path):
    """Checks that path (the store file, or the directory that will hold it) supports O_DIRECT.
    A file: one O_DIRECT read of its first 4 KiB. A directory: O_DIRECT write, read back and
    delete of a 4 KiB probe file. Raises ODirectError naming the path, filesystem type and fix."""
    path = os.fspath(path)
    fstype, mount = filesystem_of(path)
    if fstype in MEMORY_FILESYSTEMS:
        raise ODirectError(
            errno.EINVAL,
            f"{path} ({fstype} at {mount}) is memory-backed: the kernel may accept O_DIRECT "
            f"there but serves it from RAM, so a store on it only duplicates RAM; {FIX}",
        )
    if os.path.isdir(path):
        target = os.path.join(path, f".odirect-probe-{os.getpid()}")
        rc = g53_od_probe_dir(os.fsencode(target))
    elif os.path.exists(path):
        rc = g53_od_probe_file(os.fsencode(path))
    else:
        raise FileNotFoundError(
            errno.ENOENT, f"probe: {path} does not exist; give the store file or its directory"
        )
    if rc == -errno.EINVAL or rc == -errno.EOPNOTSUPP:
        raise _refusal(path, -rc)
    if rc == -errno.ENODATA:
        raise ODirectError(errno.ENODATA, f"probe: {path} is empty; nothing to read with O_DIRECT")
    if rc != 0:
        raise ODirectError(
            -rc, f"O_DIRECT probe of {path} ({fstype} at {mount}) failed: {os.strerror(-rc)}"
        )


# ---- aligned buffers ----------------------------------------------------------------------------

cdef class _AlignedBlock:
    cdef void *ptr
    cdef Py_ssize_t nbytes

    def __getbuffer__(self, Py_buffer *view, int flags):
        PyBuffer_FillInfo(view, self, self.ptr, self.nbytes, 0, flags)

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def __dealloc__(self):
        free(self.ptr)


def aligned_empty(nbytes, alignment=4096):
    """An uninitialised uint8 numpy array of nbytes whose data address is a multiple of
    alignment (a power of two >= 8). The memory is freed when the array and its views die."""
    nbytes = operator.index(nbytes)
    alignment = operator.index(alignment)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment < 8 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 8, got {alignment}")
    cdef _AlignedBlock block = _AlignedBlock()
    cdef void *ptr = NULL
    if posix_memalign(&ptr, <size_t>alignment, <size_t>max(nbytes, 1)) != 0:
        raise MemoryError(f"cannot allocate {nbytes} bytes aligned to {alignment}")
    block.ptr = ptr
    block.nbytes = nbytes
    return np.frombuffer(block, dtype=np.uint8)


# ---- the queue ---------------------------------------------------------------------------------

cdef class _Pin:
    """Holds a buffer export (so the memory cannot move or vanish) until released."""

    cdef Py_buffer view
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef _Pin _pin(obj, bint writable, what):
    cdef _Pin pin = _Pin()
    cdef int flags = PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0)
    try:
        PyObject_GetBuffer(obj, &pin.view, flags)
    except (BufferError, ValueError) as exc:  # numpy raises ValueError for strides
        need = "writable, contiguous" if writable else "contiguous"
        raise ValueError(f"{what} must be a {need} buffer ({exc})") from None
    pin.held = True
    return pin


def _check_config(threads, piece_bytes):
    threads = operator.index(threads)
    piece_bytes = operator.index(piece_bytes)
    if not 1 <= threads <= G53_OD_MAX_THREADS:
        raise ValueError(f"threads must be 1..{G53_OD_MAX_THREADS}, got {threads}")
    if not 0 < piece_bytes <= G53_OD_MAX_PIECE_BYTES or piece_bytes % G53_OD_MIN_ALIGNMENT:
        raise ValueError(
            f"piece_bytes must be a positive multiple of {G53_OD_MIN_ALIGNMENT} up to "
            f"{G53_OD_MAX_PIECE_BYTES}, got {piece_bytes}"
        )
    return threads, piece_bytes


@cython.no_gc_clear  # the pins must outlive the native threads that write through them
cdef class _Queue:
    cdef g53_od *od
    cdef readonly str path
    cdef readonly uint64_t alignment
    cdef readonly uint64_t piece_bytes
    cdef readonly int num_threads
    cdef int mode
    cdef str verb
    cdef uint64_t next_serial
    cdef dict inflight  # serial -> (tag, offset, length, pins)
    cdef dict serial_of  # tag -> serial, for requests in flight
    cdef dict done  # tag -> Completion, finished and not yet collected

    def __cinit__(self):
        self.od = NULL
        self.inflight = {}
        self.serial_of = {}
        self.done = {}

    cdef _open(self, path, int mode, threads, piece_bytes, bint truncate):
        if self.od != NULL:
            raise ValueError(f"{type(self).__name__} for {self.path} is already open")
        threads, piece_bytes = _check_config(threads, piece_bytes)
        self.path = os.fspath(path)
        self.mode = mode
        self.verb = "read" if mode == G53_OD_READ else "write"
        cdef g53_od_config config
        config.mode = mode
        config.num_threads = threads
        config.piece_bytes = piece_bytes
        config.truncate = truncate
        cdef bytes encoded = os.fsencode(self.path)
        cdef const char *cpath = encoded
        cdef int rc
        with nogil:
            rc = g53_od_open(cpath, &config, &self.od)
        if rc == -errno.EDOM:
            raise ValueError(
                f"piece_bytes {piece_bytes} is not a multiple of the direct-I/O alignment of "
                f"{self.path}"
            )
        if rc == -errno.EINVAL:
            raise _refusal(self.path, errno.EINVAL)
        if rc != 0:
            raise ODirectError(
                -rc, f"cannot open {self.path} for O_DIRECT {self.verb}s: {os.strerror(-rc)}"
            )
        self.alignment = g53_od_alignment(self.od)
        self.piece_bytes = g53_od_piece_bytes(self.od)
        self.num_threads = g53_od_num_threads(self.od)

    def __dealloc__(self):
        if self.od != NULL:
            with nogil:
                g53_od_free(self.od)  # cancels queued requests and joins the threads
            self.od = NULL

    @property
    def closed(self):
        return self.od == NULL

    @property
    def num_in_flight(self):
        """Requests submitted and not yet finished."""
        return 0 if self.od == NULL else g53_od_num_in_flight(self.od)

    @property
    def handle(self):
        """The native g53_od* as an int, valid until close(), for Cython code that cimports
        odirect.pxd. Requests submitted that way must use G53_OD_NO_COMPLETION."""
        self._check_open()
        return <uintptr_t>self.od

    cdef _check_open(self):
        if self.od == NULL:
            raise ValueError(f"{type(self).__name__} for {self.path} is closed")

    def submit(self, offset, length, buf, tag, priority=Priority.DEMAND, *, flag=None):
        """Queues one request: length bytes between the file at offset and the start of buf.
        flag: optional buffer whose first 4 bytes (a 4-aligned uint32, e.g. words[i:i+1]) get
        DoneFlag.PENDING now and OK or FAILED when the request finishes."""
        self._submit([(offset, length, buf, tag, priority, flag)])

    def submit_many(self, requests):
        """Queues (offset, length, buf, tag[, priority[, flag]]) tuples, all or none."""
        self._submit([tuple(r) for r in requests])

    cdef _submit(self, list batch):
        self._check_open()
        cdef Py_ssize_t n = len(batch)
        if n == 0:
            return
        if n > 1 << 30:
            raise ValueError(f"too many requests in one batch: {n}")
        cdef g53_od_request *reqs = <g53_od_request *>malloc(n * sizeof(g53_od_request))
        if reqs == NULL:
            raise MemoryError("cannot allocate the request batch")
        cdef list records = []
        cdef set batch_tags = set()
        cdef Py_ssize_t i
        cdef int rc
        try:
            for i in range(n):
                records.append(self._fill(&reqs[i], batch[i], i, n, batch_tags))
            rc = g53_od_submit(self.od, reqs, <int>n)
        finally:
            free(reqs)
        if rc == -errno.ENOMEM:
            raise MemoryError("the native reader could not allocate its request records")
        if rc != 0:
            raise ODirectError(-rc, f"submit to {self.path} refused: {os.strerror(-rc)}")
        for serial, tag, record in records:
            self.inflight[serial] = record
            self.serial_of[tag] = serial

    cdef tuple _fill(self, g53_od_request *req, item, Py_ssize_t index, Py_ssize_t n,
                     set batch_tags):
        where = "" if n == 1 else f"request {index}: "
        if not 4 <= len(item) <= 6:
            raise ValueError(f"{where}expected (offset, length, buf, tag[, priority[, flag]])")
        offset, length, buf, tag = item[:4]
        priority = Priority(item[4] if len(item) > 4 else Priority.DEMAND)
        flag = item[5] if len(item) > 5 else None
        offset = operator.index(offset)
        length = operator.index(length)
        a = self.alignment
        if offset < 0 or offset % a:
            raise ValueError(
                f"{where}offset {offset} is not a multiple of {a}, the O_DIRECT alignment of "
                f"{self.path}"
            )
        if length <= 0 or length % a:
            raise ValueError(f"{where}length {length} is not a positive multiple of {a}")
        hash(tag)
        if tag in self.serial_of or tag in self.done or tag in batch_tags:
            raise ValueError(
                f"{where}tag {tag!r} is already used by a request not yet collected; "
                "collect it with wait() or poll() first"
            )
        batch_tags.add(tag)

        cdef _Pin data = _pin(buf, self.mode == G53_OD_READ, "buf")
        cdef uintptr_t addr = <uintptr_t>data.view.buf
        if data.view.len < length:
            raise ValueError(f"{where}buf holds {data.view.len} bytes, fewer than length {length}")
        if addr % a:
            raise ValueError(
                f"{where}buf address 0x{addr:x} is not {a}-aligned; "
                "allocate it with aligned_empty()"
            )
        cdef _Pin word = None
        cdef uint32_t *done_word = NULL
        if flag is not None:
            word = _pin(flag, True, "flag")
            done_word = <uint32_t *>word.view.buf
            if word.view.len < 4 or <uintptr_t>done_word % 4:
                raise ValueError(f"{where}flag must be a 4-aligned buffer of at least 4 bytes")

        cdef uint64_t serial = self.next_serial
        self.next_serial += 1
        req.offset = offset
        req.length = length
        req.addr = data.view.buf
        req.tag = serial
        req.done_word = done_word
        req.priority = priority
        req.options = 0
        return serial, tag, (tag, offset, length, (data, word))

    cdef list _drain(self, int min_count, int64_t timeout_ns):
        cdef g53_od_completion out[DRAIN_BATCH]
        cdef int n, i
        cdef list finished = []
        while True:
            with nogil:
                n = g53_od_wait(self.od, min_count, timeout_ns, out, DRAIN_BATCH)
            for i in range(n):
                finished.append(self._finish(&out[i]))
            if n < DRAIN_BATCH:
                return finished
            min_count = 0

    cdef object _finish(self, g53_od_completion *c):
        record = self.inflight.pop(c.tag, None)
        if record is None:
            raise RuntimeError(
                f"completion for unknown native tag {c.tag} on {self.path}: a native caller "
                "submitted through handle without G53_OD_NO_COMPLETION"
            )
        tag, offset, length, _pins = record  # dropping the pins releases the buffers
        del self.serial_of[tag]
        error = None
        if c.status != 0:
            error = self._error(offset, length, -c.status, c.error_offset)
        self.done[tag] = Completion(tag, c.status, error)
        return tag

    def _error(self, offset, length, err, error_offset):
        what = f"{self.verb} of {length} bytes at offset {offset} of {self.path}"
        if err == errno.ECANCELED:
            message = f"{what} was cancelled by close() at offset {error_offset}"
        elif err == errno.ENODATA:
            try:
                size = f"the file has {os.stat(self.path).st_size} bytes"
            except OSError as exc:
                size = f"size unknown: {exc.strerror}"
            message = f"{what} ran past the end of the file at offset {error_offset} ({size})"
        else:
            message = f"{what} failed at offset {error_offset}: {os.strerror(err)}"
        return ODirectError(err, message, error_offset)

    def poll(self):
        """Every finished request not yet collected, as Completions; never blocks."""
        if self.od != NULL:
            self._drain(0, 0)
        finished = list(self.done.values())
        self.done.clear()
        return finished

    def wait(self, tags=None, timeout=None):
        """Blocks until the requests with these tags (default: every request not yet collected)
        have finished and returns their Completions in the order of tags. Failed requests come
        back with .error set; call .check() to raise it. Raises TimeoutError after timeout s,
        leaving the requests to a later wait() or poll()."""
        wanted = list(self.serial_of) + list(self.done) if tags is None else list(tags)
        for tag in wanted:
            if tag not in self.serial_of and tag not in self.done:
                raise ValueError(f"tag {tag!r} is not a request in flight or finished")
        pending = {tag for tag in wanted if tag not in self.done}
        deadline = None if timeout is None else time.monotonic() + timeout
        cdef int64_t slice_ns
        while pending:
            slice_ns = _WAIT_SLICE_NS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{len(pending)} of {len(wanted)} requests on {self.path} still in flight "
                        f"after {timeout} s"
                    )
                slice_ns = min(slice_ns, int(left * 1e9) + 1)
            for tag in self._drain(1, slice_ns):
                pending.discard(tag)
            PyErr_CheckSignals()
        return [self.done.pop(tag) for tag in wanted]

    def close(self, cancel=False):
        """Stops the threads: finishes every queued request, or with cancel=True completes the
        unstarted ones as cancelled (ECANCELED); pieces already reading always finish. Finished
        requests stay available to poll() and wait()."""
        if self.od == NULL:
            return
        cdef int c = bool(cancel)
        with nogil:
            g53_od_shutdown(self.od, c)
        self._drain(0, 0)
        assert not self.inflight, "native queue finished without reporting every request"
        g53_od_free(self.od)
        self.od = NULL

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(cancel=exc_type is not None)

    def __repr__(self):
        state = "closed" if self.od == NULL else f"in_flight={self.num_in_flight}"
        return (
            f"<{type(self).__name__} {self.path} threads={self.num_threads} "
            f"piece_bytes={self.piece_bytes} {state}>"
        )


cdef class Reader(_Queue):
    """Reads a file opened with O_RDONLY | O_DIRECT through `threads` native threads; requests
    are split into pieces of piece_bytes. Owned by one Python thread."""

    def __init__(self, path, threads=4, piece_bytes=G53_OD_DEFAULT_PIECE_BYTES):
        self._open(path, G53_OD_READ, threads, piece_bytes, False)


cdef class Writer(_Queue):
    """Writes caller buffers to a file opened with O_WRONLY | O_CREAT | O_DIRECT (O_TRUNC with
    truncate=True) through `threads` native threads. Owned by one Python thread."""

    def __init__(self, path, threads=4, piece_bytes=G53_OD_DEFAULT_PIECE_BYTES, *, truncate=False):
        self._open(path, G53_OD_WRITE, threads, piece_bytes, truncate)

    def preallocate(self, offset, length):
        """Reserves disk blocks for [offset, offset + length) with fallocate; the file grows to
        cover the range."""
        self._check_open()
        offset = operator.index(offset)
        length = operator.index(length)
        if offset < 0 or length <= 0:
            raise ValueError(
                f"preallocate needs offset >= 0 and length > 0, got {offset}, {length}"
            )
        cdef int rc
        cdef uint64_t o = offset, n = length
        with nogil:
            rc = g53_od_preallocate(self.od, o, n)
        if rc != 0:
            raise ODirectError(
                -rc, f"cannot preallocate {length} bytes at offset {offset} of {self.path}: "
                f"{os.strerror(-rc)}"
            )

    def sync(self):
        """fdatasync: makes the writes finished so far durable."""
        self._check_open()
        cdef int rc
        with nogil:
            rc = g53_od_sync(self.od)
        if rc != 0:
            raise ODirectError(-rc, f"fdatasync of {self.path} failed: {os.strerror(-rc)}")


# ---- record hashing ----------------------------------------------------------------------------

SHA256_LANES = g53_sha256_lanes()


def sha256_many(buffers):
    """The SHA-256 digests (32 bytes each, in order) of a sequence of contiguous buffers, hashed
    side by side in the 16 lanes of AVX-512 registers with the GIL released. Any number of
    buffers of any lengths; they are taken 16 at a time, and buffers of one length keep every
    lane busy. Raises RuntimeError where SHA256_LANES is 0 (a CPU without AVX-512F and
    AVX-512BW): hash with hashlib there."""
    if SHA256_LANES == 0:
        raise RuntimeError(
            "sha256_many needs AVX-512F and AVX-512BW, which this CPU lacks; use hashlib"
        )
    cdef list items = list(buffers)
    cdef Py_ssize_t n = len(items)
    if n > 1 << 30:
        raise ValueError(f"too many buffers in one call: {n}")
    if n == 0:
        return []
    cdef list pins = []
    cdef _Pin pin
    cdef Py_ssize_t i
    cdef const uint8_t **data = <const uint8_t **>malloc(n * sizeof(uint8_t *))
    cdef uint64_t *lengths = <uint64_t *>malloc(n * sizeof(uint64_t))
    cdef bytearray out = bytearray(n * G53_SHA256_DIGEST_BYTES)
    cdef uint8_t *digests = <uint8_t *>(<char *>out)
    cdef int rc
    try:
        if data == NULL or lengths == NULL:
            raise MemoryError("cannot allocate the buffer table")
        for i in range(n):
            pin = _pin(items[i], False, f"buffers[{i}]")
            pins.append(pin)
            data[i] = <const uint8_t *>pin.view.buf
            lengths[i] = <uint64_t>pin.view.len
        with nogil:
            rc = g53_sha256_many(data, lengths, <int>n, digests)
    finally:
        free(data)
        free(lengths)
    if rc != 0:
        raise OSError(-rc, f"sha256_many failed: {os.strerror(-rc)}")
    return [bytes(out[i * 32:(i + 1) * 32]) for i in range(n)]
