"""The planner: which mode to run on this host, with which flags, and how fast it should be.
Every mode the host can run is predicted with the cost model; the fastest is recommended, and
the fastest bit-exact one is named beside it when they differ."""

from __future__ import annotations

import os

import msgspec

from glm53.doctor import inputs as hi
from glm53.doctor.costmodel import (
    BIT_EXACT_MODES,
    GIB,
    LANE_MODES,
    MIN_FREE_VRAM_MIB,
    NVME_MIN_CAP_BYTES,
    REF_FP16_TFLOPS,
    REF_VRAM_GBPS,
    STORE_MODES,
    CostInputs,
    Mode,
    Prediction,
    all_ram_bytes,
    expert_trellis_bytes,
    nvme_process_bytes,
    predict,
    ram_tier_slots,
    seed_lane,
    store_total_bytes,
    vram_slots,
)
from glm53.doctor.cpu import format_cpu_list
from glm53.doctor.geometry import GLM53_FLASH, Geometry, model_geometry
from glm53.doctor.gpu import spec_of
from glm53.doctor.host import Gpu, HostProbe
from glm53.doctor.multi_gpu import MultiGpuOutlook, outlook
from glm53.doctor.prefill import PrefillOutlook, prefill_outlook
from glm53.doctor.sweep import SweepResult, read_sweep
from glm53.modes import recommended

# the modes glm53 doctor recommends: those the GPU engine serves without --allow-unrun-modes
# (glm53.modes' table)
SERVED_MODES = recommended("gpu")
NOT_SERVED = "it has not yet run on a GPU (serve runs it only with --allow-unrun-modes)"

EB = expert_trellis_bytes(3)
DEFAULT_CT_B_MS = 0.104  # the seed's lane ms per expert at 22 threads (--ct-b is unset by default)
DESKTOP_EC_MAX_SLOTS = 1376  # seed §2.3: cap when a desktop shares the GPU
SEED_STORE_LATENCY_MS = 1.3  # seed §4.3: mean record read latency under load, 1.2-1.4 ms
CHECKPOINT_DIRNAME = "GLM-5.3-Flash-exl3-3.05bpw"


class PlanRequest(msgspec.Struct, frozen=True):
    model_dir: str | None = None
    store: str | None = None
    ram_cap_bytes: int | None = None  # cap of the RAM expert tier, as serve's --ram-cap
    cpus: list[int] | None = None
    ec_max_slots: int | None = None
    gpu_index: int | None = None
    compare: str | None = None
    gpus: list[int] | None = None  # --gpus: plan the layer split over these (multi_gpu.py)


class InputValue(msgspec.Struct, frozen=True):
    name: str
    value: float | int | str
    source: str


class ModeOption(msgspec.Struct, frozen=True):
    mode: Mode
    feasible: bool
    reason: str
    host_ram_bytes: int | None = None
    ram_tier_bytes: int | None = None
    prediction: Prediction | None = None
    inputs: list[InputValue] = []
    flags: dict[str, str] = {}
    caps: list[CapPrediction] = []  # nvme modes: the prediction at each --ram-cap
    prefill: PrefillOutlook | None = None  # chunk-major vs layer-major per prompt (predicted)


class CapPrediction(msgspec.Struct, frozen=True):
    """An nvme mode's prediction at one --ram-cap: the RAM tier's records, the whole process's
    memory at that cap (nvme_process_bytes), and whether the host's budget holds it."""

    ram_cap_bytes: int
    ram_tier_slots: int
    process_bytes: int
    within_budget: bool
    decode_tok_s: float
    prefill_tok_s: float
    ram_share: float
    store_share: float


# RAM-tier sizes the doctor predicts for, as shares of the experts not in VRAM
CAP_SHARES = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0)


