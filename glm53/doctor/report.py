"""The doctor's output: one JSON document (`--json`) or rich tables that end with the commands
to run."""

from __future__ import annotations

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from glm53.doctor.checks import Check, Verdict
from glm53.doctor.cpu import format_cpu_list
from glm53.doctor.host import HostProbe
from glm53.doctor.inputs import LaneLayout, spots
from glm53.doctor.multi_gpu import MultiGpuOutlook
from glm53.doctor.plan import ModeOption, Plan
from glm53.units import GIB

VERDICT_STYLE = {Verdict.OK: "green", Verdict.WARN: "yellow", Verdict.FAIL: "bold red"}


class DoctorReport(msgspec.Struct):
    host: HostProbe
    checks: list[Check]
    plan: Plan


def to_json(report: DoctorReport) -> str:
    return msgspec.json.format(msgspec.json.encode(report).decode(), indent=2)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


def _row(table: Table, *cells) -> None:
    """A row of probed text: never read as rich markup (a process may be named "[x]")."""
    table.add_row(*(escape(str(c)) for c in cells))


def _host_tables(host: HostProbe) -> list[Table]:
    tables = []
    caption = (
        None if host.gpus else (host.gpu_source or f"unavailable: {host.unavailable.get('gpu')}")
    )
    t = Table(title="GPUs", title_justify="left", caption=caption, caption_justify="left")
    for col in (
        "#",
        "name",
        "VRAM free / total",
        "driver (CUDA)",
        "cc",
        "PCIe now / max",
        "other work",
    ):
        t.add_column(col)
    for g in host.gpus or []:
        procs = ", ".join(
            f"{p.name} ({p.kind[0].upper()}, {p.used_mib or '?'} MiB)" for p in g.processes
        )
        _row(
            t,
            str(g.index),
            g.name,
            f"{g.memory_free_mib:,} / {g.memory_total_mib:,} MiB",
            f"{g.driver_version} ({g.cuda_driver_version or '?'})",
            g.compute_capability or "?",
            f"{g.pcie_gen_current or '?'}.0 x{g.pcie_width_current or '?'} / "
            f"{g.pcie_gen_max or '?'}.0 x{g.pcie_width_max or '?'}",
            procs or "none",
        )
    tables.append(t)
    t = Table(title="CPU and memory", title_justify="left", show_header=False)
    t.add_column()
    t.add_column()
    if host.cpu:
        c = host.cpu
        flags = [n for n, on in msgspec.structs.asdict(c.flags).items() if on]
        _row(t, "CPU", f"{c.model}: {c.sockets} socket(s), {c.physical_cores} cores, "
                  f"{c.logical_cpus} logical, {c.numa_nodes} NUMA node(s)")  # fmt: skip
        _row(t, "flags", " ".join(flags) or "none of interest")
    if host.memory:
        m = host.memory
        _row(t, "RAM", f"{_gib(m.total_bytes)} total, {_gib(m.available_bytes)} available")
        swap = ", ".join(s.name for s in m.swap_devices) or "none"
        _row(t, "swap", f"{_gib(m.swap_total_bytes)} ({swap})")
        cg = _gib(m.cgroup_max_bytes) if m.cgroup_limited else "no limit"
        _row(t, "cgroup", f"v{m.cgroup_version} {m.cgroup_path}: memory.max {cg}" if m.cgroup_version else "none")  # fmt: skip
        _row(t, "memlock", "unlimited" if m.memlock_unlimited else f"{(m.memlock_bytes or 0) // 1024} KiB")  # fmt: skip
    tables.append(t)
    if host.storage:
        t = Table(title="Filesystems", title_justify="left")
        for col in ("mount", "fs", "disks", "free", "NVMe", "read est."):
            t.add_column(col)
        for s in spots(host.storage):
            est = f"{s.read_gbps_estimate:.1f} GB/s" if s.read_gbps_estimate else "-"
            _row(t, s.target, s.fstype, ",".join(s.disks) or "?", f"{s.free_bytes / 1e9:.1f} GB",
                      "yes" if s.nvme_only else "no", est)  # fmt: skip
        tables.append(t)
        if host.storage.nvme or host.storage.md:
            t = Table(title="NVMe and RAID", title_justify="left", show_header=False)
            t.add_column()
            t.add_column()
            for n in host.storage.nvme:
                _row(t, f"{n.name} ({','.join(n.namespaces)})",
                          f"{n.model}: {n.link_speed_current} x{n.link_width_current} "
                          f"(max {n.link_speed_max} x{n.link_width_max})")  # fmt: skip
            for a in host.storage.md:
                _row(
                    t,
                    a.name,
                    f"{a.state} {a.level} chunk {a.chunk_kib or '?'}k: {' '.join(a.members)}",
                )
            tables.append(t)
    t = Table(title="Software and measurements", title_justify="left", show_header=False)
    t.add_column()
    t.add_column()
    if host.versions:
        v = host.versions
        _row(t, "python / torch", f"{v.python} / {v.torch or 'not installed'} (CUDA {v.torch_cuda or 'none: CPU build'})")  # fmt: skip
        _row(t, "exllamav3 / hf_hub / nvml", f"{v.exllamav3 or '-'} / {v.huggingface_hub or '-'} / {v.nvidia_ml_py or '-'}")  # fmt: skip
    me = host.measured
    _row(
        t,
        "DRAM copy",
        f"{me.dram_gbps} GB/s" if me.dram_gbps else me.notes.get("dram", me.notes.get("all", "-")),
    )
    _row(
        t,
        "PCIe upload",
        f"{me.pcie_h2d_gbps} GB/s"
        if me.pcie_h2d_gbps
        else me.notes.get("pcie", me.notes.get("all", "-")),
    )
    _row(t, "CPU lane", f"a {me.lane.a_ms} ms + b {me.lane.b_ms} ms/expert at {me.lane.threads} threads"
              if me.lane else me.notes.get("lane", me.notes.get("all", "-")))  # fmt: skip
    _row(t, "store read", f"{me.store.read_gbps} GB/s, {me.store.record_latency_ms} ms/record"
              if me.store else me.notes.get("store", me.notes.get("all", "-")))  # fmt: skip
    tables.append(t)
    return tables


