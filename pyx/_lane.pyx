"""The fast-mode CPU lane's mailbox poller: a thin door onto pyx/lane.c (protocol and layout in
pyx/lane_mailbox.h)."""

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t, uintptr_t

from gemv cimport GEMV_MSG_BYTES, GEMV_OK, gemv_expert, gemv_pool


cdef extern from "lane_mailbox.h" nogil:
    enum:
        G53_MBOX_MAX_ROWS
        G53_MBOX_MAX_PICKS
        G53_MBOX_SEQ
        G53_MBOX_N_PICKS
        G53_MBOX_N_ROWS
        G53_MBOX_LAYER
        G53_MBOX_N_HIT
        G53_MBOX_N_MISS
        G53_MBOX_DONE
        G53_MBOX_STATUS
        G53_MBOX_BUDGET
        G53_MBOX_PICKS
        G53_MBOX_PICK_BYTES
        G53_MBOX_ROWS
    size_t G53_MBOX_PARTIAL(int hidden)
    size_t G53_MBOX_BYTES(int hidden)


cdef extern from "lane.h" nogil:
    ctypedef struct g53_lane:
        pass

    ctypedef struct g53_lane_stats:
        uint64_t jobs
        uint64_t empty
        uint64_t discarded
        uint64_t failed
        uint64_t busy_ns
        uint64_t last_job_ns
        int32_t last_slot
        int32_t last_picks

    ctypedef struct g53_lane_slot_stats:
        uint64_t jobs
        uint64_t busy_ns
        uint64_t last_job_ns
        int32_t last_picks

    int g53_lane_get_slot_stats(g53_lane *lane, int slot, g53_lane_slot_stats *out)
    g53_lane *g53_lane_create(gemv_pool *pool, int num_slots, long spin_ns, long max_sleep_ns,
                              char *msg, size_t msg_len)
    int g53_lane_set_slot(g53_lane *lane, int slot, uint8_t *mbox, const gemv_expert *experts,
                          int num_experts, int hidden, int inter, int k2, float act_limit,
                          int variant, int precision, char *msg, size_t msg_len)
    int g53_lane_start(g53_lane *lane, char *msg, size_t msg_len)
    int g53_lane_set_spin(g53_lane *lane, long spin_ns)
    long g53_lane_spin(g53_lane *lane)
    long g53_lane_native_id(g53_lane *lane)
    void g53_lane_destroy(g53_lane *lane)
    void g53_lane_get_stats(g53_lane *lane, g53_lane_stats *out)
    void g53_lane_stall(g53_lane *lane, int slot, uint32_t seq)
    void g53_lane_release(g53_lane *lane)
    int g53_lane_held(g53_lane *lane)
    uint32_t g53_lane_load_acquire(const uint32_t *word)
    void g53_lane_store_release(uint32_t *word, uint32_t value)


MAX_ROWS = G53_MBOX_MAX_ROWS
MAX_PICKS = G53_MBOX_MAX_PICKS


def layout(int hidden):
    """Byte offsets of the mailbox sections for `hidden` (pyx/lane_mailbox.h)."""
    if hidden <= 0 or hidden % 128:
        raise ValueError(f"hidden {hidden} must be a positive multiple of 128")
    return {
        "seq": G53_MBOX_SEQ, "n_picks": G53_MBOX_N_PICKS, "n_rows": G53_MBOX_N_ROWS,
        "layer": G53_MBOX_LAYER, "n_hit": G53_MBOX_N_HIT, "n_miss": G53_MBOX_N_MISS,
        "done": G53_MBOX_DONE, "status": G53_MBOX_STATUS, "budget": G53_MBOX_BUDGET,
        "picks": G53_MBOX_PICKS, "pick_bytes": G53_MBOX_PICK_BYTES, "rows": G53_MBOX_ROWS,
        "partial": G53_MBOX_PARTIAL(hidden), "bytes": G53_MBOX_BYTES(hidden),
    }


def load_acquire(uintptr_t addr):
    """An acquire load of the uint32 at `addr` (a mailbox word)."""
    return g53_lane_load_acquire(<const uint32_t *>addr)


def store_release(uintptr_t addr, uint32_t value):
    """A release store of `value` into the uint32 at `addr` (a mailbox word)."""
    g53_lane_store_release(<uint32_t *>addr, value)