def cap_sweep(
    mode: Mode, inputs: dict, planned_slots: int, budget_bytes: int, geo: Geometry = GLM53_FLASH
) -> list[CapPrediction]:
    """Predictions at CAP_SHARES of the experts not in VRAM and at the planned tier, smallest
    first; `inputs` are the mode's CostInputs fields."""
    room = geo.total_experts - int(inputs["vram_slots"])
    sizes = sorted({int(share * room) for share in CAP_SHARES} | {planned_slots})
    out = []
    for slots in (n for n in sizes if n > 0):
        p = predict(mode, CostInputs(**{**inputs, "ram_tier_slots": slots}), geo)
        process = nvme_process_bytes(slots)
        out.append(
            CapPrediction(
                ram_cap_bytes=slots * EB,
                ram_tier_slots=slots,
                process_bytes=process,
                within_budget=process <= budget_bytes,
                decode_tok_s=p.decode_tok_s,
                prefill_tok_s=p.prefill_tok_s,
                ram_share=p.ram_share,
                store_share=p.store_share,
            )
        )
    return out


class Proposal(msgspec.Struct, frozen=True):
    title: str
    why: str
    commands: list[str]
    warning: str


class Comparison(msgspec.Struct, frozen=True):
    file: str
    mode: str
    decode_measured_tok_s: float | None
    decode_predicted_tok_s: float | None
    prefill_tokens: int | None
    prefill_measured_tok_s: float | None
    prefill_predicted_tok_s: float | None


class Plan(msgspec.Struct):
    headline: str
    mode: Mode | None
    exact_alternative: Mode | None
    gpu_index: int | None
    lane_cpus: list[int]
    budget_bytes: int | None
    budget_how: str
    store_location: str | None
    model_location: str | None
    steps: list[str]  # commands in order; the last one starts the server
    options: list[ModeOption]
    proposals: list[Proposal]
    comparison: Comparison | None = None
    geometry: Geometry = GLM53_FLASH  # what the predictions are for
    lane_layout: hi.LaneLayout | None = None  # how lane_cpus were chosen, and what is left out
    # the fastest mode that fits when it has not yet run on a GPU (it is
    # predicted and shown, never recommended: `glm53 serve` refuses it without
    # --allow-unrun-modes)
    planned: Mode | None = None
    # two or more GPUs on the host, or --gpus: the layer split per GPU and its prediction
    multi_gpu: MultiGpuOutlook | None = None


def _gpu_inputs(gpu: Gpu, host: HostProbe) -> list[InputValue]:
    m = host.measured
    if m.pcie_h2d_gbps:
        pcie = InputValue("pcie_gbps", m.pcie_h2d_gbps, "measured: pinned host-to-device copy")
    else:
        est = hi.link_gbps(gpu.pcie_gen_max, gpu.pcie_width_max, hi.PCIE_PRACTICAL)
        why = m.notes.get("pcie", "not measured")
        if est:
            pcie = InputValue(
                "pcie_gbps",
                est,
                f"estimated: PCIe {gpu.pcie_gen_max}.0 x{gpu.pcie_width_max} at 80 % of line "
                f"rate ({why})",
            )
        else:
            pcie = InputValue("pcie_gbps", 25.0, f"assumed: the seed's 4.0 x16 link ({why})")
    if gpu.memory_bandwidth_gbps:
        vram = InputValue(
            "vram_gbps", gpu.memory_bandwidth_gbps, f"{gpu.source}: bus width x memory clock"
        )
    else:
        vram = InputValue("vram_gbps", REF_VRAM_GBPS, "assumed: an RTX 3090's (unknown card)")
    spec = spec_of(gpu.name)
    if spec:
        tflops = InputValue("gpu_fp16_tflops", spec[1], f"spec sheet of {gpu.name}")
    else:
        tflops = InputValue(
            "gpu_fp16_tflops", REF_FP16_TFLOPS, "assumed: an RTX 3090's (card not in the table)"
        )
    return [pcie, vram, tflops]


def _lane_inputs(host: HostProbe, threads: int) -> list[InputValue]:
    """The lane's cost: calibrated here, else the seed's in-place lane (§3.6). Not its swizzled
    one (§3.5): glm53 keeps no second copy of the experts (--ct-swz is off and not built)."""
    m = host.measured
    if m.lane is not None:
        src = f"measured: glm53.tiers.cpu_lane calibration at {m.lane.threads} threads"
        return [
            InputValue("lane_a_ms", m.lane.a_ms, src),
            InputValue("lane_b_ms", m.lane.b_ms, src),
        ]
    why = m.notes.get("lane", "not calibrated: the lane calibration was not run")
    a, b = seed_lane(threads, m.dram_gbps)
    src = f"{why}; seed §3.6 in-place lane, b = 0.165 ms x 22 / {threads} threads"
    if m.dram_gbps:
        src += f", no faster than 66 % of {m.dram_gbps:.0f} GB/s DRAM allows"
    return [InputValue("lane_a_ms", round(a, 4), src), InputValue("lane_b_ms", round(b, 4), src)]