def _prefill_table(option: ModeOption) -> Table:
    """Prefill per prompt length: the default chunk-major path beside layer-major, which is
    labelled with its status (LAYER_MAJOR_STATUS) wherever it appears."""
    outlook = option.prefill
    t = Table(
        title=f"Prefill of {option.mode} by prompt length (predicted tok/s, "
        f"{outlook.chunk_tokens:,}-token chunks)",
        title_justify="left",
        caption=f"* layer-major: {outlook.layer_major}. touched: experts of a layer a chunk / "
        "the prompt touches; 1-pass: every touched expert crosses PCIe once; GPU: compute "
        "alone; states: layer-major's hidden states and where they live.",
        caption_justify="left",
    )
    for col in ("prompt", "touched", "chunk-major", "layer-major*", "1-pass", "GPU", "states"):
        t.add_column(col)
    for r in outlook.rows:
        states = "-" if not r.states_bytes else f"{r.states_bytes / GIB:.1f}G {r.states_placement}"
        t.add_row(
            f"{r.prompt_tokens:,}",
            f"{r.touched_per_layer_chunk:.0f}/{r.touched_per_layer_prompt:.0f}",
            f"{r.chunk_major_tok_s:,.0f}",
            "-" if r.layer_major_tok_s is None else f"{r.layer_major_tok_s:,.0f}",
            f"{r.stream_once_tok_s:,.0f}",
            f"{r.compute_tok_s:,.0f}",
            states,
        )
    return t


