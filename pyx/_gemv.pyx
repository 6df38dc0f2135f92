"""CPU expert lane: a thin door onto pyx/gemv*.c (the math and the layouts are in pyx/gemv.h)."""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from gemv cimport *

import numpy as np

MAX_ROWS = GEMV_MAX_ROWS
MAX_PICKS = GEMV_MAX_PICKS
SCALAR = GEMV_SCALAR
AVX2 = GEMV_AVX2
AVX512 = GEMV_AVX512
AVX512_FP16 = GEMV_AVX512_FP16
VARIANTS = tuple(range(GEMV_NUM_VARIANTS))
BEST = GEMV_BEST
EXACT = GEMV_EXACT
FAST = GEMV_FAST
PRECISIONS = tuple(range(GEMV_NUM_PRECISIONS))
CALLER_WAITS = GEMV_CALLER_WAITS
CALLER_HELPS = GEMV_CALLER_HELPS
CALLER_RUNS_ALL = GEMV_CALLER_RUNS_ALL


def variant_name(int variant):
    """'scalar (slow)', 'avx2', 'avx512' or 'avx512-fp16'."""
    return gemv_variant_name(variant).decode()


def variant_supported(int variant):
    """Whether this CPU runs `variant` (0 scalar, 1 avx2, 2 avx512, 3 avx512-fp16)."""
    return bool(gemv_variant_supported(variant))


def precision_name(int precision):
    """'exact' or 'fast'."""
    return gemv_precision_name(precision).decode()


def kernel_supported(int variant, int precision):
    """Whether this CPU runs `variant` at `precision` (EXACT or FAST)."""
    return bool(gemv_kernel_supported(variant, precision))


def best_variant():
    """The fastest variant this CPU runs."""
    return gemv_best_variant()


def _describe(obj):
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return f"{type(obj).__name__} of dtype {obj.dtype} and shape {tuple(obj.shape)}"
    return type(obj).__name__


def _check_array(str what, object arr, object dtype, tuple shape, bint writable=False):
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != shape:
        raise TypeError(f"{what} must be a numpy {np.dtype(dtype).name} array of shape "
                        f"{list(shape)}, got {_describe(arr)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; pass np.ascontiguousarray({what})")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} must be writable")


cdef _raise(int rc, bytes msg, str where):
    text = f"{where}: {msg.decode(errors='replace')}"
    if rc == GEMV_EINVAL:
        raise ValueError(text)
    if rc == GEMV_ENOMEM:
        raise MemoryError(text)
    raise RuntimeError(text)


