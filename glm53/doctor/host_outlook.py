"""`glm53 doctor --host FILE`: every mode's predicted decode (concurrency 1 and 4) and prefill
of the full GLM-5.3-Flash on a described host, with each input and where it comes from, and
the figures measured on that host (the seed's) beside them.

Inputs go to the same cost model the probing doctor uses (costmodel.predict's layer model via
concurrency.decode_ms, prefill.predict_prefill); only the CPU lane's rates come from
lane_model, since a described host has no calibration run."""

from __future__ import annotations

import math

import msgspec

from glm53.doctor import inputs as hi
from glm53.doctor.concurrency import decode_ms
from glm53.doctor.costmodel import (
    GIB,
    LANE_MODES,
    STORE_MODES,
    CostInputs,
    Mode,
    all_ram_bytes,
    nvme_process_bytes,
    ram_tier_slots,
    vram_slots,
)
from glm53.doctor.geometry import GLM53_FLASH, Geometry
from glm53.doctor.hostfile import HostSpec
from glm53.doctor.lane_model import FIT_SOURCE, RESERVED_CORES, lane_ms
from glm53.doctor.plan import InputValue
from glm53.doctor.prefill import predict_prefill

SEED_STORE_LATENCY_MS = 1.3  # seed-project.md §4.3: a record read under load, 1.2-1.4 ms
SEED_NVME_CAP_GIB = 55.0  # seed-project.md §6.5: the shipped nvme cap
PREFILL_TOKENS = 8192
PREFILL_CHUNKS = (2048, 8192)  # serve's default chunk, and the seed's -chunk_size
PREFILL_CAVEAT = (
    "prefill is predicted from a measured all-VRAM compute only where the host file gives one "
    "(gpu.prefill_chunk_ms, gpu.prefill_token_us; else the seed's rate scaled by fp16 TFLOPS); "
    "on the H200 slice exact prefill measured 0.72-0.76 of the prediction at 512 tokens and "
    "0.81-1.06 at 8k (issue 29, docs/performance.md)"
)


class ModeRow(msgspec.Struct, frozen=True):
    mode: Mode
    decode_c1_tok_s: float
    decode_c4_aggregate_tok_s: float
    prefill_8k_tok_s: float  # at serve's 2,048-token chunks
    prefill_8k_one_chunk_tok_s: float  # as one 8,192-token chunk (the seed's -chunk_size)
    host_ram_bytes: int
    fits: bool  # the host's RAM (less headroom) holds the mode
    vram_slots: int
    inputs: list[InputValue]  # the mode's own inputs (slots, lane, store)


class HostOutlook(msgspec.Struct, frozen=True):
    host: str
    description: str
    geometry: str
    budget_bytes: int
    inputs: list[InputValue]  # shared by every mode
    rows: list[ModeRow]
    measured: dict[str, dict[str, float | str | None]]
    caveat: str = PREFILL_CAVEAT


def _fig(name: str, fig) -> InputValue:
    value = int(fig.value) if fig.value == int(fig.value) else fig.value
    return InputValue(name, value, fig.source)


def _shared(spec: HostSpec) -> list[InputValue]:
    g = spec.gpu
    if g.pcie_gbps is not None:
        pcie = _fig("pcie_gbps", g.pcie_gbps)
    else:
        gen, lanes = int(g.pcie_gen.value), int(g.pcie_lanes.value)
        est = hi.link_gbps(gen, lanes, hi.PCIE_PRACTICAL)
        if est is None:
            raise ValueError(f"{spec.name}: gpu.pcie_gen {gen} is unknown; give gpu.pcie_gbps")
        pcie = InputValue(
            "pcie_gbps", est, f"estimated: PCIe {gen}.0 x{lanes} at 80 % of line rate"
        )
    vram = g.vram_budget_mib or g.vram_free_mib
    return [
        pcie,
        _fig("vram_gbps", g.vram_gbps),
        _fig("gpu_fp16_tflops", g.fp16_tflops),
        *([_fig("prefill_chunk_ms", g.prefill_chunk_ms)] if g.prefill_chunk_ms else []),
        *([_fig("prefill_token_us", g.prefill_token_us)] if g.prefill_token_us else []),
        _fig("vram_plan_mib", vram),
        _fig("cores", spec.cpu.cores),
        InputValue("lane_isa", spec.cpu.lane_isa, spec.cpu.lane_isa_source),
        _fig("dram_read_gbps", spec.memory.dram_read_gbps),
        *([_fig("dram_channels", spec.memory.dram_channels)] if spec.memory.dram_channels else []),
        _fig("ram_gib", spec.memory.ram_gib),
        _fig("store_gbps", spec.disk.read_gbps),
    ]