def _lane_table(layout: LaneLayout) -> Table:
    """Where the CPU lane's threads would run (fast and nvme modes), and what it leaves alone."""
    node = "several NUMA nodes" if layout.node is None else f"NUMA node {layout.node}"
    t = Table(title=f"CPU lane layout: {node} ({layout.node_why})", title_justify="left")
    for col in ("CPUs", "use"):
        t.add_column(col)
    if layout.cpus:
        _row(t, format_cpu_list(layout.cpus), f"the lane: {len(layout.cpus)} threads, one pinned "
                                              "to each, one per physical core")  # fmt: skip
    else:
        _row(t, "-", "the lane: no core left for it")
    for r in layout.reserved:
        _row(t, str(r.cpu), f"left out for {r.kept_for}")
    for o in layout.left_out:
        _row(t, format_cpu_list(o.cpus), f"left out: {o.why}")
    return t


def _multi_gpu_table(o: MultiGpuOutlook) -> Table:
    """The layer split per GPU (serve --gpus) and its predicted decode, labelled a prediction."""
    gpus = ",".join(map(str, o.gpus))
    if o.split is None:
        t = Table(title=f"Layer split over GPUs {gpus} ({o.chosen_by}): none", title_justify="left")
        t.add_column("why")
        _row(t, o.reason)
        return t
    s = o.split
    caption = (
        f"{o.label}. Exact mode at {s.total_slots:,} slots in all ({s.total_slots / s.total_experts:.1%} "
        f"of {s.total_experts:,} experts): {o.decode_tok_s} tok/s decode, c1, with "
        f"{s.boundaries} hop(s) of {s.hop_bytes_per_token // 1024} KiB per token "
        f"({o.hop_ms_per_token} ms); one GPU with the same cache {o.same_cache_decode_tok_s} "
        f"tok/s (ratio {o.two_gpu_vs_one_gpu_same_cache}); GPU {o.gpus[0]} alone "
        f"{o.one_gpu_slots if o.one_gpu_slots is not None else '-'} slots, "
        f"{o.one_gpu_decode_tok_s if o.one_gpu_decode_tok_s is not None else '-'} tok/s. "
        f"VRAM planned at {o.settings}."
    )
    t = Table(title=f"Layer split over GPUs {gpus} ({o.chosen_by}; serve --gpus {gpus})",
              title_justify="left", caption=caption, caption_justify="left")  # fmt: skip
    for col in ("entry", "GPU", "layers", "MoE layers", "non-expert", "KV + state", "staging",
                "cache slots", "share of its experts"):  # fmt: skip
        t.add_column(col)
    for p in s.parts:
        _row(t, p.entry, p.device, f"{p.first_layer}-{p.end_layer - 1}", len(p.moe_layers),
             _gib(p.weight_bytes), _gib(p.kv_bytes + p.state_bytes), _gib(p.stage_bytes),
             f"{p.cache_slots:,}", f"{p.expert_share:.1%}")  # fmt: skip
    return t