cdef class ExpertTable:
    """Where the experts of one MoE layer live: per expert, the gate, up and down trellis and
    their suh/svh. Holds references to the arrays it points at. `hidden -> inter` is gate/up,
    `inter -> hidden` is down; `k2` is 2 x bits per weight (6 for 3 bits)."""

    cdef gemv_expert *_e
    cdef readonly int num_experts, hidden, inter, k2
    cdef list _refs

    def __cinit__(self, int num_experts, int hidden, int inter, int k2):
        if num_experts < 1:
            raise ValueError(f"ExpertTable: num_experts must be >= 1, got {num_experts}")
        if hidden <= 0 or hidden % 128 or inter <= 0 or inter % 128:
            raise ValueError(f"ExpertTable: hidden {hidden} and inter {inter} must be positive "
                             "multiples of 128")
        if not (2 <= k2 <= 16) or (k2 % 2 and k2 > 7):
            raise ValueError(f"ExpertTable: k2 {k2} (2 x bits) must be 2..16 or 3, 5, 7")
        self._e = <gemv_expert *>calloc(num_experts, sizeof(gemv_expert))
        if self._e == NULL:
            raise MemoryError("ExpertTable: out of memory")
        self.num_experts, self.hidden, self.inter, self.k2 = num_experts, hidden, inter, k2
        self._refs = [None] * num_experts

    def __dealloc__(self):
        free(self._e)

    cdef _matrix(self, gemv_matrix *dst, str what, object parts, int k, int n):
        if not isinstance(parts, tuple) or len(parts) != 3:
            raise TypeError(f"{what} must be a tuple (trellis, suh, svh), got {_describe(parts)}")
        trellis, suh, svh = parts
        _check_array(f"{what} trellis", trellis, np.int16, (k // 16, n // 16, 8 * self.k2))
        _check_array(f"{what} suh", suh, np.float16, (k,))
        _check_array(f"{what} svh", svh, np.float16, (n,))
        dst.trellis = <const uint8_t *><uintptr_t>trellis.ctypes.data
        dst.suh = <const uint16_t *><uintptr_t>suh.ctypes.data
        dst.svh = <const uint16_t *><uintptr_t>svh.ctypes.data

    def set(self, int index, gate, up, down):
        """Point expert `index` at (trellis int16 [k/16, n/16, 8 k2], suh fp16 [k], svh fp16 [n])
        for each of gate, up and down (views into a packed record work as well)."""
        if not 0 <= index < self.num_experts:
            raise IndexError(f"ExpertTable.set: expert {index} is outside 0..{self.num_experts - 1}")
        cdef gemv_expert e
        self._matrix(&e.gate, f"expert {index} gate", gate, self.hidden, self.inter)
        self._matrix(&e.up, f"expert {index} up", up, self.hidden, self.inter)
        self._matrix(&e.down, f"expert {index} down", down, self.inter, self.hidden)
        self._e[index] = e
        self._refs[index] = (gate, up, down)

    def addresses(self, int index):
        """The nine addresses the kernels read for expert `index`: (gate, up, down) x (trellis,
        suh, svh), 0 where the entry was never set. The RAM tier's check compares them with
        where its slots' records are."""
        if not 0 <= index < self.num_experts:
            raise IndexError(f"ExpertTable.addresses: expert {index} is outside "
                             f"0..{self.num_experts - 1}")
        cdef gemv_expert *e = &self._e[index]
        return (<uintptr_t>e.gate.trellis, <uintptr_t>e.gate.suh, <uintptr_t>e.gate.svh,
                <uintptr_t>e.up.trellis, <uintptr_t>e.up.suh, <uintptr_t>e.up.svh,
                <uintptr_t>e.down.trellis, <uintptr_t>e.down.suh, <uintptr_t>e.down.svh)

    @property
    def handle(self):
        """Address of the gemv_expert array, for C callers (keep this object alive)."""
        return <uintptr_t>self._e


cdef class Job:
    """One submitted MoE job. `wait()` returns its output; `done` reads the done word."""

    cdef gemv_job *_job
    cdef gemv_pick *_picks
    cdef uint32_t _own_done
    cdef gemv_pool *_pool
    cdef object _keep
    cdef readonly object out
    cdef bint _waited

    def __dealloc__(self):
        if self._job != NULL and self._pool != NULL and not self._waited:
            with nogil:
                gemv_pool_wait(self._pool, self._job)
        free(self._job)
        free(self._picks)

    def wait(self):
        """Block (without the GIL) until the job is done; returns `out`."""
        cdef int rc
        with nogil:
            rc = gemv_pool_wait(self._pool, self._job)
        self._waited = True
        if rc != GEMV_OK:
            _raise(rc, b"the job failed while running (status %d)" % rc, "Job.wait")
        return self.out

    @property
    def done(self):
        """Current value of the job's done word (the job's `seq` once finished)."""
        return self._job.done[0]

    @property
    def seq(self):
        return self._job.seq


cdef class Pool:
    """`threads` pinned workers (worker i on cpus[i]; no pinning without cpus) that run one MoE
    job at a time. `handle` is the gemv_pool for C callers (keep this object alive)."""

    cdef gemv_pool *_p
    cdef readonly int threads
    cdef readonly tuple cpus
    cdef uint32_t _seq

    def __cinit__(self, int threads, cpus=None):
        cdef char msg[GEMV_MSG_BYTES]
        cdef int *cpu_list = NULL
        msg[0] = 0
        if threads < 1:
            raise ValueError(f"Pool: threads must be >= 1, got {threads}")
        if cpus is not None:
            cpus = tuple(int(c) for c in cpus)
            if len(cpus) != threads:
                raise ValueError(f"Pool: {threads} threads need {threads} cpus, got {list(cpus)}")
            cpu_list = <int *>malloc(threads * sizeof(int))
            if cpu_list == NULL:
                raise MemoryError("Pool: out of memory")
            for i, c in enumerate(cpus):
                cpu_list[i] = c
        with nogil:
            self._p = gemv_pool_create(cpu_list, threads, msg, GEMV_MSG_BYTES)
        free(cpu_list)
        if self._p == NULL:
            raise RuntimeError(f"Pool: {msg.decode(errors='replace')}")
        self.threads = threads
        self.cpus = cpus

    def __dealloc__(self):
        if self._p != NULL:
            with nogil:
                gemv_pool_destroy(self._p)

    @property
    def handle(self):
        return <uintptr_t>self._p

    @property
    def idle_spin_ns(self):
        """How long an idle worker spins before it sleeps (its wake then costs a futex call)."""
        return gemv_pool_idle_spin(self._p)

    @idle_spin_ns.setter
    def idle_spin_ns(self, long ns):
        if gemv_pool_set_idle_spin(self._p, ns) != GEMV_OK:
            raise ValueError(f"Pool.idle_spin_ns must be >= 0, got {ns}")

    def submit(self, ExpertTable table not None, x, rows, experts, weights, out=None, *,
               int variant=GEMV_BEST, float act_limit=10.0, done=None, int precision=GEMV_EXACT):
        """Queue out[r] = sum over picks (rows[i] == r) of weights[i] * expert(experts[i])(x[r]).

        x: float32 [num_rows, hidden], num_rows 1..8; rows, experts, weights: one entry per pick
        (at most 64); out: float32 [num_rows, hidden] (allocated if None), overwritten; done: an
        optional uint32 array whose element 0 receives the job's sequence number when it is done;
        precision: EXACT (fp16 weights, fp32 products) or FAST (see pyx/gemv_fast.h).
        """
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise TypeError(f"x must be a 2-D float32 numpy array [rows, {table.hidden}], got "
                            f"{_describe(x)}")
        num_rows = x.shape[0]
        if not 1 <= num_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"x has {num_rows} rows; a job takes 1..{GEMV_MAX_ROWS}")
        _check_array("x", x, np.float32, (num_rows, table.hidden))
        if out is None:
            out = np.empty((num_rows, table.hidden), dtype=np.float32)
        _check_array("out", out, np.float32, (num_rows, table.hidden), writable=True)
        rows = np.asarray(rows)
        experts = np.asarray(experts)
        weights = np.asarray(weights)
        if not (rows.ndim == experts.ndim == weights.ndim == 1
                and len(rows) == len(experts) == len(weights)):
            raise ValueError(f"rows, experts and weights must be 1-D and of one length, got "
                             f"{rows.shape}, {experts.shape}, {weights.shape}")
        for name, arr in (("rows", rows), ("experts", experts)):
            if len(arr) and arr.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        num_picks = len(rows)
        if num_picks > GEMV_MAX_PICKS:
            raise ValueError(f"{num_picks} picks; a job takes at most {GEMV_MAX_PICKS}")
        if done is not None and not (isinstance(done, np.ndarray) and done.dtype == np.uint32
                                     and done.ndim == 1 and done.size >= 1
                                     and done.flags.c_contiguous and done.flags.writeable):
            raise TypeError(f"done must be a writable 1-D uint32 numpy array, got {_describe(done)}")
        for i in range(num_picks):
            for name, v in (("row", rows[i]), ("expert", experts[i])):
                if not -2**31 <= v < 2**31:
                    raise ValueError(f"pick {i}: {name} {v} is out of range")
        cdef Job job = Job.__new__(Job)
        job._job = <gemv_job *>calloc(1, sizeof(gemv_job))
        job._picks = <gemv_pick *>calloc(num_picks if num_picks else 1, sizeof(gemv_pick))
        if job._job == NULL or job._picks == NULL:
            raise MemoryError("Pool.submit: out of memory")
        for i in range(num_picks):
            job._picks[i].row = <int32_t>int(rows[i])
            job._picks[i].expert = <int32_t>int(experts[i])
            job._picks[i].weight = float(weights[i])
        self._seq += 1
        cdef gemv_job *j = job._job
        j.hidden, j.inter, j.k2 = table.hidden, table.inter, table.k2
        j.act_limit = act_limit
        j.variant = variant
        j.precision = precision
        j.experts = table._e
        j.num_experts = table.num_experts
        j.x = <const float *><uintptr_t>x.ctypes.data
        j.num_rows = <int32_t>num_rows
        j.picks = job._picks
        j.num_picks = num_picks
        j.out = <float *><uintptr_t>out.ctypes.data
        j.done = &job._own_done if done is None else <uint32_t *><uintptr_t>done.ctypes.data
        j.seq = self._seq
        job.out = out
        cdef char msg[GEMV_MSG_BYTES]
        msg[0] = 0
        cdef int rc
        with nogil:
            rc = gemv_pool_submit(self._p, j, msg, GEMV_MSG_BYTES)
        if rc != GEMV_OK:
            free(job._job)
            job._job = NULL
            _raise(rc, msg, "Pool.submit")
        job._pool = self._p
        job._keep = (self, table, x, done)
        return job

    def run(self, ExpertTable table not None, x, rows, experts, weights, out=None, *,
            int variant=GEMV_BEST, float act_limit=10.0, int precision=GEMV_EXACT):
        """submit(...).wait(): the MoE output rows, float32 [num_rows, hidden]."""
        return self.submit(table, x, rows, experts, weights, out, variant=variant,
                           act_limit=act_limit, precision=precision).wait()

    def run_picks(self, ExpertTable table not None, x, rows, experts, weights, dest, out, *,
                  int variant=GEMV_BEST, float act_limit=10.0, int caller=GEMV_CALLER_WAITS,
                  int precision=GEMV_EXACT):
        """out[dest[i]] = weights[i] * expert(experts[i])(x[rows[i]]) for every pick i, computed
        as one batch of jobs; returns the number of jobs.

        Jobs hold one expert each and at most MAX_ROWS of its picks, in row order (ties in pick
        order), so a pick's output depends only on its expert and the rows of its job, never on
        the other experts of the batch or on which thread ran the job. x: float32 [num_rows,
        hidden]; rows, dest: int64 [picks]; experts: int32 [picks]; weights: float32 [picks];
        out: float32 [n, hidden], only its dest rows written. caller: CALLER_WAITS,
        CALLER_HELPS or CALLER_RUNS_ALL (see gemv.h)."""
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise TypeError(f"x must be a 2-D float32 numpy array [rows, {table.hidden}], got "
                            f"{_describe(x)}")
        _check_array("x", x, np.float32, (x.shape[0], table.hidden))
        if not isinstance(out, np.ndarray) or out.ndim != 2:
            raise TypeError(f"out must be a 2-D float32 numpy array [n, {table.hidden}], got "
                            f"{_describe(out)}")
        _check_array("out", out, np.float32, (out.shape[0], table.hidden), writable=True)
        if not isinstance(rows, np.ndarray) or rows.ndim != 1:
            raise TypeError(f"rows must be a 1-D int64 numpy array, got {_describe(rows)}")
        cdef Py_ssize_t num_picks = rows.shape[0]
        _check_array("rows", rows, np.int64, (num_picks,))
        _check_array("experts", experts, np.int32, (num_picks,))
        _check_array("weights", weights, np.float32, (num_picks,))
        _check_array("dest", dest, np.int64, (num_picks,))
        if caller not in (GEMV_CALLER_WAITS, GEMV_CALLER_HELPS, GEMV_CALLER_RUNS_ALL):
            raise ValueError(f"caller {caller} is not CALLER_WAITS, CALLER_HELPS or "
                             "CALLER_RUNS_ALL")
        if num_picks == 0:
            return 0
        cdef const int64_t[::1] r = rows
        cdef const int32_t[::1] e = experts
        cdef const float[::1] w = weights
        cdef const int64_t[::1] d = dest
        cdef Py_ssize_t i, num_rows = x.shape[0], num_out = out.shape[0]
        for i in range(num_picks):
            if not 0 <= r[i] < num_rows:
                raise ValueError(f"pick {i}: row {r[i]} is outside 0..{num_rows - 1}")
            if not 0 <= e[i] < table.num_experts:
                raise ValueError(f"pick {i}: expert {e[i]} is outside 0..{table.num_experts - 1}")
            if not 0 <= d[i] < num_out:
                raise ValueError(f"pick {i}: dest {d[i]} is outside 0..{num_out - 1}")
        cdef const int64_t[::1] order = np.lexsort((rows, experts)).astype(np.int64, copy=False)
        cdef Py_ssize_t hidden = table.hidden
        cdef const float *xp = <const float *><uintptr_t>x.ctypes.data
        cdef float *op = <float *><uintptr_t>out.ctypes.data
        cdef gemv_job *jobs = <gemv_job *>calloc(num_picks, sizeof(gemv_job))
        cdef gemv_pick *picks = <gemv_pick *>malloc(num_picks * sizeof(gemv_pick))
        cdef float *xs = <float *>malloc(num_picks * hidden * sizeof(float))
        cdef float *ys = <float *>malloc(num_picks * hidden * sizeof(float))
        cdef char msg[GEMV_MSG_BYTES]
        cdef int rc = GEMV_OK, num_jobs = 0
        cdef Py_ssize_t k, start = 0, p
        cdef gemv_job *j
        msg[0] = 0
        try:
            if jobs == NULL or picks == NULL or xs == NULL or ys == NULL:
                raise MemoryError(f"Pool.run_picks: out of memory for {num_picks} picks")
            with nogil:
                for k in range(num_picks + 1):
                    if k < num_picks and k > start and k - start < GEMV_MAX_ROWS \
                            and e[order[k]] == e[order[start]]:
                        continue
                    if k > start:  # picks order[start:k] are one job
                        j = &jobs[num_jobs]
                        num_jobs += 1
                        j.hidden, j.inter, j.k2 = table.hidden, table.inter, table.k2
                        j.act_limit = act_limit
                        j.variant = variant
                        j.precision = precision
                        j.experts = table._e
                        j.num_experts = table.num_experts
                        j.x = xs + start * hidden
                        j.num_rows = <int32_t>(k - start)
                        j.picks = picks + start
                        j.num_picks = <int32_t>(k - start)
                        j.out = ys + start * hidden
                        j.done = NULL
                        for p in range(start, k):
                            picks[p].row = <int32_t>(p - start)
                            picks[p].expert = e[order[p]]
                            picks[p].weight = w[order[p]]
                            memcpy(xs + p * hidden, xp + r[order[p]] * hidden,
                                   hidden * sizeof(float))
                    start = k
                rc = gemv_pool_run_batch(self._p, jobs, num_jobs, caller, msg, GEMV_MSG_BYTES)
                if rc == GEMV_OK:
                    for p in range(num_picks):
                        memcpy(op + d[order[p]] * hidden, ys + p * hidden, hidden * sizeof(float))
            if rc != GEMV_OK:
                _raise(rc, msg, "Pool.run_picks")
        finally:
            free(jobs)
            free(picks)
            free(xs)
            free(ys)
        return num_jobs


def has_previous(int variant, int precision):
    """Whether `tiles(..., previous=True)` has a previous kernel for this variant and precision."""
    return gemv_kernel_previous(variant, precision) != NULL


def tiles(int variant, trellis, xh, int kt0=0, kt1=None, int precision=GEMV_EXACT,
          bint previous=False):
    """One tile kernel on one thread: acc[i] = xh[i, 16 kt0:16 kt1] @ Wq[16 kt0:16 kt1] (fp32;
    FAST: with the unrounded codebook and int16 inputs, pyx/gemv_fast.h).

    trellis: int16 [k/16, n/16, 8 k2]; xh: float32 [m, k] rotated inputs, m 1..8. For tests and
    benchmarks of the kernels alone. previous: run the variant's previous kernel at this precision
    (kept for same-process A/B, never used by a job; see has_previous)."""
    if not (isinstance(trellis, np.ndarray) and trellis.dtype == np.int16 and trellis.ndim == 3
            and trellis.flags.c_contiguous):
        raise TypeError(f"trellis must be a C-contiguous int16 [k/16, n/16, 8 k2] array, got "
                        f"{_describe(trellis)}")
    kt, nt, width = trellis.shape
    if width % 8 or not (2 <= width // 8 <= 16) or (width // 8 % 2 and width // 8 > 7):
        raise ValueError(f"trellis tile width {width} is not 8 * k2 for k2 2..16 or 3, 5, 7")
    if not isinstance(xh, np.ndarray) or xh.ndim != 2:
        raise TypeError(f"xh must be float32 [m, {16 * kt}], got {_describe(xh)}")
    _check_array("xh", xh, np.float32, (xh.shape[0], 16 * kt))
    m = xh.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"xh has {m} rows; the kernels take 1..{GEMV_MAX_ROWS}")
    if kt1 is None:
        kt1 = kt
    if not 0 <= kt0 <= kt1 <= kt:
        raise ValueError(f"tile rows [{kt0}, {kt1}) are not inside [0, {kt})")
    if precision not in (GEMV_EXACT, GEMV_FAST):
        raise ValueError(f"precision {precision} is not EXACT ({GEMV_EXACT}) or FAST ({GEMV_FAST})")
    if not gemv_kernel_supported(variant, precision):
        raise RuntimeError(f"this CPU cannot run the {variant_name(variant)} "
                           f"{precision_name(precision)} kernel")
    cdef gemv_tiles_fn fn = gemv_kernel(variant, precision)
    if previous:
        fn = gemv_kernel_previous(variant, precision)
        if fn == NULL:
            raise ValueError(f"the {variant_name(variant)} {precision_name(precision)} kernel has "
                             f"no previous kernel (has_previous() says which do)")
    acc = np.empty((m, 16 * nt), dtype=np.float32)
    cdef const uint8_t *t = <const uint8_t *><uintptr_t>trellis.ctypes.data
    cdef const float *x = <const float *><uintptr_t>xh.ctypes.data
    cdef float *a = <float *><uintptr_t>acc.ctypes.data
    cdef int c_nt = nt, c_k2 = width // 8, c_kt0 = kt0, c_kt1 = kt1, c_k = 16 * kt, c_m = m
    with nogil:
        fn(t, c_nt, c_k2, c_kt0, c_kt1, x, c_k, c_m, a)
    return acc
