"""Two or more GPUs in one process: which layers each GPU holds and how many expert slots its
VRAM cache gets (issue #20). Pure Python (no torch): the doctor and CI use it as the engine
(glm53.exl3.split) does.

exllamav3 places each module on a device of its own and moves the hidden state to the next
module's device (`Module.prepare_for_device`); its KV and recurrent cache layers are allocated
on their attention module's device. So a layer split is a list of contiguous layer ranges, one
per `--gpus` entry. Each entry gets its own `DeviceExpertCache` over the MoE layers it holds
(and its own prefill stager), and every cache reads misses zero-copy from the one pinned,
portable home in RAM. The last entry also holds the final norm and lm_head; the embedding stays
in host memory, as on one GPU.

What a GPU pays for (bytes, as glm53.plan.vram.plan_vram counts them on one GPU): the non-expert
weights of its layers (routed experts' suh/svh included: they load to VRAM), their KV cache
(DSA layers, per token of the shared cache) and recurrent state (KDA layers, per sequence), one
chunk's activations and the reserve (--ec-reserve-gb), two staging buffers per entry, then
expert slots. Over one GPU holding the same model, a split therefore costs, per extra device,
one more activation allowance, one more reserve and one more pair of staging buffers; and per
extra entry on the same device (`--gpus 0,0`), one more pair of staging buffers only.

Assignment rule (plan_split): the simpler rule the issue allows, justified here. "Most slots in
total" cannot choose a cut by itself: a device's slots are its free VRAM less its fixed bytes,
so moving a layer across a cut moves its bytes, not the total; only flooring (a slot or two),
staging's kinks and the cap at a part's own experts change it. Maximising it picks a cut by that
noise (on two 24 GB cards: parts caching 23.6 % and 29.1 % of their experts, for 2 slots).

So the cut maximises the cache's worth instead, sum over parts of 2 S - S^2 / (M E) (S its
slots, M its MoE layers, E experts per layer): the share of decode picks VRAM serves when an
expert's popularity falls linearly with its rank (hit fraction 2c - c^2 at capacity c, the
simplest concave curve; the measured one is steeper, glm53.doctor.costmodel), times the picks.
Every slot adds to it (2 (1 - c) > 0, so more slots always win at equal shares), and for a
fixed total it is largest when every part caches the same share of its layers' experts. Ties
go to the lowest peak (the largest share of a device's free VRAM in use: when every expert
fits, the layers spread instead of leaving a GPU nearly idle).

How: consecutive equal entries are one device (`0,0,1`: device 0 holds two parts, then device
1); a device listed again after another is refused. Over the devices, every cut of the layers
into contiguous, non-empty, ordered ranges where each device holds its layers' fixed bytes
within its free VRAM is scored, by dynamic programming over the cut points (exact: the score
adds up over devices, the peak is a max). Inside a device listed m times, its layers are cut
into m ranges of as equal a count of MoE layers as can be, and its slots are shared in
proportion to the MoE layers of each part.

The hidden state crosses between devices once per boundary per token: `hop_bytes_per_token`
(the mHC residual streams in fp32, what flows between layers) is what the doctor's prediction
charges over PCIe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import msgspec

from glm53.plan.vram import chunk_activation_bytes, layer_cache_geometry, staging_slots
from glm53.units import GIB

EXPERT_TRELLIS = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.trellis$")
LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")
EMBEDDING_SUFFIX = "embed_tokens.weight"  # exllamav3's embedding module prefers host memory
RECORD_ALIGN = 256  # a slot's bytes: one expert's gate|up|down padded to 256 (CacheGeometry)


class ModelLayers(msgspec.Struct, frozen=True, kw_only=True):
    """Per decoder layer, what its VRAM holds besides routed experts' trellis."""

    weight_bytes: tuple[int, ...]  # non-expert weights (routed suh/svh included)
    moe: tuple[bool, ...]  # routed experts in this layer
    kv_bytes_per_token: tuple[int, ...]  # DSA layers' cache
    state_bytes_per_sequence: tuple[int, ...]  # KDA layers' recurrent state
    head_bytes: int  # final norm + lm_head (on the last part)
    record_bytes: int  # one VRAM slot: an expert's trellis, padded to 256 bytes
    num_experts: int  # routed experts per MoE layer
    hop_bytes_per_token: int  # hidden state crossing one device boundary, per token

    @property
    def num_layers(self) -> int:
        return len(self.weight_bytes)