def _value(values: list[InputValue], name: str):
    return next(v.value for v in values if v.name == name)


def _store_inputs(host: HostProbe, req: PlanRequest, spot: hi.Spot | None) -> list[InputValue]:
    m = host.measured
    if req.store and m.store is not None:
        src = f"measured: O_DIRECT reads of {m.store.bytes_read >> 20} MiB in {m.store.path}"
        return [
            InputValue("store_gbps", m.store.read_gbps, src),
            InputValue("store_latency_ms", m.store.record_latency_ms, src),
        ]
    if spot is not None and spot.read_gbps_estimate:
        why = m.notes.get("store", "not measured: pass --store DIR")
        return [
            InputValue(
                "store_gbps",
                spot.read_gbps_estimate,
                f"estimated from the NVMe links of {', '.join(spot.disks)} ({why})",
            ),
            InputValue("store_latency_ms", SEED_STORE_LATENCY_MS, "assumed: seed §4.3, under load"),
        ]
    return []


def desktop_ec_max_slots(gpu: Gpu, requested: int | None) -> int | None:
    """--ec-max-slots: the user's value, else the seed's 1,376 when a desktop (a graphics
    process) shares the GPU and may take VRAM after the cache has sized itself (§2.3, §8.10)."""
    if requested is not None:
        return requested
    if any("graphics" in proc.kind for proc in gpu.processes):
        return DESKTOP_EC_MAX_SLOTS
    return None


def _demo(headline: str, reason: str) -> Plan:
    return Plan(
        headline=headline,
        mode=None,
        exact_alternative=None,
        gpu_index=None,
        lane_cpus=[],
        budget_bytes=None,
        budget_how="",
        store_location=None,
        model_location=None,
        steps=["glm53 serve --demo"],
        options=[ModeOption(mode=m, feasible=False, reason=reason) for m in Mode],
        proposals=[],
    )


def _size_flag(nbytes: int) -> str:
    return f"{int(nbytes / GIB * 10) / 10:g}G"


def place_on(spot: hi.Spot, name: str) -> str:
    """A directory for glm53's files on a filesystem: under its mount point, or under
    /var/lib/glm53 on the root filesystem."""
    base = "/var/lib/glm53" if spot.target == "/" else spot.target
    return os.path.join(base, name)


def store_present(path: str | None) -> bool:
    """A store directory that already holds files (a packed store, to verify rather than pack)."""
    return (
        bool(path) and os.path.isdir(path) and any(not n.startswith(".") for n in os.listdir(path))
    )


def _store_location(host: HostProbe, req: PlanRequest, all_spots: list[hi.Spot]):
    """(store path, the filesystem it is on, why it cannot be used or "")."""
    need = store_total_bytes(3)
    if not req.store:
        spot = hi.store_spot(all_spots)
        if spot is None:
            return (
                None,
                None,
                (
                    f"no local xfs/ext4 filesystem on NVMe has {need / 1e9:.1f} GB free for the store"
                ),
            )
        return place_on(spot, "glm53-store"), spot, ""
    if host.measured.odirect_ok is False:
        return req.store, None, host.measured.notes.get("odirect", "O_DIRECT refused")
    mount = hi.mount_of(host.storage, req.store) if host.storage else None
    spot = next((s for s in all_spots if mount and s.target == mount.target), None)
    if store_present(req.store):
        return req.store, spot, ""
    if spot is None:
        return req.store, None, f"{req.store}: not on a local disk filesystem with known free space"
    if spot.free_bytes < need:
        return (
            req.store,
            spot,
            (
                f"{spot.target} has {spot.free_bytes / 1e9:.1f} GB free, the store needs {need / 1e9:.1f} GB"
            ),
        )
    return req.store, spot, ""