def _plan_tables(plan: Plan) -> list:
    out: list = []
    t = Table(title="Modes (predicted, concurrency 1)", title_justify="left")
    for col in (
        "mode",
        "decode tok/s",
        "prefill tok/s",
        "host RAM",
        "picks VRAM/RAM/store",
        "CPU experts/layer",
        "why not",
    ):
        t.add_column(col)
    for o in plan.options:
        p = o.prediction
        mark = " *" if o.mode == plan.mode else (" (not yet run)" if o.mode == plan.planned else "")
        t.add_row(
            f"{o.mode}{mark}",
            f"{p.decode_tok_s:.1f}" if p else "-",
            f"{p.prefill_tok_s:.0f}" if p else "-",
            _gib(o.host_ram_bytes) if o.host_ram_bytes else "-",
            f"{p.vram_share:.0%} / {p.ram_share:.0%} / {p.store_share:.0%}" if p else "-",
            f"{p.cpu_experts_per_layer:.1f}" if p else "-",
            escape(o.reason),
        )
    out.append(t)
    chosen = next((o for o in plan.options if o.mode == plan.mode), None)
    if chosen and chosen.prediction:
        p = chosen.prediction
        t = Table(title=f"Cost model inputs for {chosen.mode}: {p.ms_per_token:.1f} ms/token = "
                  f"{p.non_moe_ms:.1f} non-MoE + {p.moe_ms:.1f} in 42 MoE layers", title_justify="left")  # fmt: skip
        for col in ("input", "value", "from"):
            t.add_column(col)
        for v in chosen.inputs:
            t.add_row(v.name, str(v.value), escape(v.source))
        out.append(t)
    if chosen and chosen.prefill:
        out.append(_prefill_table(chosen))
    swept = chosen if chosen and chosen.caps else None
    swept = swept or next((o for o in plan.options if o.caps), None)
    if swept:
        t = Table(
            title=f"{swept.mode} at each --ram-cap (predicted, concurrency 1)", title_justify="left"
        )
        for col in ("--ram-cap", "RAM tier", "process RAM", "decode tok/s", "prefill tok/s",
                    "picks RAM/store", "fits"):  # fmt: skip
            t.add_column(col)
        for cap in swept.caps:
            t.add_row(
                _gib(cap.ram_cap_bytes),
                f"{cap.ram_tier_slots} experts",
                _gib(cap.process_bytes),
                f"{cap.decode_tok_s:.1f}",
                f"{cap.prefill_tok_s:.0f}",
                f"{cap.ram_share:.0%} / {cap.store_share:.0%}",
                "yes" if cap.within_budget else "over the budget",
            )
        out.append(t)
    c = plan.comparison
    if c:
        t = Table(title=f"Predicted vs measured ({c.file}, mode {c.mode})", title_justify="left")
        for col in ("figure", "predicted", "measured"):
            t.add_column(col)
        t.add_row("decode tok/s, C1", str(c.decode_predicted_tok_s), str(c.decode_measured_tok_s))
        t.add_row(
            f"prefill tok/s ({c.prefill_tokens} tokens)",
            str(c.prefill_predicted_tok_s),
            str(c.prefill_measured_tok_s),
        )
        out.append(t)
    if plan.multi_gpu:
        out.append(_multi_gpu_table(plan.multi_gpu))
    if plan.lane_layout:
        out.append(_lane_table(plan.lane_layout))
    for prop in plan.proposals:
        body = f"{escape(prop.why)}\n\n" + "\n".join(f"  {escape(cmd)}" for cmd in prop.commands)
        body += f"\n\n[bold red]WARNING: {escape(prop.warning)}[/bold red]"
        out.append(Panel(body, title=f"Proposal (not run): {prop.title}", title_align="left"))
    return out


def render(report: DoctorReport, console: Console) -> None:
    for table in _host_tables(report.host):
        console.print(table)
    t = Table(title="Checks", title_justify="left")
    for col in ("", "check", "found", "fix"):
        t.add_column(col)
    for c in report.checks:
        t.add_row(
            f"[{VERDICT_STYLE[c.verdict]}]{c.verdict}[/]", c.name, escape(c.detail), escape(c.fix)
        )
    console.print(t)
    for item in _plan_tables(report.plan):
        console.print(item)
    plan = report.plan
    console.print(f"\n[bold]Plan:[/bold] {plan.headline}")
    if plan.exact_alternative:
        alt = next(o for o in plan.options if o.mode == plan.exact_alternative)
        console.print(f"If outputs must be bit-identical to exllamav3: {alt.mode} "
                      f"({alt.prediction.decode_tok_s:.1f} tok/s predicted).")  # fmt: skip
    console.print("[bold]Run:[/bold]")
    for step in plan.steps:
        console.print(f"  {step}", soft_wrap=True, highlight=False, markup=False)
