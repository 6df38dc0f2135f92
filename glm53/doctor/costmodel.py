"""The planner's cost model: predicted decode time per token (concurrency 1) and prefill rate
for each mode, from the model's geometry and a few host figures.

Every prediction is for a model geometry (doctor/geometry.py): GLM-5.3-Flash by default, or the
checkpoint given to `glm53 doctor --model DIR` (its layers, MoE layers, experts and widths).

Decode. A token runs the non-MoE work, then the MoE layers one after another. In each layer the
router picks 8 experts; each pick is VRAM-resident, in RAM, or (nvme modes) only on the store,
with probabilities from the published popularity curve at the capacity of each tier. The picks
go to lanes that run in parallel: the GPU (resident experts at t_hit, RAM experts copied over
PCIe at bytes/PCIe + t_hit), the CPU lane (a + b x experts), and the store (a first read
latency, then bytes/read rate), and the planner chooses the CPU share that minimises the
slowest lane, as the seed's planner does (seed-project.md §3.5, §3.6). A layer costs the
controller's fixed overhead plus its slowest lane; the expectation over the multinomial of the
8 picks is exact, not sampled. The non-MoE work is the bytes of the non-expert weights at the
GPU's bandwidth plus a fixed cost per layer (launches and small kernels, which bandwidth does not
shorten); exact mode's cache runs on the device (cuda/ec.cu), so it pays no host controller.

Prefill (exact in every mode) streams every expert not in VRAM once per chunk, overlapped with
the GPU's compute (the staging of DESIGN §4); store reads for experts not in RAM add on top.

Constants measured on the seed's reference host (RTX 3090 on PCIe 4.0 x16, EPYC 7443P, 8-channel
DDR4, 4x NVMe RAID0) scale with this host's figures where a physical reason says how."""

from __future__ import annotations

import math

import msgspec

from glm53.doctor.geometry import GLM53_FLASH, Geometry
from glm53.modes import TierMode
from glm53.units import GIB

# --- model geometry (glm53-architecture.md §2, exllamav3.md §3.2, seed-project.md §2.1, §4.1)
EXPERTS_PER_LAYER = 288
NUM_MOE_LAYERS = 42  # model layers 3..44 are served
STORE_LAYERS = 43  # the store also packs the MTP layer (model layer 45)
TOP_K = 8
TOTAL_EXPERTS = EXPERTS_PER_LAYER * NUM_MOE_LAYERS
SCALE_BYTES_PER_EXPERT = 36_864  # suh + svh of gate, up, down (fp16)
STORE_ALIGN = 4096
CHECKPOINT_BYTES = 125_300_000_000  # the pinned 3.05 bpw revision on disk


def expert_trellis_bytes(bits: int) -> int:
    """gate and up (4096 -> 2048) and down (2048 -> 4096) at `bits` per weight."""
    return 3 * 4096 * 2048 * bits // 8