def _options(host: HostProbe, req: PlanRequest, gpu: Gpu, lane: list[int], budget: hi.Budget,
             store_path: str | None, spot: hi.Spot | None, store_why: str,
             ec_max_slots: int | None, geo: Geometry) -> list[ModeOption]:  # fmt: skip
    gpu_in = _gpu_inputs(gpu, host)
    simd = hi.lane_simd(host.cpu) if host.cpu else None
    experts = geo.total_experts * EB
    options = []
    for mode in Mode:
        flags: dict[str, str] = {}
        if mode in LANE_MODES and host.cpu is None:
            options.append(ModeOption(mode, False, "CPU probe unavailable"))
            continue
        if mode in LANE_MODES and simd is None:
            options.append(
                ModeOption(mode, False, "the CPU lacks AVX2/FMA/F16C and AVX-512: no fast lane")
            )
            continue
        if mode in LANE_MODES and not lane:
            options.append(
                ModeOption(mode, False, "no physical core left for the CPU lane after two")
            )
            continue
        slots = vram_slots(gpu.memory_free_mib, mode, max_slots=ec_max_slots, geo=geo)
        values = [*gpu_in, InputValue("vram_slots", slots, "free VRAM - model - reserve")]
        host_ram = tier_bytes = None
        if mode in STORE_MODES:
            if store_why:
                options.append(ModeOption(mode, False, store_why))
                continue
            store_in = _store_inputs(host, req, spot)
            if not store_in:
                options.append(
                    ModeOption(mode, False, "store read rate unknown: pass --store DIR on NVMe")
                )
                continue
            if req.ram_cap_bytes is not None:
                tier_slots = req.ram_cap_bytes // EB
                src = "--ram-cap"
            else:
                tier_slots = ram_tier_slots(budget.bytes)
                src = f"from the budget: {budget.how}"
            tier_slots = min(tier_slots, geo.total_experts - slots)
            host_ram = nvme_process_bytes(tier_slots)
            if host_ram < NVME_MIN_CAP_BYTES or tier_slots <= 0:
                options.append(
                    ModeOption(mode, False, f"needs at least {NVME_MIN_CAP_BYTES // GIB} GiB RAM")
                )
                continue
            tier_bytes = tier_slots * EB
            values += [InputValue("ram_tier_slots", tier_slots, src), *store_in]
            flags |= {"--store": store_path or "", "--ram-cap": _size_flag(tier_bytes)}
        else:
            host_ram = all_ram_bytes()
            if req.ram_cap_bytes is not None and req.ram_cap_bytes < experts:
                options.append(
                    ModeOption(
                        mode,
                        False,
                        f"keeps every expert in RAM ({experts / GIB:.1f} GiB), more than "
                        f"--ram-cap {req.ram_cap_bytes / GIB:.1f} GiB",
                    )
                )
                continue
        if mode not in STORE_MODES and host_ram > budget.bytes:
            options.append(
                ModeOption(
                    mode,
                    False,
                    f"needs {host_ram / GIB:.1f} GiB RAM, the budget is "
                    f"{budget.bytes / GIB:.1f} GiB ({budget.how})",
                    host_ram_bytes=host_ram,
                )
            )
            continue
        if mode in LANE_MODES:
            lane_in = _lane_inputs(host, len(lane))
            values += lane_in
            flags["--cpus"] = format_cpu_list(lane)
            b = float(_value(lane_in, "lane_b_ms"))
            if abs(b - DEFAULT_CT_B_MS) > 0.01 * DEFAULT_CT_B_MS:
                flags["--ct-b"] = f"{b:.3f}"
        fields = {v.name: v.value for v in values}
        x = CostInputs(**fields)
        caps = []
        if mode in STORE_MODES:
            caps = cap_sweep(mode, fields, fields["ram_tier_slots"], budget.bytes, geo)
        options.append(
            ModeOption(
                mode,
                True,
                "",
                host_ram_bytes=host_ram,
                ram_tier_bytes=tier_bytes,
                prediction=predict(mode, x, geo),
                inputs=values,
                flags=flags,
                caps=caps,
                prefill=prefill_outlook(x, geo),
            )
        )
    return options