def model_layers(tensors: Mapping[str, int], text_config: dict) -> ModelLayers:
    """ModelLayers of a glm5_next EXL3 checkpoint from its tensor sizes (key -> bytes, as the
    safetensors headers give them) and its text config. Layers at or past num_hidden_layers
    (an MTP head) are not part of the text model and are left out."""
    tc = text_config
    n = int(tc["num_hidden_layers"])
    weights = [0] * n
    moe = [False] * n
    parts: dict[str, int] = {}
    head = 0
    for key, nbytes in tensors.items():
        if key.endswith(EMBEDDING_SUFFIX):
            continue
        m = LAYER_KEY.search(key)
        layer = int(m[1]) if m else None
        if layer is not None and layer >= n:
            continue
        t = EXPERT_TRELLIS.search(key)
        if t is not None:
            moe[layer] = True
            parts.setdefault(t[1], nbytes)
            continue
        if layer is None:
            head += nbytes
        else:
            weights[layer] += nbytes
    if not parts:
        raise ValueError("no routed expert trellis in the checkpoint: not an EXL3 MoE model")
    per_layer = layer_cache_geometry(tc)
    raw = sum(parts.values())
    return ModelLayers(
        weight_bytes=tuple(weights),
        moe=tuple(moe),
        kv_bytes_per_token=tuple(kv for kv, _ in per_layer),
        state_bytes_per_sequence=tuple(st for _, st in per_layer),
        head_bytes=head,
        record_bytes=-(-raw // RECORD_ALIGN) * RECORD_ALIGN,
        num_experts=int(tc["n_routed_experts"]),
        hop_bytes_per_token=4 * int(tc.get("hc_mult", 4)) * int(tc["hidden_size"]),
    )


class SplitInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What plan_split depends on; bytes unless named otherwise."""

    layers: ModelLayers
    gpus: tuple[int, ...]  # the --gpus list, in order
    free_bytes: dict[int, int]  # device index -> VRAM glm53 may use there (free, or a budget)
    context_tokens: int  # the cache's token capacity (shared by the batch)
    batch: int
    activation_bytes: int  # the largest chunk's activations, once per device
    reserve_bytes: int  # kept free on every device (--ec-reserve-gb)
    stage_gb: float | None = None  # --ec-stage-gb, per part
    max_slots: int | None = None  # --ec-max-slots, over all parts together


class PartPlan(msgspec.Struct, frozen=True):
    """One --gpus entry: its layers [first, end), what they take, and its cache."""

    entry: int  # position in --gpus
    device: int
    first_layer: int
    end_layer: int
    moe_layers: list[int]
    weight_bytes: int  # its layers' non-expert weights (+ the head on the last part)
    kv_bytes: int
    state_bytes: int
    stage_slots: int  # records per staging buffer (two buffers)
    stage_bytes: int
    cache_slots: int
    cache_bytes: int
    expert_share: float  # cache_slots / the routed experts of its MoE layers (0 without any)


class DevicePlan(msgspec.Struct, frozen=True):
    device: int
    entries: list[int]  # positions in --gpus placed on this device
    free_bytes: int
    activation_bytes: int
    reserve_bytes: int
    used_bytes: int  # everything planned on it, the reserve included
    left_bytes: int  # free_bytes - used_bytes


class SplitPlan(msgspec.Struct, frozen=True):
    parts: list[PartPlan]
    devices: list[DevicePlan]
    total_slots: int
    total_experts: int
    boundaries: int  # device changes a token crosses
    hop_bytes_per_token: int

    def part_of_layer(self, layer: int) -> PartPlan:
        return next(p for p in self.parts if p.first_layer <= layer < p.end_layer)


def parse_gpus(text: str) -> tuple[int, ...]:
    """`0,1` or `0,0` -> (0, 1) or (0, 0); spaces allowed; an empty list is refused."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not re.fullmatch(r"\d+", t) for t in items):
        raise ValueError(
            f"--gpus {text!r}: write GPU indices separated by commas, e.g. 0,1 (two GPUs) or "
            "0,0 (the split path with both halves on GPU 0)"
        )
    return tuple(int(t) for t in items)


def _groups(gpus: Sequence[int], known: Mapping[int, int]) -> list[tuple[int, int]]:
    """(device, parts on it) in order; refuses an empty list, an unknown index and a device
    that comes back after another."""
    if not gpus:
        raise ValueError("--gpus is empty: name at least one GPU index, e.g. --gpus 0")
    for g in gpus:
        if g not in known:
            have = ", ".join(str(i) for i in sorted(known)) or "none"
            raise ValueError(
                f"--gpus names GPU {g}, which this host does not have (GPUs: {have}); "
                "list only those indices (nvidia-smi's, with CUDA_DEVICE_ORDER=PCI_BUS_ID)"
            )
    out: list[tuple[int, int]] = []
    for g in gpus:
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1] + 1)
        elif any(d == g for d, _ in out):
            raise ValueError(
                f"--gpus {','.join(map(str, gpus))}: GPU {g} appears again after another GPU; "
                "a GPU's layers must be one contiguous run, so list its repeats together "
                f"(e.g. {','.join(map(str, sorted(gpus, key=list(gpus).index)))})"
            )
        else:
            out.append((g, 1))
    return out