def _budget(spec: HostSpec) -> int:
    """RAM to plan with on an idle host: all of it less the doctor's headroom (the larger of
    4 GiB and 10 %, inputs.memory_budget)."""
    total = int(spec.memory.ram_gib.value * GIB)
    return max(0, total - max(4 * GIB, total // 10))


def _mode_inputs(spec: HostSpec, mode: Mode, shared: dict, budget: int, geo: Geometry):
    """(CostInputs fields, the mode's own Inputs, host RAM it needs)."""
    g = spec.gpu
    cap = int(g.ec_max_slots.value) if g.ec_max_slots else None
    slots = vram_slots(int(shared["vram_plan_mib"]), mode, max_slots=cap, geo=geo)
    why = "free VRAM (or the planned budget) - model - reserve"
    if cap is not None:
        why += f", at most --ec-max-slots {cap} ({g.ec_max_slots.source})"
    fields = {
        "vram_slots": slots,
        "pcie_gbps": float(shared["pcie_gbps"]),
        "vram_gbps": float(shared["vram_gbps"]),
        "gpu_fp16_tflops": float(shared["gpu_fp16_tflops"]),
    }
    for name in ("prefill_chunk_ms", "prefill_token_us"):  # measured all-VRAM prefill, if any
        if name in shared:
            fields[name] = float(shared[name])
    own = [InputValue("vram_slots", slots, why)]
    ram = all_ram_bytes()
    if mode in LANE_MODES:
        threads = int(shared["cores"]) - RESERVED_CORES
        a, b = lane_ms(threads, float(shared["dram_read_gbps"]), spec.cpu.lane_isa)
        src = (
            f"lane_model: {threads} threads ({RESERVED_CORES} cores kept), "
            f"{spec.cpu.lane_isa}, fitted on {FIT_SOURCE}"
        )
        fields |= {"lane_a_ms": a, "lane_b_ms": b}
        own += [
            InputValue("lane_a_ms", round(a, 4), src),
            InputValue("lane_b_ms", round(b, 4), src),
        ]
    if mode in STORE_MODES:
        cap_fig = spec.nvme_ram_cap_gib
        cap_gib = cap_fig.value if cap_fig else SEED_NVME_CAP_GIB
        cap_src = cap_fig.source if cap_fig else "the seed's shipped nvme cap (seed §6.5)"
        cap_bytes = min(int(cap_gib * GIB), budget)
        tier = min(ram_tier_slots(cap_bytes), geo.total_experts - slots)
        latency = spec.disk.latency_ms
        fields |= {
            "ram_tier_slots": tier,
            "store_gbps": float(shared["store_gbps"]),
            "store_latency_ms": latency.value if latency else SEED_STORE_LATENCY_MS,
        }
        own += [
            InputValue("ram_tier_slots", tier, f"--ram-cap {cap_bytes / GIB:.1f} GiB: {cap_src}"),
            InputValue(
                "store_latency_ms",
                fields["store_latency_ms"],
                latency.source if latency else "assumed: the seed's, under load (seed §4.3)",
            ),
        ]
        ram = nvme_process_bytes(tier)
    return fields, own, ram


def outlook(spec: HostSpec, geo: Geometry = GLM53_FLASH) -> HostOutlook:
    """Every mode's prediction on the described host."""
    shared_inputs = _shared(spec)
    shared = {i.name: i.value for i in shared_inputs}
    budget = _budget(spec)
    rows = []
    for mode in Mode:
        fields, own, ram = _mode_inputs(spec, mode, shared, budget, geo)
        x = CostInputs(**fields)
        c1 = 1000 / decode_ms(mode, x, geo, 1)
        c4 = 4000 / decode_ms(mode, x, geo, 4)
        prefill = [
            predict_prefill(x, geo, PREFILL_TOKENS, chunk).chunk_major_tok_s
            for chunk in PREFILL_CHUNKS
        ]
        rows.append(
            ModeRow(
                mode=mode,
                decode_c1_tok_s=round(c1, 2),
                decode_c4_aggregate_tok_s=round(c4, 2),
                prefill_8k_tok_s=prefill[0],
                prefill_8k_one_chunk_tok_s=prefill[1],
                host_ram_bytes=ram,
                fits=ram <= budget,
                vram_slots=fields["vram_slots"],
                inputs=own,
            )
        )
    measured = {mode: msgspec.structs.asdict(m) for mode, m in sorted(spec.measured.items())}
    return HostOutlook(
        host=spec.name,
        description=spec.description,
        geometry=geo.name,
        budget_bytes=budget,
        inputs=shared_inputs,
        rows=rows,
        measured=measured,
    )


def _num(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}"


def render_text(o: HostOutlook) -> str:
    """Plain text: the inputs with their sources, then every mode (predicted) and what was
    measured on this host."""
    lines = [f"host {o.host}: {o.description}", f"model: {o.geometry} (predicted, not measured)"]
    lines.append("inputs:")
    lines += [f"  {i.name} = {i.value}  [{i.source}]" for i in o.inputs]
    lines.append(f"  RAM budget = {o.budget_bytes / GIB:.1f} GiB  [ram_gib less max(4 GiB, 10 %)]")
    lines.append(
        "mode         decode c1   c4 aggregate   prefill 8k (2k chunks / one chunk)   host RAM  fits"
    )
    for r in o.rows:
        lines.append(
            f"{r.mode:<12} {_num(r.decode_c1_tok_s, 2):>9}   {_num(r.decode_c4_aggregate_tok_s, 2):>12}"
            f"   {_num(r.prefill_8k_tok_s, 0):>10} / {_num(r.prefill_8k_one_chunk_tok_s, 0):<22}"
            f"   {r.host_ram_bytes / GIB:6.1f} GiB  {'yes' if r.fits else 'no'}"
        )
    for r in o.rows:
        lines.append(f"{r.mode} inputs:")
        lines += [f"  {i.name} = {i.value}  [{i.source}]" for i in r.inputs]
    for mode, m in o.measured.items():
        row = next(r for r in o.rows if r.mode == mode)
        parts = []
        for key, pred in (
            ("decode_c1_tok_s", row.decode_c1_tok_s),
            ("decode_c4_aggregate_tok_s", row.decode_c4_aggregate_tok_s),
            ("prefill_8k_tok_s", row.prefill_8k_one_chunk_tok_s),
        ):
            if m.get(key) is not None:
                parts.append(f"{key} {m[key]} (predicted {_num(pred)}, ratio {m[key] / pred:.2f})")
        lines.append(f"measured {mode}: {'; '.join(parts)}  [{m['source']}]")
    lines.append(f"note: {o.caveat}")
    return "\n".join(lines) + "\n"


MARKDOWN_HEADER = (
    "| host | mode | decode c1 | decode c4 aggregate | prefill 8k, 2k chunks | "
    "prefill 8k, one chunk | host RAM fits | seed measured c1 / c4 / prefill 8k |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


def render_markdown(outlooks: list[HostOutlook]) -> str:
    """One table of every host and mode, predicted figures beside the measured ones (tok/s)."""
    out = [MARKDOWN_HEADER]
    for o in outlooks:
        for r in o.rows:
            m = o.measured.get(str(r.mode))
            seen = "-"
            if m:
                seen = " / ".join(
                    _num(m.get(k), 2 if k.startswith("decode") else 0)
                    for k in ("decode_c1_tok_s", "decode_c4_aggregate_tok_s", "prefill_8k_tok_s")
                )
            out.append(
                f"| {o.host} | {r.mode} | {_num(r.decode_c1_tok_s)} | "
                f"{_num(r.decode_c4_aggregate_tok_s)} | {_num(r.prefill_8k_tok_s, 0)} | "
                f"{_num(r.prefill_8k_one_chunk_tok_s, 0)} | "
                f"{'yes' if r.fits else 'no'} ({r.host_ram_bytes / GIB:.0f} GiB) | {seen} |\n"
            )
    return "".join(out)