cdef class Lane:
    """The mailbox poller (one native thread, no GIL) over `num_slots` mailboxes, running jobs on
    `pool` (a glm53._gemv.Pool, kept alive by this object). Bind every slot, then start();
    close() (or garbage collection) stops and joins the poller."""

    cdef g53_lane *_lane
    cdef object _pool
    cdef list _refs
    cdef readonly int num_slots
    cdef bint _started

    def __cinit__(self, pool, int num_slots, long spin_ns=200000, long max_sleep_ns=200000):
        if not hasattr(pool, "handle") or not hasattr(pool, "threads"):
            raise TypeError(f"pool must be a glm53._gemv.Pool, got {type(pool).__name__}")
        cdef char msg[GEMV_MSG_BYTES]
        msg[0] = 0
        cdef uintptr_t handle = pool.handle
        self._lane = g53_lane_create(<gemv_pool *>handle, num_slots, spin_ns, max_sleep_ns, msg,
                                     GEMV_MSG_BYTES)
        if self._lane == NULL:
            raise ValueError(f"Lane: {msg.decode(errors='replace')}")
        self._pool = pool
        self._refs = [None] * num_slots
        self.num_slots = num_slots

    def __dealloc__(self):
        if self._lane != NULL:
            with nogil:
                g53_lane_destroy(self._lane)
            self._lane = NULL

    @property
    def spin_ns(self):
        """How long the poller spins after its last job before it sleeps (10 us doubling up to
        max_sleep_ns): a job arriving later waits for the poller's sleep to end."""
        return g53_lane_spin(self._live())

    @spin_ns.setter
    def spin_ns(self, long ns):
        if g53_lane_set_spin(self._live(), ns) != GEMV_OK:
            raise ValueError(f"Lane.spin_ns must be >= 0, got {ns}")

    @property
    def native_id(self):
        """The running poller's kernel thread id, as threading.get_native_id() gives a Python
        thread's (os.sched_setaffinity pins that one thread); 0 before start()."""
        return g53_lane_native_id(self._live())

    def close(self):
        """Stop and join the poller (also while it waits or is held by a stall)."""
        if self._lane != NULL:
            with nogil:
                g53_lane_destroy(self._lane)
            self._lane = NULL

    cdef g53_lane *_live(self) except NULL:
        if self._lane == NULL:
            raise RuntimeError("the lane is closed")
        return self._lane

    def set_slot(self, int slot, mbox, table, float act_limit=10.0, int variant=-1,
                 int precision=0):
        """Bind `slot` to `mbox` (a writable, 64-byte aligned uint8 array of
        layout(table.hidden)["bytes"] bytes) and to the layer's experts `table` (an ExpertTable)."""
        cdef g53_lane *lane = self._live()
        if not all(hasattr(table, a) for a in ("handle", "num_experts", "hidden", "inter", "k2")):
            raise TypeError(f"table must be a glm53._gemv.ExpertTable, got {type(table).__name__}")
        need = G53_MBOX_BYTES(table.hidden)
        if getattr(mbox, "dtype", None) != "uint8" or mbox.ndim != 1 or mbox.size != need \
                or not mbox.flags.c_contiguous or not mbox.flags.writeable:
            raise ValueError(f"slot {slot}: the mailbox must be a writable contiguous uint8 array "
                             f"of {need} bytes")
        cdef char msg[GEMV_MSG_BYTES]
        msg[0] = 0
        cdef uintptr_t addr = mbox.ctypes.data
        cdef uintptr_t experts = table.handle
        cdef int rc = g53_lane_set_slot(lane, slot, <uint8_t *>addr, <const gemv_expert *>experts,
                                        table.num_experts, table.hidden, table.inter, table.k2,
                                        act_limit, variant, precision, msg, GEMV_MSG_BYTES)
        if rc != GEMV_OK:
            raise ValueError(f"Lane.set_slot: {msg.decode(errors='replace')}")
        self._refs[slot] = (mbox, table)

    def start(self):
        cdef g53_lane *lane = self._live()
        cdef char msg[GEMV_MSG_BYTES]
        msg[0] = 0
        cdef int rc = g53_lane_start(lane, msg, GEMV_MSG_BYTES)
        if rc != GEMV_OK:
            raise RuntimeError(f"Lane.start: {msg.decode(errors='replace')}")

    def stats(self):
        """Counters since start: jobs, empty, discarded, failed, busy_ns, last_job_ns,
        last_slot, last_picks (see pyx/lane.h)."""
        cdef g53_lane_stats st
        g53_lane_get_stats(self._live(), &st)
        return {"jobs": st.jobs, "empty": st.empty, "discarded": st.discarded,
                "failed": st.failed, "busy_ns": st.busy_ns, "last_job_ns": st.last_job_ns,
                "last_slot": st.last_slot, "last_picks": st.last_picks}

    def slot_stats(self, int slot):
        """One slot's (layer's) counters: jobs, busy_ns, last_job_ns, last_picks."""
        cdef g53_lane_slot_stats st
        if g53_lane_get_slot_stats(self._live(), slot, &st) != GEMV_OK:
            raise IndexError(f"slot {slot} is outside 0..{self.num_slots - 1}")
        return {"jobs": st.jobs, "busy_ns": st.busy_ns, "last_job_ns": st.last_job_ns,
                "last_picks": st.last_picks}

    def stall(self, int slot, uint32_t seq):
        """Test hook: hold the computed result of (slot, seq) before it is published."""
        g53_lane_stall(self._live(), slot, seq)

    def release(self):
        g53_lane_release(self._live())

    @property
    def held(self):
        """Whether the poller is holding a stalled result now."""
        return bool(g53_lane_held(self._live()))