def _proposals(host: HostProbe, store_spot: hi.Spot | None) -> list[Proposal]:
    if host.storage is None or (store_spot and len(store_spot.disks) > 1):
        return []
    idle = hi.idle_nvme_disks(host.storage)
    if not idle:
        return []
    paths = [d.path for d in idle]
    warning = (
        f"ERASES everything on {', '.join(paths)}. Run these yourself, as root, only after "
        "checking that these exact devices hold nothing you need; glm53 never runs them."
    )
    if len(idle) >= 2:
        return [
            Proposal(
                title=f"RAID0 of the {len(idle)} idle NVMe drives for the store",
                why="the store reads fastest from a striped array (the seed used 4 drives, 512k "
                "chunk, xfs: ~26 GB/s)",
                commands=[
                    f"mdadm --create /dev/md/glm53 --level=0 --chunk=512K "
                    f"--raid-devices={len(idle)} {' '.join(paths)}",
                    "mkfs.xfs /dev/md/glm53",
                    "mkdir -p /mnt/glm53 && mount /dev/md/glm53 /mnt/glm53",
                ],
                warning=warning,
            )
        ]
    return [
        Proposal(
            title=f"xfs on the idle NVMe drive {paths[0]} for the store",
            why="the store needs a local xfs or ext4 filesystem on NVMe",
            commands=[
                f"mkfs.xfs {paths[0]}",
                f"mkdir -p /mnt/glm53 && mount {paths[0]} /mnt/glm53",
            ],
            warning=warning,
        )
    ]