def store_record_bytes(bits: int) -> int:
    raw = expert_trellis_bytes(bits) + SCALE_BYTES_PER_EXPERT
    return -(-raw // STORE_ALIGN) * STORE_ALIGN


def store_total_bytes(bits: int) -> int:
    return STORE_LAYERS * EXPERTS_PER_LAYER * store_record_bytes(bits)


# --- popularity: hottest 25/50/75 % of a layer's experts serve 73.5/90.7/98.4 % of decode picks
# (exllamav3.md §4.4). Hit fraction at capacity c is (1 - e^(-L c)) / (1 - e^(-L)), L fitted by
# least squares to those three points (largest error 0.021, at 50 %).
POPULARITY_POINTS = ((0.25, 0.735), (0.5, 0.907), (0.75, 0.984))
POPULARITY_LAMBDA = 5.094


def hit_fraction(capacity: float) -> float:
    """Share of decode picks served by a tier holding the hottest `capacity` of each layer."""
    c = min(1.0, max(0.0, capacity))
    return (1 - math.exp(-POPULARITY_LAMBDA * c)) / (1 - math.exp(-POPULARITY_LAMBDA))


# --- reference host constants (seed-project.md)
REF_VRAM_GBPS = 936.0  # RTX 3090 memory bandwidth (spec)
REF_FP16_TFLOPS = 71.0  # RTX 3090 dense FP16 tensor, FP32 accumulate (spec)
REF_NON_MOE_MS = 11.2  # §6.5 C1 breakdown: non-MoE GPU work per token
REF_HIT_MS = 0.023  # §3.5 GLM53_CT_THIT: one VRAM-resident expert
# REF_NON_MOE_MS split: the full model's non-expert bytes at the 3090's bandwidth (4.36 ms), and
# the rest as a fixed cost per layer (0.152 ms of the 45) that a faster memory does not shorten
REF_LAYER_FIXED_MS = (
    REF_NON_MOE_MS - GLM53_FLASH.non_expert_bytes / (REF_VRAM_GBPS * 1e6)
) / GLM53_FLASH.num_layers
# exllamav3.md App. A (H200): 8 experts of one layer from VRAM at bsz 1 took 38.9 + 38.9 + 36.5 us
# for gate, up and down, latency-bound (647-690 GB/s of 4.8 TB/s): no GPU reads a VRAM expert
# faster than that per expert, whatever its bandwidth
HIT_FLOOR_MS = (0.0389 + 0.0389 + 0.0365) / 8
CONTROLLER_MS_PER_LAYER = 4.7 / NUM_MOE_LAYERS  # §6.5: host plan / bubbles, 4.7 ms per token
REF_PREFILL_TOK_S = 700.0  # §6.5: exact 697, fast 709.7 at 8k (GPU-bound, 99 % busy)
PREFILL_CHUNK_TOKENS = 8192
# §3.5 lane at 22 threads: 9.44 MB per 0.104 ms = 90.7 GB/s of the 136-140 GB/s measured DRAM
LANE_DRAM_SHARE = 0.66
# §3.6 the in-place (native layout) lane the nvme modes use: ca 0.145 ms, cb 0.165 ms at 22
# threads; the seed's rule b ~ 1/threads (§3.4 "GLM53_CT_B ~ 0.104 x 22 / N")
SEED_LANE_A_MS = 0.145
SEED_LANE_B_MS_22 = 0.165
SEED_LANE_THREADS = 22

# --- memory (seed-project.md §2.3, §4.2, §6.5)
# VRAM used at ready besides the expert slots: 22.7 GiB (P001) - 1,376 slots
VRAM_NON_EXPERT_BYTES = int(22.7 * GIB) - 1376 * expert_trellis_bytes(3)
MIN_FREE_VRAM_MIB = 23_000
# host RAM besides the experts: exact used 111.1 GiB with all 12,096 experts pinned
HOST_BASE_ALL_RAM_BYTES = int(111.1 * GIB) - TOTAL_EXPERTS * expert_trellis_bytes(3)
# nvme: memory.current before the RAM tier, from 55 GiB -> 4,832 slots (P003 log)
HOST_BASE_NVME_BYTES = int(3.54 * GIB)
NVME_MIN_CAP_BYTES = 15 * GIB
NVME_SMALL_BELOW_BYTES = 24 * GIB


# the tier modes (glm53.modes, where they are defined once; auto is not a plan)
Mode = TierMode


LANE_MODES = {Mode.FAST, Mode.NVME}
STORE_MODES = {Mode.NVME, Mode.NVME_EXACT}
BIT_EXACT_MODES = {Mode.EXACT, Mode.NVME_EXACT}


def reserve_bytes(mode: Mode) -> int:
    """VRAM left free after the slot arena: 1.5 GiB with a CPU lane, 1.0 without (§2.3)."""
    return int((1.5 if mode in LANE_MODES else 1.0) * GIB)


def vram_slots(
    free_mib: int,
    mode: Mode,
    bits: int = 3,
    max_slots: int | None = None,
    geo: Geometry = GLM53_FLASH,
) -> int:
    """VRAM expert slots: the free VRAM less the model and its cache (the seed's measured 10.6
    GiB, with geo's non-expert weights in place of the full model's) and the reserve, at most
    every expert of geo."""
    resident = VRAM_NON_EXPERT_BYTES - GLM53_FLASH.non_expert_bytes + geo.non_expert_bytes
    room = free_mib * 2**20 - resident - reserve_bytes(mode)
    slots = min(max(0, room // expert_trellis_bytes(bits)), geo.total_experts)
    return min(slots, max_slots) if max_slots is not None else slots


def _nvme_overhead_bytes(small: bool, bits: int) -> float:
    """Process memory of the nvme modes besides the RAM tier (§4.2): the baseline, a margin,
    the prefill ring, the recurrent-state cache and 0.3 GiB; smaller on hosts under 24 GiB."""
    margin = (1.5 if small else 3.0) * GIB
    ring = (128 if small else 192) * expert_trellis_bytes(bits)
    rcs = (1.0 if small else 4.0) * GIB
    return HOST_BASE_NVME_BYTES + margin + ring + rcs + 0.3 * GIB


def ram_tier_slots(cap_bytes: int, bits: int = 3) -> int:
    """Expert slots of the nvme modes' RAM tier when the whole process is capped at cap_bytes."""
    room = cap_bytes - _nvme_overhead_bytes(cap_bytes < NVME_SMALL_BELOW_BYTES, bits)
    return max(0, int(room // expert_trellis_bytes(bits)))


def nvme_process_bytes(tier_slots: int, bits: int = 3) -> int:
    """The process cap that gives a RAM tier of tier_slots (the inverse of ram_tier_slots)."""
    tier = tier_slots * expert_trellis_bytes(bits)
    small = tier + _nvme_overhead_bytes(True, bits)
    if small < NVME_SMALL_BELOW_BYTES:
        return math.ceil(small)
    return math.ceil(tier + _nvme_overhead_bytes(False, bits))


def all_ram_bytes(bits: int = 3) -> int:
    """Host RAM of the all-RAM modes (exact, fast): every expert pinned plus the baseline."""
    return TOTAL_EXPERTS * expert_trellis_bytes(bits) + HOST_BASE_ALL_RAM_BYTES


def seed_lane(threads: int, dram_gbps: float | None, bits: int = 3) -> tuple[float, float]:
    """(a, b) in ms for an uncalibrated lane: the seed's in-place figures scaled by 22/threads,
    and b no faster than the lane's share of this host's DRAM bandwidth allows."""
    b = SEED_LANE_B_MS_22 * SEED_LANE_THREADS / max(1, threads)
    if dram_gbps:
        b = max(b, expert_trellis_bytes(bits) / (LANE_DRAM_SHARE * dram_gbps * 1e6))
    return SEED_LANE_A_MS, b


class CostInputs(msgspec.Struct, frozen=True):
    """What the model needs. Rates in GB/s (1e9 B/s), times in ms."""

    vram_slots: int
    pcie_gbps: float
    vram_gbps: float = REF_VRAM_GBPS
    gpu_fp16_tflops: float = REF_FP16_TFLOPS
    expert_bits: int = 3
    ram_tier_slots: int | None = None  # nvme modes only
    lane_a_ms: float | None = None  # lane modes only
    lane_b_ms: float | None = None
    store_gbps: float | None = None  # nvme modes only
    store_latency_ms: float | None = None
    # prefill compute measured on this GPU with every expert in VRAM (no link traffic), per
    # model layer: a fixed cost per chunk (launches, per-expert GEMM setup) and a cost per
    # prompt token (prefill_compute_fit); None: the seed's rate scaled by fp16 TFLOPS
    prefill_chunk_ms: float | None = None
    prefill_token_us: float | None = None
    # exact prefill staging: records one stage copies per MoE layer (PrefillStager's whole
    # layer: every expert; None: the layer's experts not in VRAM), and whether the copy overlaps
    # the previous layer's compute (copy-engine DMA) or runs after it (an SM gather kernel)
    stage_records: int | None = None
    stage_overlap: bool = True
    # the stager before 2026-12-05 also staged the last MoE layer ahead, whose MLP no prefill
    # forward runs (Geometry.prefill_moe_layers): the committed H200 prefill runs did
    stage_last_layer: bool = False


class Prediction(msgspec.Struct, frozen=True):
    mode: Mode
    decode_tok_s: float
    ms_per_token: float
    non_moe_ms: float
    moe_ms: float  # all 42 layers, controller overhead included
    vram_share: float  # of decode picks
    ram_share: float
    store_share: float
    cpu_experts_per_layer: float
    prefill_tok_s: float


def _multinomial(n: int, pv: float, pr: float, pn: float):
    for nv in range(n + 1):
        for nr in range(n + 1 - nv):
            nn = n - nv - nr
            ways = math.factorial(n) // (
                math.factorial(nv) * math.factorial(nr) * math.factorial(nn)
            )
            p = ways * pv**nv * pr**nr * pn**nn
            if p > 0:
                yield p, nv, nr, nn


def _layer(
    nv: int, nr: int, nn: int, t_hit: float, t_copy: float, lane, t_read: float, t_first: float
) -> tuple[float, int]:
    """(slowest lane in ms, experts on the CPU) for one layer's picks, best CPU share."""
    best = (math.inf, 0)
    for k in range(nr + 1) if lane else (0,):
        gpu = t_hit * nv + t_copy * (nr - k)
        cpu = lane[0] + lane[1] * k if k else 0.0
        on_cpu = k
        for j in range(nn):  # store reads land one after another, then go where cheaper
            arrive = t_first + j * t_read
            to_gpu = max(gpu, arrive) + t_copy
            to_cpu = max(cpu or lane[0], arrive) + lane[1] if lane else math.inf
            if to_cpu < to_gpu:
                cpu, on_cpu = to_cpu, on_cpu + 1
            else:
                gpu = to_gpu
        best = min(best, (max(gpu, cpu), on_cpu))
    return best


def _expert_ms(x: CostInputs, geo: Geometry) -> tuple[int, float, float]:
    """(expert bytes at x's bits, ms per VRAM-resident expert, ms per expert read over PCIe)."""
    eb = geo.expert_bytes * x.expert_bits // geo.expert_bits
    t_hit = max(REF_HIT_MS * REF_VRAM_GBPS / x.vram_gbps, HIT_FLOOR_MS)
    return eb, t_hit, eb / (x.pcie_gbps * 1e6) + t_hit


def non_moe_ms(x: CostInputs, geo: Geometry = GLM53_FLASH) -> float:
    """Non-MoE GPU work of one decode step: the non-expert weights read at the GPU's bandwidth,
    plus the fixed cost of each layer."""
    return geo.non_expert_bytes / (x.vram_gbps * 1e6) + geo.num_layers * REF_LAYER_FIXED_MS


def _chunk_compute_s(x: CostInputs, geo: Geometry, tokens: int) -> float:
    """GPU time of a prefill chunk of `tokens` tokens through every layer of geo. Measured
    (x.prefill_chunk_ms, x.prefill_token_us, per layer, from an all-VRAM prefill on this GPU):
    layers x (fixed cost per chunk + tokens x cost per token). Else the seed's 700 tok/s (full
    model, 3090, 8k chunks) scaled by the GPU's fp16 rate and the geometry's share of layers,
    with no fixed cost per chunk."""
    if x.prefill_chunk_ms is not None and x.prefill_token_us is not None:
        return geo.num_layers * (x.prefill_chunk_ms / 1e3 + tokens * x.prefill_token_us / 1e6)
    rate = REF_PREFILL_TOK_S * x.gpu_fp16_tflops / REF_FP16_TFLOPS
    return tokens / rate * geo.num_layers / GLM53_FLASH.num_layers


def prefill_compute_fit(
    geo: Geometry, short: tuple[int, float], long: tuple[int, float]
) -> tuple[float, float]:
    """(prefill_chunk_ms, prefill_token_us) per layer from two all-VRAM prefills of one chunk
    each, (tokens, tok/s) at two lengths (bench/gpu_slice.py's stock row: p512 and
    p8192_c8192): the straight line through their times. An all-VRAM row moves no expert over
    the link, so its time is compute alone."""
    (n1, r1), (n2, r2) = sorted((short, long))
    t1, t2 = n1 / r1, n2 / r2
    per_token = (t2 - t1) / (n2 - n1)
    fixed = t1 - n1 * per_token
    if per_token <= 0 or fixed < 0:
        raise ValueError(
            f"all-VRAM prefill {n1} tok at {r1:.0f} tok/s and {n2} at {r2:.0f} tok/s give no "
            "positive cost per token and per chunk; measure both lengths warm, one chunk each"
        )
    return fixed * 1e3 / geo.num_layers, per_token * 1e6 / geo.num_layers


def predict(mode: Mode, x: CostInputs, geo: Geometry = GLM53_FLASH) -> Prediction:
    """Decode (concurrency 1) and prefill prediction for one mode; raises ValueError naming
    the missing input when the mode needs one that x lacks."""
    eb, t_hit, t_copy = _expert_ms(x, geo)
    total_experts = geo.total_experts
    lane = None
    if mode in LANE_MODES:
        if x.lane_a_ms is None or x.lane_b_ms is None:
            raise ValueError(f"mode {mode}: needs the CPU lane's lane_a_ms and lane_b_ms")
        lane = (x.lane_a_ms, x.lane_b_ms)
    cap_vram = x.vram_slots / total_experts
    pv = hit_fraction(cap_vram)
    stored_slots = 0
    t_read = t_first = 0.0
    if mode in STORE_MODES:
        if x.ram_tier_slots is None or x.store_gbps is None or x.store_latency_ms is None:
            raise ValueError(f"mode {mode}: needs ram_tier_slots, store_gbps and store_latency_ms")
        near = hit_fraction((x.vram_slots + x.ram_tier_slots) / total_experts)
        pr, pn = max(0.0, near - pv), 1.0 - near
        stored_slots = max(0, total_experts - x.vram_slots - x.ram_tier_slots)
        t_read = eb / (x.store_gbps * 1e6)
        t_first = x.store_latency_ms
    else:
        pr, pn = 1.0 - pv, 0.0
    layer_ms = cpu_per_layer = 0.0
    for p, nv, nr, nn in _multinomial(geo.top_k, pv, pr, pn):
        ms, on_cpu = _layer(nv, nr, nn, t_hit, t_copy, lane, t_read, t_first)
        layer_ms += p * ms
        cpu_per_layer += p * on_cpu
    non_moe = non_moe_ms(x, geo)
    controller = 0.0 if mode == Mode.EXACT else CONTROLLER_MS_PER_LAYER
    moe = geo.num_moe_layers * (controller + layer_ms)
    total = non_moe + moe
    # prefill: per chunk, max(GPU compute, PCIe streaming of non-VRAM experts) + store reads
    compute_s = _chunk_compute_s(x, geo, PREFILL_CHUNK_TOKENS)
    stream_s = (total_experts - x.vram_slots) * eb / (x.pcie_gbps * 1e9)
    store_s = stored_slots * eb / (x.store_gbps * 1e9) if stored_slots else 0.0
    prefill = PREFILL_CHUNK_TOKENS / (max(compute_s, stream_s) + store_s)
    return Prediction(
        mode=mode,
        decode_tok_s=round(1000 / total, 2),
        ms_per_token=round(total, 2),
        non_moe_ms=round(non_moe, 2),
        moe_ms=round(moe, 2),
        vram_share=round(pv, 4),
        ram_share=round(pr, 4),
        store_share=round(pn, 4),
        cpu_experts_per_layer=round(cpu_per_layer, 2),
        prefill_tok_s=round(prefill, 1),
    )


def _pick_rates(geo: Geometry) -> list[float]:
    """Per-token pick probability of each expert of a layer, hottest first, on the popularity
    curve (its slope at each rank); they sum to top_k."""
    n = geo.experts_per_layer
    return [geo.top_k * (hit_fraction((i + 1) / n) - hit_fraction(i / n)) for i in range(n)]


def exact_decode_ms(x: CostInputs, geo: Geometry = GLM53_FLASH, batch: int = 1) -> float:
    """Exact mode's decode step at `batch` streams: the non-MoE work (the same at these few
    rows: bandwidth and launch bound) plus, per MoE layer, every distinct expert the batch picks
    once: the hottest x.vram_slots / total of each layer from VRAM, the rest over PCIe. At batch
    1 this is predict(EXACT, ...)'s ms_per_token."""
    _, t_hit, t_copy = _expert_ms(x, geo)
    cached = x.vram_slots / geo.num_moe_layers  # the hottest experts of each layer
    layer_ms = 0.0
    for rank, rate in enumerate(_pick_rates(geo)):
        picked = 1.0 - (1.0 - min(1.0, rate)) ** batch  # picked by at least one stream
        resident = min(1.0, max(0.0, cached - rank))  # a part of a slot: an average layer's
        layer_ms += picked * (resident * t_hit + (1.0 - resident) * t_copy)
    return non_moe_ms(x, geo) + geo.num_moe_layers * layer_ms


def _staged_s(x: CostInputs, geo: Geometry) -> float:
    """Seconds of one MoE layer's prefill stage: its staged records over PCIe. Nothing is
    staged when every expert is in VRAM (stock exllamav3, or a cache that holds the model)."""
    eb, _, _ = _expert_ms(x, geo)
    missing = max(0.0, geo.experts_per_layer - x.vram_slots / geo.num_moe_layers)
    if missing <= 0:
        return 0.0
    records = x.stage_records if x.stage_records is not None else missing
    return records * eb / (x.pcie_gbps * 1e9)


def exact_chunk_s(x: CostInputs, geo: Geometry, tokens: int) -> float:
    """One chunk-major prefill chunk of exact mode (glm53.tiers.vram_cache.PrefillStager): the
    dense layers compute; the first MoE layer's stage runs on the main stream after its
    router, so it adds in full; each later MoE layer's stage was started after the previous
    layer's router, so that layer costs the slower of its compute and its stage (copy-engine
    DMA), or both one after the other (x.stage_overlap False: an SM gather kernel). The last
    layer computes its attention only (Geometry.prefill_moe_layers) and stages nothing."""
    c = _chunk_compute_s(x, geo, tokens) / geo.num_layers
    s = _staged_s(x, geo)
    # the MoE layers staged: those a prefill runs (the last one's MLP never does), and with
    # x.stage_last_layer the last one too (its copy queued behind the others, paid as theirs)
    staged = geo.num_moe_layers if x.stage_last_layer else geo.prefill_moe_layers
    if not x.stage_overlap:
        return geo.num_layers * c + staged * s
    if staged == 0:
        return geo.num_layers * c
    return (geo.num_layers - staged) * c + (s + c) + (staged - 1) * max(c, s)


def chunk_lengths(prompt_tokens: int, chunk_tokens: int) -> list[int]:
    """The tokens of each chunk a prompt is prefilled in: full chunks, then the rest."""
    return [min(chunk_tokens, prompt_tokens - s) for s in range(0, prompt_tokens, chunk_tokens)]


def exact_prefill_tok_s(
    x: CostInputs, geo: Geometry, prompt_tokens: int, chunk_tokens: int
) -> float:
    """Exact mode's chunk-major prefill rate: exact_chunk_s over the prompt's chunks."""
    seconds = sum(exact_chunk_s(x, geo, n) for n in chunk_lengths(prompt_tokens, chunk_tokens))
    return prompt_tokens / seconds


# the figures bench/gpu_slice.py measures per row, with the prompt and chunk of each prefill
PREFILL_ROWS = (
    ("prefill_512_tok_s", 512, 2048),
    ("prefill_8192_tok_s", 8192, 2048),
    ("prefill_8192_chunk8192_tok_s", 8192, 8192),
)


def exact_rows(x: CostInputs, geo: Geometry = GLM53_FLASH, lent_slots: int = 0) -> dict[str, float]:
    """Exact mode's predicted figures under bench/gpu_slice.py's names: decode per stream at
    concurrency 1, 2 and 4, the aggregate at 4, the prefill rates and the decode hit rate. With
    x.vram_slots = 0 this is the zero-copy floor, with every expert slotted the all-VRAM row.
    `lent_slots`: the staging loan's records (--ec-stage-loan), cache slots in decode only."""
    dx = msgspec.structs.replace(x, vram_slots=x.vram_slots + lent_slots) if lent_slots else x
    ms = {b: exact_decode_ms(dx, geo, b) for b in (1, 2, 4)}
    out = {
        "decode_c1_tok_s": 1000 / ms[1],
        "decode_c2_per_stream_tok_s": 1000 / ms[2],
        "decode_c4_per_stream_tok_s": 1000 / ms[4],
        "decode_c4_aggregate_tok_s": 4000 / ms[4],
        "hit_rate": hit_fraction(dx.vram_slots / geo.total_experts),
    }
    for name, tokens, chunk in PREFILL_ROWS:
        out[name] = exact_prefill_tok_s(x, geo, tokens, chunk)
    return out
