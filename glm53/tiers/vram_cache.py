"""The exact-mode VRAM expert cache: a CLOCK table kept on the GPU (cuda/ec.cu).

Routed experts live at home in pinned host memory; exllamav3's MoE kernels find them
through int64 pointer tables. After each MoE layer's router runs, `route` (one warp)
looks the picks up, admits misses into VRAM slots (evicting with CLOCK), rewrites the
table entries and queues copies that `copy` performs on the same stream, before the MoE
kernel reads the tables. A table entry always points at a valid copy of its expert
(its slot or its home), so the output never depends on what the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from glm53.errors import BuildMismatch

# Mirror of `struct g53_ec` (cuda/glm53_cuda.h), field order as declared there.
EC_FIELDS: list[tuple[str, str, int]] = [
    ("n_slots", "<i4", 1), ("n_active", "<i4", 1), ("n_keys", "<i4", 1),
    ("n_experts", "<i4", 1), ("n_layers", "<i4", 1), ("hand", "<i4", 1),
    ("stamp", "<u4", 1), ("n_jobs", "<i4", 1), ("n_used", "<i4", 1),
    ("slot_bytes", "<i8", 1), ("part_off", "<i8", 3), ("slot_base", "<u8", 1),
    ("key_slot", "<u8", 1), ("slot_key", "<u8", 1), ("slot_ref", "<u8", 1),
    ("slot_stamp", "<u8", 1), ("home", "<u8", 1), ("tables", "<u8", 1),
    ("job_src", "<u8", 1), ("job_dst", "<u8", 1), ("layer_hits", "<u8", 1),
    ("layer_misses", "<u8", 1), ("hits", "<u8", 1), ("misses", "<u8", 1),
    ("admits", "<u8", 1), ("evictions", "<u8", 1), ("pinned_skips", "<u8", 1),
    ("no_victim", "<u8", 1), ("bytes_copied", "<u8", 1), ("key_freq", "<u8", 1),
    ("freq_window", "<i8", 1), ("freq_events", "<i8", 1), ("rejected", "<u8", 1),
]  # fmt: skip
COUNTERS = (
    "hits", "misses", "admits", "evictions", "pinned_skips", "no_victim", "bytes_copied", "rejected",
)  # fmt: skip
FREQ_WINDOW_PER_SLOT = 32  # default admission-filter window: lookups per slot between halvings


def ec_dtype(layout: list[int]) -> np.dtype:
    """The numpy dtype of the struct, with offsets from the compiled library."""
    if len(layout) != len(EC_FIELDS) + 1:
        raise BuildMismatch(
            f"glm53._cuda reports {len(layout) - 1} g53_ec fields, the Python mirror has "
            f"{len(EC_FIELDS)}: rebuild glm53 (pip install .) so both come from one source"
        )
    return np.dtype(
        {
            "names": [f[0] for f in EC_FIELDS],
            "formats": [(f[1], (f[2],)) if f[2] > 1 else f[1] for f in EC_FIELDS],
            "offsets": layout[:-1],
            "itemsize": layout[-1],
        }
    )


@dataclass(frozen=True)
class CacheGeometry:
    n_layers: int  # MoE layers
    n_experts: int  # routed experts per MoE layer
    part_bytes: tuple[int, int, int]  # gate, up, down trellis bytes of one expert

    @property
    def part_off(self) -> tuple[int, int, int]:
        g, u, _ = self.part_bytes
        return (0, g, g + u)

    @property
    def record_bytes(self) -> int:
        """One expert's trellis, gate|up|down, padded to 256 bytes (16-byte vector copies)."""
        return -(-sum(self.part_bytes) // 256) * 256

    @property
    def n_keys(self) -> int:
        return self.n_layers * self.n_experts


class DeviceExpertCache:
    """Owns the slot arena and the CLOCK state in VRAM (torch tensors) and drives the
    route/copy kernels. `home` holds the UVA address of every expert record, `tables`
    the device addresses of exllamav3's pointer tables, [layer][gate, up, down].

    Admission is frequency-gated (TinyLFU's idea over CLOCK): a miss that would evict
    is admitted only if its key was looked up more often than the CLOCK victim's within
    the last ~`freq_window` lookups (default 32 per slot); otherwise it is read zero-copy.
    Under skewed routing this keeps the hot experts resident instead of letting every cold
    miss push one out. `freq_window=0` admits every miss (plain CLOCK)."""

    def __init__(
        self, geo: CacheGeometry, n_slots: int, home, tables, device, copy_blocks=None,
        freq_window: int | None = None,
    ):  # fmt: skip
        import torch

        from glm53 import _cuda

        self.geo, self.n_slots, self.device = geo, int(n_slots), torch.device(device)
        if self.n_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {n_slots}")
        home = np.asarray(home, dtype=np.int64)
        tables = np.asarray(tables, dtype=np.int64).reshape(-1)
        if home.shape != (geo.n_keys,):
            raise ValueError(f"home must have {geo.n_keys} addresses, got {home.shape}")
        if tables.shape != (3 * geo.n_layers,):
            raise ValueError(f"tables must have {3 * geo.n_layers} addresses, got {tables.shape}")
        if any(h % 16 for h in home):
            raise ValueError("every home record must be 16-byte aligned")
        if freq_window is None:
            freq_window = FREQ_WINDOW_PER_SLOT * self.n_slots
        if freq_window < 0:
            raise ValueError(f"freq_window must be >= 0 (0 = admit every miss), got {freq_window}")
        self.freq_window = int(freq_window)

        dev = self.device
        t = {
            "slots": torch.empty(self.n_slots * geo.record_bytes, dtype=torch.uint8, device=dev),
            "key_slot": torch.full((geo.n_keys,), -1, dtype=torch.int32, device=dev),
            "slot_key": torch.full((self.n_slots,), -1, dtype=torch.int32, device=dev),
            "slot_ref": torch.zeros(self.n_slots, dtype=torch.uint8, device=dev),
            "slot_stamp": torch.zeros(self.n_slots, dtype=torch.int32, device=dev),
            "home": torch.from_numpy(home).to(dev),
            "tables": torch.from_numpy(tables).to(dev),
            "job_src": torch.zeros(_cuda.MAX_PICKS, dtype=torch.int64, device=dev),
            "job_dst": torch.zeros(_cuda.MAX_PICKS, dtype=torch.int64, device=dev),
            "layer_hits": torch.zeros(geo.n_layers, dtype=torch.int64, device=dev),
            "layer_misses": torch.zeros(geo.n_layers, dtype=torch.int64, device=dev),
            "key_freq": torch.zeros(geo.n_keys, dtype=torch.int32, device=dev),  # uint32 on device
        }
        self._t = t
        self._dtype = ec_dtype(_cuda.ec_layout())
        s = np.zeros(1, dtype=self._dtype)[0]
        s["n_slots"] = s["n_active"] = self.n_slots
        s["n_keys"], s["n_experts"], s["n_layers"] = geo.n_keys, geo.n_experts, geo.n_layers
        s["slot_bytes"] = geo.record_bytes
        s["part_off"] = geo.part_off
        s["slot_base"] = t["slots"].data_ptr()
        for name in ("key_slot", "slot_key", "slot_ref", "slot_stamp", "home", "tables"):
            s[name] = t[name].data_ptr()
        for name in ("job_src", "job_dst", "layer_hits", "layer_misses", "key_freq"):
            s[name] = t[name].data_ptr()
        s["freq_window"] = self.freq_window
        raw = np.frombuffer(s.tobytes(), dtype=np.uint8).copy()
        self._struct = torch.from_numpy(raw).to(dev)
        self._ptr = self._struct.data_ptr()
        props = torch.cuda.get_device_properties(dev)
        self.copy_blocks = int(copy_blocks or 4 * props.multi_processor_count)
        self._cuda = _cuda
        self.lent = 0  # slots lent to a layer-major prefill (lend)

    def _host_struct(self) -> np.ndarray:
        """A host copy of the device struct, one element (a device read: waits for the stream)."""
        return np.frombuffer(self._struct.cpu().numpy().tobytes(), dtype=self._dtype).copy()

    def _store_struct(self, arr: np.ndarray) -> None:
        """Write a host copy (_host_struct) back to the device struct, on the current stream."""
        import torch

        self._struct.copy_(torch.from_numpy(arr.view(np.uint8).copy()).to(self.device))

    def _stream(self) -> int:
        import torch

        return torch.cuda.current_stream(self.device).cuda_stream

    def route(self, layer: int, selected, admit: bool = True) -> None:
        """Look up one MoE layer's picks (an int64 CUDA tensor of expert ids) and, when
        admit, bring misses into slots; the copy is queued on the current stream."""
        n = selected.numel()
        if n > self._cuda.MAX_PICKS:
            raise ValueError(
                f"{n} picks in one call exceed the cache's limit of {self._cuda.MAX_PICKS}: "
                "route decode steps only (prefill reads misses zero-copy)"
            )
        if not selected.is_contiguous() or selected.dtype.itemsize != 8:
            raise ValueError("selected experts must be a contiguous int64 CUDA tensor")
        stream = self._stream()
        self._cuda.ec_route(self._ptr, selected.data_ptr(), n, layer, admit, stream)
        if admit:
            self._cuda.ec_copy(self._ptr, self.copy_blocks, stream)

    @property
    def num_keys(self) -> int:
        """Experts the cache can hold keys of (MoE layers x experts): a heat list's range."""
        return self.geo.n_keys

    def reset_tables(self) -> None:
        self._cuda.ec_reset_tables(self._ptr, self._stream())

    def empty(self, forget: bool = False) -> None:
        """Every key out of its slot (the slots CLOCK holds; lent slots hold none) and every
        table entry back home. `forget`: also the admission filter's counts and the counters,
        as after exllamav3's warm-up (--warmup), whose random picks are no traffic to keep."""
        import torch

        t = self._t
        t["key_slot"].fill_(-1)
        t["slot_key"].fill_(-1)
        t["slot_ref"].zero_()
        torch.cuda.synchronize(self.device)
        arr = self._host_struct()
        arr[0]["n_used"], arr[0]["hand"] = 0, 0
        if forget:
            t["key_freq"].zero_()
            t["layer_hits"].zero_()
            t["layer_misses"].zero_()
            arr[0]["freq_events"] = 0
            for name in COUNTERS:
                arr[0][name] = 0
        self._store_struct(arr)
        self.reset_tables()

    def lend(self, n: int):
        """Take the last n slots out of CLOCK's reach for a layer-major prefill
        (glm53.exl3.layer_major) or the staging buffers (StagingLoan: at load, then before each
        staged prefill chunk that follows a loan) and return their bytes (a uint8 CUDA tensor).
        The device sync comes first, so no copy that a decode step queued into them is still
        pending when they change owner. The keys they held go back to their homes (every table
        rewritten: no entry points into the lent bytes, none points into a staging buffer
        either), and admissions use the first n_slots - n slots only (`n_active`) until
        `unlend`. Synchronizes the device. Run on an H200 (2026-12-05) by the staging loan's
        tests and layer-major's identity tests."""
        import torch

        if not 0 < n < self.n_slots:
            raise ValueError(f"lend({n}): between 1 and {self.n_slots - 1} of {self.n_slots} slots")
        torch.cuda.synchronize(self.device)
        arr = self._host_struct()
        s = arr[0]
        if int(s["n_active"]) != self.n_slots:
            raise RuntimeError(
                f"internal error: {self.n_slots - int(s['n_active'])} slots are already lent"
            )
        keep = self.n_slots - n
        tail = self._t["slot_key"][keep:]
        keys = tail[tail >= 0].long()
        self._t["key_slot"][keys] = -1
        self._t["slot_key"][keep:] = -1
        self._t["slot_ref"][keep:] = 0
        s["n_used"] = int(s["n_used"]) - int(keys.numel())
        s["n_active"], s["hand"] = keep, int(s["hand"]) % keep
        self._store_struct(arr)
        self.reset_tables()
        self.lent = n
        rb = self.geo.record_bytes
        return self._t["slots"][keep * rb :]

    def unlend(self) -> None:
        """Give the lent slots back to CLOCK (empty: the next misses fill them). The caller has
        dropped every view of the lent bytes; the struct write is ordered on the current stream
        after the kernels that used them. Synchronizes the device."""
        import torch

        torch.cuda.synchronize(self.device)
        arr = self._host_struct()
        arr[0]["n_active"] = self.n_slots
        self._store_struct(arr)
        self.lent = 0

    def state(self) -> dict:
        """Counters and per-layer hit rates (synchronizes with the device)."""
        s = self._host_struct()[0]
        out = {k: int(s[k]) for k in COUNTERS}
        out.update(slots=self.n_slots, used=int(s["n_used"]), hand=int(s["hand"]))
        out["freq_window"] = self.freq_window
        hits = self._t["layer_hits"].cpu().numpy()
        misses = self._t["layer_misses"].cpu().numpy()
        tot = hits + misses
        out["layer_hit_rate"] = [
            float(h / t) if t else None for h, t in zip(hits, tot, strict=True)
        ]
        looked = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / looked if looked else None
        return out

    def slot_keys(self) -> np.ndarray:
        return self._t["slot_key"].cpu().numpy()

    def key_freq(self) -> np.ndarray:
        """The admission filter's decayed lookup count of every key."""
        return self._t["key_freq"].cpu().numpy().view(np.uint32)

    def heat_list(self) -> list[int]:
        """The cached keys hottest first (the order seed() takes): by the filter's lookup
        counts when it is on, ties (and plain CLOCK) in the reverse of the order in which
        CLOCK would evict them from here on."""
        s = self._host_struct()[0]
        return clock_heat_order(
            self._t["slot_key"].cpu().numpy(), self._t["slot_ref"].cpu().numpy(), int(s["hand"]),
            self.key_freq() if self.freq_window else None,
        )  # fmt: skip

    def seed(self, keys) -> int:
        """Warm start from a heat list, hottest first (copies synchronously), then point the
        tables at the slots. As glm53._clock's seed does, the hottest key goes in the highest
        seeded slot: the hand starts at slot 0, so the coldest seeded key is evicted first.
        Returns the number of keys placed."""
        import torch

        arr = self._host_struct()
        s = arr[0]
        # lent slots (a staging loan's or a layer-major pass's) are not seeded: only the first
        # n_active slots are CLOCK's
        keys = [int(k) for k in keys][: int(s["n_active"])]
        if not keys:
            return 0
        if len(set(keys)) != len(keys):
            raise ValueError("the heat list repeats a key; every key may be seeded once")
        keys = keys[::-1]  # slot 0 <- coldest of the seeded keys
        if int(s["n_used"]) != 0:
            raise RuntimeError(
                "internal error: seed() needs an empty cache; call it right after loading"
            )
        home = self._t["home"].cpu().numpy()
        rb = self.geo.record_bytes
        for slot, key in enumerate(keys):
            if not 0 <= key < self.geo.n_keys:
                raise ValueError(f"heat-list key {key} is outside [0, {self.geo.n_keys})")
            src = _uva_tensor(int(home[key]), rb, self.device)
            self._t["slots"][slot * rb : (slot + 1) * rb].copy_(src)
        idx = torch.arange(len(keys), dtype=torch.int32, device=self.device)
        kt = torch.tensor(keys, dtype=torch.int64, device=self.device)
        self._t["slot_key"][: len(keys)] = kt.to(torch.int32)
        self._t["key_slot"][kt] = idx
        # the filter starts out trusting the saved order: counts 1 (coldest) .. 8 (hottest),
        # small enough that a few halvings forget them if the traffic has moved on
        n = len(keys)
        self._t["key_freq"][kt] = torch.tensor(
            [1 + (7 * i) // max(1, n - 1) for i in range(n)], dtype=torch.int32, device=self.device
        )
        arr[0]["n_used"] = len(keys)
        self._store_struct(arr)
        self.reset_tables()
        return len(keys)


LOAN_AFTER_DECODE_STEPS = 4  # decode forwards in a row, with no staged prefill chunk, before a loan


class StagingLoan:
    """The staging buffers lent to the expert cache between prefills (`--ec-stage-loan`).

    Exact mode's two staging buffers hold up to a quarter of the VRAM left after the model
    (glm53.plan.vram.STAGE_SHARE) and nothing in decode. With a loan they are the cache's last
    2 * buf_slots slots: CLOCK admits into them in decode, and the stager takes them back
    (DeviceExpertCache.lend: their keys go home, every table entry is rewritten, one device
    sync) before the first stage of a prefill chunk. They go back to CLOCK (`decode`) once
    LOAN_AFTER_DECODE_STEPS decode forwards ran in a row with no staged chunk between them, so a
    prompt prefilled chunk by chunk between decode steps (the Generator's iterations) keeps its
    buffers, and each switch costs one sync per prompt, not one per iteration. That holds at
    glm53's Generator settings (glm53.exl3.prefix.generator_settings: `prefill_cooldown` 0, so a
    prompt's chunks come on consecutive iterations, one decode forward between two of them);
    exllamav3 1.6.5's default cooldown of 4 puts 5 decode forwards between two chunks of a
    prompt ingested while another job generates, and the loan would switch twice a chunk
    (still exact, two syncs a chunk). Output is unchanged either way: every table entry points
    at a valid copy of its expert (slot, buffer or home): on an H200 (2026-12-05) its output was
    torch.equal to stock exllamav3's Generator (tests/gpu/test_generator_parity.py).

    The loan starts with the buffers as the stager's (`take`): the first forward of a server is a
    prefill, and a heat-list seed then fills only the slots CLOCK holds, so the hottest keys are
    not placed where the first prefill would send them home."""

    def __init__(self, stager: PrefillStager):
        self.stager, self.cache = stager, stager.cache
        self.n = 2 * stager.buf_slots
        if self.n >= self.cache.n_slots:
            raise ValueError(
                f"a staging loan needs more cache slots than its {self.n} staging records; the "
                f"cache has {self.cache.n_slots}"
            )
        self.with_cache = False  # True: the buffers are CLOCK's slots (decode)
        self.decode_run = 0
        self.loans = self.recalls = 0

    def take(self):
        """The buffers' bytes, taken from CLOCK (the cache's last `n` slots)."""
        tail = self.cache.lend(self.n)
        self.with_cache, self.decode_run = False, 0
        return tail

    def prefill(self) -> None:
        """A staged prefill chunk is about to stage: the buffers come back to the stager first."""
        self.decode_run = 0
        if self.with_cache:
            self.cache.lend(self.n)  # syncs; the tail's keys go home, every entry rewritten
            self.stager.forget()
            self.with_cache = False
            self.recalls += 1

    def decode(self) -> None:
        """A decode forward starts (its first MoE layer, before the route): after
        LOAN_AFTER_DECODE_STEPS of them in a row the buffers go to CLOCK."""
        if self.with_cache:
            return
        self.decode_run += 1
        if self.decode_run < LOAN_AFTER_DECODE_STEPS or self.stager.hold:
            return
        self.stager.clear()  # no entry points into a buffer once CLOCK may fill it
        self.cache.unlend()
        self.with_cache = True
        self.loans += 1

    def stats(self) -> dict:
        return {
            "stage_loan_slots": self.n, "stage_loan_with_cache": self.with_cache,
            "stage_loans": self.loans, "stage_recalls": self.recalls,
        }  # fmt: skip


def clock_heat_order(slot_key, slot_ref, hand: int, key_freq=None) -> list[int]:
    """Keys of a CLOCK table hottest first. The hand evicts the unreferenced slots in sweep order
    from `hand`, then (their bits cleared on the first pass) the referenced ones in the same
    order; hottest first is that eviction order reversed. With `key_freq` (the admission
    filter's counts, indexed by key) keys are ordered by count, highest first, and that CLOCK
    order breaks ties. Free slots (key < 0) are left out."""
    slot_key = np.asarray(slot_key)
    slot_ref = np.asarray(slot_ref)
    n = len(slot_key)
    if slot_ref.shape != (n,):
        raise ValueError(f"slot_ref has shape {slot_ref.shape}, slot_key has {n} slots")
    if n == 0:
        return []
    sweep = [(hand + i) % n for i in range(n)]
    evict = [s for s in sweep if not slot_ref[s]] + [s for s in sweep if slot_ref[s]]
    order = [int(slot_key[s]) for s in reversed(evict) if slot_key[s] >= 0]
    if key_freq is not None:
        key_freq = np.asarray(key_freq)
        order.sort(key=lambda k: -int(key_freq[k]))  # stable: CLOCK order within a count
    return order


def _uva_tensor(addr: int, nbytes: int, device):
    """A uint8 CUDA tensor aliasing `nbytes` at a device-visible address (no copy)."""
    import torch

    class _View:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }

    return torch.as_tensor(_View(), device=device)


class PrefillStager:
    """Prefill staging: two VRAM buffers of `buf_slots` expert records. For a prefill chunk
    (at least `min_rows` rows), the uncached experts of MoE layer l are copied into buffer
    l % 2 and the layer's table entries pointed there; the copy for layer l + 1 runs on a
    side stream while layer l computes. A buffer's previous layer is unstaged (entries back
    to slot or home) before it is overwritten, so every entry always points at a valid copy.
    No admissions happen here: the cache itself is untouched by prefill.

    When each layer's home is one contiguous arena (as PinnedExpertHome lays it out), a stage is
    one copy-engine transfer of the first `buf_slots` records of the layer's arena (the whole
    layer when a buffer holds it: `whole_layer`) and a kernel that points those of them that are
    not cached into the buffer (`dma`); the rest of the layer stays zero-copy. An SM copy kernel
    on the side stream occupies the SMs the computing layer needs, so copy and compute ran one
    after the other (H200, slice, 8k prompt in one chunk: 11,176 tok/s with the gather kernel,
    14,485 with one transfer per layer). Otherwise, or with dma=False, the uncached experts are
    gathered into the buffer by a copy kernel.

    nvme-exact gathers (its homes are RAM-tier slots in no layer order) and drives the two
    halves of on_layer itself, `wait_staged` and `stage_ahead`, since a layer can be staged only
    once its records are resident in the RAM tier (glm53.tiers.prefill_ahead)."""

    # True: a copy-engine stage queues its copy before the unstage kernel (see _stage). Not yet
    # run on a GPU, so off until its GPU test passes (tests/gpu/test_generator_parity.py's
    # copy-first case; bench/gpu_slice.py's exact_copy_first row measures it beside exact)
    copy_first = False

    def __init__(
        self, cache: DeviceExpertCache, buf_slots: int, min_rows: int = 256, dma: bool | None = None,
        loan: bool = False, prefill_layers: int | None = None,
    ):  # fmt: skip
        import torch

        if buf_slots < 1:
            raise ValueError(f"a staging buffer needs at least 1 slot, got {buf_slots}")
        self.cache, self.buf_slots, self.min_rows = cache, int(buf_slots), int(min_rows)
        # the MoE layers a prefill forward runs (glm53.exl3.hooks.prefill_moe_count): exllamav3's
        # prefill stops in the last KV block, after its attention, so its MoE layer (the last one)
        # never runs there and staging it ahead would copy a whole layer for nothing
        n_l = cache.geo.n_layers
        self.prefill_layers = n_l if prefill_layers is None else int(prefill_layers)
        if not 0 <= self.prefill_layers <= n_l:
            raise ValueError(f"prefill_layers {prefill_layers} is not in [0, {n_l}]")
        dev, rb = cache.device, cache.geo.record_bytes
        # the staging loan (`loan`): the two buffers are the cache's last 2 * buf_slots slots,
        # CLOCK's in decode and the stager's in prefill (StagingLoan); else buffers of their own
        self.loan = StagingLoan(self) if loan else None
        if self.loan is not None:
            tail = self.loan.take()
            self.bufs = [tail[: self.buf_slots * rb], tail[self.buf_slots * rb :]]
        else:
            self.bufs = [
                torch.empty(self.buf_slots * rb, dtype=torch.uint8, device=dev) for _ in "ab"
            ]
        self.job_src = [torch.zeros(self.buf_slots, dtype=torch.int64, device=dev) for _ in "ab"]
        self.job_dst = [torch.zeros(self.buf_slots, dtype=torch.int64, device=dev) for _ in "ab"]
        self.n_jobs = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in "ab"]
        self.owner = [-1, -1]
        n_e = cache.geo.n_experts
        per_layer = cache._t["home"].cpu().numpy().reshape(cache.geo.n_layers, n_e)
        contiguous = bool((np.diff(per_layer, axis=1) == rb).all())
        if dma and not contiguous:
            raise ValueError(
                "copy-engine staging needs each layer's home records in one contiguous arena"
            )
        self.dma = contiguous if dma is None else bool(dma)
        self.dma_count = min(self.buf_slots, n_e)
        self.whole_layer = self.dma and self.dma_count == n_e
        self.layer_home = [int(a) for a in per_layer[:, 0]]
        self.side = torch.cuda.Stream(dev)
        self.pending: dict = {}
        self.stages = 0
        # a layer-major pass (glm53.exl3.layer_major) runs every chunk through a layer in
        # a row: while it holds, a layer staged during the pass whose buffer still holds it is
        # not copied again (its entries point at that buffer, the slot or home: all exact)
        self.hold = False
        self.held: set = set()
        self.skips = 0
        self.unstaged = None  # the side stream's last unstage, for order_unstage

    @property
    def nbytes(self) -> int:
        """The VRAM of the buffers (with a loan, cache slots when the cache holds them)."""
        return 2 * self.buf_slots * self.cache.geo.record_bytes

    def clear(self) -> None:
        """No table entry points into a buffer from here on: the side stream's stages are done
        and waited for, and every entry of a staged layer goes back to its slot or home."""
        import torch

        self.side.synchronize()
        torch.cuda.current_stream(self.cache.device).wait_stream(self.side)
        self.cache.reset_tables()
        self.forget()

    def forget(self) -> None:
        """Drop what the stager knows of its buffers (their layers, pending stages, the last
        unstage), once every table entry was rewritten from the cache (reset_tables, or
        DeviceExpertCache.lend) and the side stream is idle: no entry points into them."""
        self.owner, self.unstaged = [-1, -1], None
        self.pending.clear()

    def _stage(self, layer: int, stream) -> None:
        import torch

        c = self.cache._cuda
        b, ec, s = layer % 2, self.cache._ptr, stream.cuda_stream
        geo, buf = self.cache.geo, self.bufs[b].data_ptr()
        if self.dma and self.copy_first:
            # the copy first, then the two small kernels: the copy engine needs no SM, so the
            # copy can run beside the MoE kernel the main stream starts now. Queued behind the
            # unstage kernel, it waits for that kernel to get an SM, which it may get only once
            # the MoE kernel leaves them, so copy and compute run one after the other (what
            # the H100 trace of 2026-12-05 suggests: exact's 512-token prefill, copies 246 ms,
            # MoE kernels 169 ms, 20 ms of them together; not yet confirmed by a trace with
            # the copy first). Writing the buffer before its old layer's entries are unstaged
            # is safe: the side stream starts after that layer's MoE kernel (stage_ahead's
            # event), and nothing reads the old layer's entries before the unstage (main
            # waits for it: wait_staged, or order_unstage between a pass's steps)
            c.memcpy_async(buf, self.layer_home[layer], self.dma_count * geo.record_bytes, s)
        if self.owner[b] >= 0:
            c.ec_unstage(ec, self.owner[b], s)
            if stream is self.side:  # see order_unstage
                self.unstaged = torch.cuda.Event()
                self.unstaged.record(stream)
        if self.dma:
            if not self.copy_first:
                c.memcpy_async(buf, self.layer_home[layer], self.dma_count * geo.record_bytes, s)
            c.ec_stage_layer(ec, layer, buf, self.dma_count, s)
        else:
            c.ec_stage(ec, layer, buf, self.buf_slots, self.job_src[b].data_ptr(),
                       self.job_dst[b].data_ptr(), self.n_jobs[b].data_ptr(), s)  # fmt: skip
            c.copy_jobs(self.job_src[b].data_ptr(), self.job_dst[b].data_ptr(),
                        self.n_jobs[b].data_ptr(), geo.record_bytes, self.cache.copy_blocks,
                        s)  # fmt: skip
        self.owner[b] = layer
        self.stages += 1
        if self.hold:
            self.held.add(layer)

    def begin_hold(self, tables_reset: bool) -> None:
        """A layer-major pass starts. `tables_reset`: the cache rewrote every table entry
        (DeviceExpertCache.lend), so no entry points into a buffer and none needs unstaging."""
        import torch

        self.side.synchronize()
        torch.cuda.current_stream(self.cache.device).wait_stream(self.side)
        if tables_reset:
            self.owner = [-1, -1]
            self.pending.clear()
        self.hold, self.held = True, set()

    def end_hold(self) -> None:
        self.hold, self.held = False, set()

    def is_held(self, layer: int) -> bool:
        """Whether a layer-major pass staged `layer` and its buffer still holds it."""
        return self.hold and layer in self.held and self.owner[layer % 2] == layer

    def stage_held(self, layer: int) -> None:
        """A layer-major pass in the store modes (glm53.exl3.nvme_device): stage `layer` now,
        on the main stream (its buffer's previous layer unstaged first), once for every chunk
        of the pass. The host decides which of the copies it trusts: the stage kernel copies the
        first `buf_slots` uncached experts from their homes whatever they hold, and those not
        resident in the RAM tier at this point are pointed at their homes by the caller."""
        import torch

        if not self.hold:
            raise RuntimeError("internal error: stage_held outside a layer-major pass's hold")
        self.wait_staged(layer)  # a side-stream stage of it (none expected in a pass)
        self._stage(layer, torch.cuda.current_stream(self.cache.device))

    def order_unstage(self) -> None:
        """The main stream waits for the side stream's last unstage (not for its copy). An
        unstage reads which slot holds each expert of the buffer's old layer and rewrites that
        layer's table entries from it; a decode step's admissions rewrite entries too, so one
        that ran between the read and the write could leave an entry at a slot the decode step
        gave to another expert. A chunk-major prefill never lets a decode step in before its
        stages are waited for; a layer-major pass does between two steps, and calls this at the
        end of each step. The unstage is a few microseconds queued after the step's first
        chunk: the wait costs about nothing and makes the order certain."""
        import torch

        if self.unstaged is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(self.unstaged)
            self.unstaged = None

    def on_layer(self, layer: int) -> None:
        """Called after MoE layer `layer`'s router, before its MoE kernel, on a prefill chunk."""
        import torch

        if self.loan is not None:
            self.loan.prefill()
        main = torch.cuda.current_stream(self.cache.device)
        if (
            self.hold and layer in self.held and self.owner[layer % 2] == layer
            and layer not in self.pending
        ):  # fmt: skip
            self.skips += 1
            return
        if self.wait_staged(layer) is None:  # not staged ahead: staged now, on the main stream
            self._stage(layer, main)
        if layer + 1 < self.prefill_layers:
            self.stage_ahead(layer + 1)

    # the two halves of on_layer; nvme-exact (glm53.exl3.nvme_device) calls them itself, since
    # the host decides when a layer can be staged (once its records are resident in the RAM tier)
    def wait_staged(self, layer: int):
        """The main stream waits for `layer`'s side-stream stage; its event (None: none)."""
        import torch

        ready = self.pending.pop(layer, None)
        if ready is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(ready)
        return ready

    def stage_ahead(self, layer: int) -> None:
        """Stage `layer` on the side stream after everything queued on the main stream so far
        (the home-table writes that make its records visible included)."""
        import torch

        main = torch.cuda.current_stream(self.cache.device)
        started = torch.cuda.Event()
        started.record(main)
        self.side.wait_event(started)
        self._stage(layer, self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        self.pending[layer] = done