def _command(gpus: list[Gpu], gpu: Gpu, model: str, option: ModeOption,
             ec_max_slots: int | None) -> str:  # fmt: skip
    parts = []
    if len(gpus) > 1:
        parts.append(f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={gpu.index}")
    parts += ["glm53 serve", f"--model {model}", f"--mode {option.mode}"]
    parts += [f"{k} {v}".rstrip() for k, v in option.flags.items()]
    if ec_max_slots is not None:
        parts.append(f"--ec-max-slots {ec_max_slots}")
    return " ".join(parts)


def _compare(path: str, options: list[ModeOption], recommended: Mode) -> Comparison:
    result: SweepResult = read_sweep(path)
    mode = Mode(result.mode) if result.mode in {m.value for m in Mode} else recommended
    option = next(o for o in options if o.mode == mode)
    pred = option.prediction
    return Comparison(
        file=path,
        mode=str(mode),
        decode_measured_tok_s=result.decode_c1_tok_s,
        decode_predicted_tok_s=pred.decode_tok_s if pred else None,
        prefill_tokens=result.prefill_tokens,
        prefill_measured_tok_s=result.prefill_tok_s,
        prefill_predicted_tok_s=pred.prefill_tok_s if pred else None,
    )


def multi_gpu_outlook(
    host: HostProbe, req: PlanRequest, ec_max_slots: int | None
) -> MultiGpuOutlook | None:
    """The layer split over --gpus, or over every GPU when the host has two or more; None
    for one GPU without --gpus. The cost-model inputs are the slowest listed GPU's."""
    gpus = {g.index: g for g in host.gpus or []}
    if not req.gpus and len(gpus) < 2:
        return None
    listed = [gpus[i] for i in dict.fromkeys(req.gpus or sorted(gpus)) if i in gpus]
    values = [{v.name: float(v.value) for v in _gpu_inputs(g, host)} for g in listed]
    # no listed GPU is on this host: outlook's planner refuses the list and names the index
    link = {"pcie_gbps": 25.0, "vram_gbps": REF_VRAM_GBPS, "gpu_fp16_tflops": REF_FP16_TFLOPS}
    if values:
        link = {k: min(v[k] for v in values) for k in link}
    free = {i: g.memory_free_mib * 2**20 for i, g in gpus.items()}
    return outlook(free, req.gpus, req.model_dir, link, ec_max_slots)


def make_plan(host: HostProbe, req: PlanRequest) -> Plan:
    gpus = host.gpus or []
    if host.gpus is None:
        return _demo("GPU probe unavailable: demo only", "GPU probe unavailable")
    gpu = hi.choose_gpu(gpus, req.gpu_index)
    if gpu is None:
        return _demo("no GPU: demo only", "no NVIDIA GPU")
    if gpu.memory_free_mib < MIN_FREE_VRAM_MIB:
        return _demo(
            f"GPU {gpu.index} ({gpu.name}) has {gpu.memory_free_mib:,} MiB free, glm53 needs "
            f"{MIN_FREE_VRAM_MIB:,}: demo only",
            f"under {MIN_FREE_VRAM_MIB:,} MiB of free VRAM",
        )
    if host.memory is None:
        return _demo("memory probe unavailable: demo only", "memory probe unavailable")
    budget = hi.memory_budget(host.memory)
    layout = hi.lane_layout(host.cpu, req.cpus, gpu) if host.cpu else None
    lane = layout.cpus if layout else []
    all_spots = hi.spots(host.storage) if host.storage else []
    store_path, spot, store_why = _store_location(host, req, all_spots)
    ec_max_slots = desktop_ec_max_slots(gpu, req.ec_max_slots)
    geo = model_geometry(req.model_dir)
    options = _options(host, req, gpu, lane, budget, store_path, spot, store_why, ec_max_slots, geo)
    feasible = [o for o in options if o.feasible and o.prediction]
    model_spot = hi.checkpoint_spot(all_spots, spot.target if spot else None)
    model = req.model_dir or (place_on(model_spot, CHECKPOINT_DIRNAME) if model_spot else None)
    plan = Plan(
        headline="",
        mode=None,
        exact_alternative=None,
        gpu_index=gpu.index,
        lane_cpus=lane,
        budget_bytes=budget.bytes,
        budget_how=budget.how,
        store_location=store_path,
        model_location=model,
        steps=[],
        options=options,
        proposals=_proposals(host, spot),
        geometry=geo,
        lane_layout=layout,
    )
    plan.multi_gpu = multi_gpu_outlook(host, req, ec_max_slots)
    if not feasible:
        plan.headline = "no mode fits this host: demo only (see the checks)"
        plan.steps = ["glm53 serve --demo"]
        return plan
    fastest = max(feasible, key=lambda o: o.prediction.decode_tok_s)
    served = [o for o in feasible if o.mode in SERVED_MODES]
    planned = (
        f"{fastest.mode} would give {fastest.prediction.decode_tok_s:.1f} tok/s, but {NOT_SERVED}"
    )
    if fastest.mode not in SERVED_MODES:
        plan.planned = fastest.mode
    if not served:
        why = "; ".join(
            f"{o.mode}: {o.reason}" for o in options if o.mode in SERVED_MODES and not o.feasible
        )
        plan.headline = f"no mode this build serves fits this host ({why}); {planned}: demo only"
        plan.steps = ["glm53 serve --demo"]
        return plan
    best = max(served, key=lambda o: o.prediction.decode_tok_s)
    exact = [o for o in served if o.mode in BIT_EXACT_MODES]
    if best.mode not in BIT_EXACT_MODES and exact:
        plan.exact_alternative = max(exact, key=lambda o: o.prediction.decode_tok_s).mode
    plan.mode = best.mode
    p = best.prediction
    plan.headline = (
        f"{best.mode}: {p.decode_tok_s:.1f} tok/s decode at concurrency 1, "
        f"{p.prefill_tok_s:.0f} tok/s prefill (predicted) on GPU {gpu.index}, {gpu.name}"
    )
    if plan.planned:
        plan.headline += f"; {planned}"
    if geo != GLM53_FLASH:
        plan.headline += (
            f", for {geo.name}: {geo.num_layers} layers, {geo.num_moe_layers} MoE x "
            f"{geo.experts_per_layer} experts"
        )
    model_arg = model or f"/path/to/{CHECKPOINT_DIRNAME}"
    if not (req.model_dir and os.path.isfile(os.path.join(req.model_dir, "config.json"))):
        plan.steps.append(f"glm53 download --dir {model_arg}")
    if best.mode in STORE_MODES:
        if store_present(store_path):
            plan.steps.append(f"glm53 store verify --store {store_path} --model {model_arg}")
        else:
            plan.steps.append(f"glm53 store pack --model {model_arg} --out {store_path}")
    plan.steps.append(_command(gpus, gpu, model_arg, best, ec_max_slots))
    if req.compare:
        plan.comparison = _compare(req.compare, options, best.mode)
    return plan