def _even_cuts(moe: Sequence[bool], first: int, end: int, parts: int) -> list[int]:
    """Cut [first, end) into `parts` contiguous non-empty ranges with MoE-layer counts as
    equal as can be: the starts of the ranges after the first."""
    if parts == 1:
        return []
    moe_idx = [i for i in range(first, end) if moe[i]]
    cuts, at = [], first
    for k in range(1, parts):
        if len(moe_idx) >= parts:
            target = moe_idx[(k * len(moe_idx)) // parts]  # the k-th part starts at a MoE layer
        else:
            target = first + (k * (end - first)) // parts
        at = max(at + 1, target)
        cuts.append(at)
    return cuts


class _Segment(msgspec.Struct, frozen=True):
    slots: int
    worth: Fraction  # sum over parts of 2 S - S^2 / (M E) (the module docstring)
    parts: list[PartPlan]
    device: DevicePlan


def _segment(x: SplitInputs, device: int, count: int, first_entry: int, first: int, end: int,
             last: bool) -> _Segment | None:  # fmt: skip
    """Layers [first, end) on `device` as `count` parts, or None when their fixed bytes do
    not fit its free VRAM."""
    L = x.layers
    free = x.free_bytes[device]
    starts = [first, *_even_cuts(L.moe, first, end, count), end]
    ranges = list(zip(starts[:-1], starts[1:], strict=True))
    weights = [sum(L.weight_bytes[a:b]) for a, b in ranges]
    if last:
        weights[-1] += L.head_bytes
    kv = [sum(L.kv_bytes_per_token[a:b]) * x.context_tokens for a, b in ranges]
    state = [sum(L.state_bytes_per_sequence[a:b]) * x.batch for a, b in ranges]
    fixed = sum(weights) + sum(kv) + sum(state) + x.activation_bytes
    left = free - fixed
    if left < x.reserve_bytes:
        return None
    rb, n_e = L.record_bytes, L.num_experts
    moe = [[i for i in range(a, b) if L.moe[i]] for a, b in ranges]
    n_moe = sum(len(m) for m in moe)
    stage = staging_slots(left, x.reserve_bytes, n_e, rb, x.stage_gb) if n_moe else 0
    stage_of = [stage if m else 0 for m in moe]
    room = left - x.reserve_bytes - sum(2 * s * rb for s in stage_of)
    total = min(max(0, room // rb), n_moe * n_e)
    slots = split_in_proportion(total, [len(m) for m in moe])
    plans = [
        PartPlan(
            entry=first_entry + k,
            device=device,
            first_layer=a,
            end_layer=b,
            moe_layers=moe[k],
            weight_bytes=weights[k],
            kv_bytes=kv[k],
            state_bytes=state[k],
            stage_slots=stage_of[k],
            stage_bytes=2 * stage_of[k] * rb,
            cache_slots=slots[k],
            cache_bytes=slots[k] * rb,
            expert_share=slots[k] / (len(moe[k]) * n_e) if moe[k] else 0.0,
        )  # fmt: skip
        for k, (a, b) in enumerate(ranges)
    ]
    used = fixed + x.reserve_bytes + sum(p.stage_bytes + p.cache_bytes for p in plans)
    dev = DevicePlan(
        device=device, entries=[p.entry for p in plans], free_bytes=free,
        activation_bytes=x.activation_bytes, reserve_bytes=x.reserve_bytes, used_bytes=used,
        left_bytes=free - used,
    )  # fmt: skip
    worth = sum(
        (2 * s - Fraction(s * s, len(m) * n_e) for s, m in zip(slots, moe, strict=True) if m),
        Fraction(0),
    )
    return _Segment(total, worth, plans, dev)


def split_in_proportion(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split in proportion to `weights`, largest remainders first (exact sum)."""
    w = sum(weights)
    if w == 0:
        return [0] * len(weights)
    base = [total * wi // w for wi in weights]
    rest = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % w))
    for i in rest[: total - sum(base)]:
        base[i] += 1
    return base


def plan_split(x: SplitInputs) -> SplitPlan:
    """The layer split and per-part caches for x, by the rule in the module docstring. Raises
    ValueError naming the fix: an empty --gpus, an unknown index, a GPU listed again after
    another, a GPU that cannot hold even one layer's non-expert weights, or devices that
    together cannot hold the model's."""
    L = x.layers
    groups = _groups(x.gpus, x.free_bytes)
    n, D = L.num_layers, len(groups)
    if n < len(x.gpus):
        raise ValueError(f"--gpus has {len(x.gpus)} entries but the model has only {n} layers")
    # best[d][i]: the best placement of layers [0, i) on the first d devices, by the key
    # (worth, -peak), compared as a tuple: both compose monotonically (a sum, a max), so keeping
    # only the best prefix per (d, i) is exact
    best: list[dict[int, tuple[tuple, list[_Segment]]]] = [{0: ((Fraction(0), 0.0), [])}]
    entry = 0
    for d, (device, count) in enumerate(groups):
        row: dict[int, tuple[tuple, list[_Segment]]] = {}
        last = d == D - 1
        for i, (score, segs) in best[d].items():
            ends = [n] if last else range(i + count, n - (len(x.gpus) - entry - count) + 1)
            for j in ends:
                if j - i < count:
                    continue
                seg = _segment(x, device, count, entry, i, j, last)
                if seg is None:
                    continue
                peak = seg.device.used_bytes / seg.device.free_bytes
                new = (score[0] + seg.worth, min(score[1], -peak))
                if j not in row or new > row[j][0]:
                    row[j] = (new, [*segs, seg])
        entry += count
        best.append(row)
    if n not in best[D]:
        raise ValueError(_why_not(x, groups))
    segs = best[D][n][1]
    parts = [p for s in segs for p in s.parts]
    parts = _cap(parts, x.max_slots, L.record_bytes, L.num_experts)
    devices = [s.device for s in segs]
    return SplitPlan(
        parts=parts,
        devices=devices,
        total_slots=sum(p.cache_slots for p in parts),
        total_experts=sum(L.moe) * L.num_experts,
        boundaries=D - 1,
        hop_bytes_per_token=L.hop_bytes_per_token,
    )


def _cap(parts: list[PartPlan], max_slots: int | None, rb: int, n_experts: int) -> list[PartPlan]:
    """--ec-max-slots over all parts: each part keeps its proportional share."""
    total = sum(p.cache_slots for p in parts)
    if max_slots is None or total <= max_slots:
        return parts
    shares = split_in_proportion(max_slots, [p.cache_slots for p in parts])
    out = []
    for p, s in zip(parts, shares, strict=True):
        share = s / (len(p.moe_layers) * n_experts) if p.moe_layers else 0.0
        out.append(
            msgspec.structs.replace(p, cache_slots=s, cache_bytes=s * rb, expert_share=share)
        )
    return out


def _why_not(x: SplitInputs, groups: list[tuple[int, int]]) -> str:
    L = x.layers
    smallest = min(
        L.weight_bytes[i]
        + L.kv_bytes_per_token[i] * x.context_tokens
        + L.state_bytes_per_sequence[i] * x.batch
        for i in range(L.num_layers)
    )
    for device, _ in groups:
        need = smallest + x.activation_bytes + x.reserve_bytes
        if x.free_bytes[device] < need:
            return (
                f"GPU {device} cannot hold even one layer's non-expert weights: "
                f"{x.free_bytes[device] / GIB:.2f} GiB free, the smallest layer with its cache, "
                f"the activations and the reserve need {need / GIB:.2f} GiB; drop GPU {device} "
                "from --gpus, free VRAM on it, or lower --context / --max-batch"
            )
    total_free = sum(x.free_bytes[d] for d, _ in groups)
    need = (
        sum(L.weight_bytes)
        + L.head_bytes
        + sum(L.kv_bytes_per_token) * x.context_tokens
        + sum(L.state_bytes_per_sequence) * x.batch
        + len(groups) * (x.activation_bytes + x.reserve_bytes)
    )
    return (
        f"GPUs {','.join(str(d) for d, _ in groups)} cannot hold the model's non-expert layers "
        f"between them: {total_free / GIB:.2f} GiB free in all, the layers, their cache, the "
        f"head and each GPU's activations and reserve need at least {need / GIB:.2f} GiB (and "
        "each GPU must hold whole layers); add a GPU to --gpus or lower --context / --max-batch"
    )


def split_inputs(
    layers: ModelLayers,
    gpus: Sequence[int],
    free_bytes: Mapping[int, int],
    text_config: dict,
    cache_tokens: int,
    max_batch: int,
    max_chunk: int,
    ec_reserve_gb: float = 1.0,
    ec_stage_gb: float | None = None,
    ec_max_slots: int | None = None,
) -> SplitInputs:
    """SplitInputs with the engine's accounting (glm53.exl3.loader.vram_plan_for's, per
    device)."""
    return SplitInputs(
        layers=layers,
        gpus=tuple(gpus),
        free_bytes=dict(free_bytes),
        context_tokens=cache_tokens,
        batch=max_batch,
        activation_bytes=chunk_activation_bytes(text_config, max_chunk),
        reserve_bytes=int(ec_reserve_gb * GIB),
        stage_gb=ec_stage_gb,
        max_slots=ec_max_slots,
    )
