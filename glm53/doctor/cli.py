"""`glm53 doctor`: probe this host, check it, plan a mode and predict its speed."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import msgspec
from rich.console import Console

from glm53.doctor.checks import Verdict, run_checks
from glm53.doctor.cpu import format_cpu_list, parse_cpu_list
from glm53.doctor.fleet import plan_per_gpu
from glm53.doctor.hostfile import HostFileError, shipped
from glm53.doctor.plan import PlanRequest, make_plan
from glm53.doctor.probes import probe_host
from glm53.doctor.report import DoctorReport, render, to_json
from glm53.doctor.source import FixtureSource, LiveSource
from glm53.plan.split import parse_gpus

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from 123, 512K, 42G, 1.5GiB (binary multiples), as serve's --ram-cap reads them."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(
            f"--ram-cap {text!r} is not a size; write bytes or a number with K, M, G or T"
        )
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="probe this host, check it and plan a mode with predicted speed",
        description="Probes GPUs, CPU, memory, storage and software (each probe bounded by a "
        "timeout), checks them against what glm53 needs, and recommends a mode with its flags "
        "and a predicted decode and prefill speed. Never changes the system: steps that need "
        "root (a RAID0, mkfs) are printed as proposals. Exit status: 0 when every check is ok "
        "or a warning, 1 when a check fails (this host cannot serve GLM-5.3-Flash as it is; "
        "each failed check says how to fix it), 2 on bad arguments.",
    )
    p.add_argument("--json", action="store_true", help="print everything as one JSON document")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="the checkpoint directory, to check it and to plan for its own geometry (layers, "
        "MoE layers, experts per layer, widths, bits); default: plan for GLM-5.3-Flash",
    )
    p.add_argument(
        "--store",
        metavar="DIR",
        help="where the NVMe expert store goes (or is): checks O_DIRECT and measures its read "
        "rate with a temporary 1 GiB probe file",
    )
    p.add_argument(
        "--ram-cap",
        metavar="SIZE",
        help="cap of the RAM expert tier, as serve's --ram-cap (e.g. 42G); default: planned "
        "from available memory",
    )
    p.add_argument("--cpus", metavar="LIST", help="CPUs of the CPU lane, e.g. 2-23")
    p.add_argument("--ec-max-slots", metavar="N", type=int, help="most VRAM expert slots")
    p.add_argument("--gpu", metavar="N", type=int, help="plan for this GPU (nvidia-smi index)")
    p.add_argument(
        "--gpus",
        metavar="LIST",
        help="plan serve's --gpus layer split over these GPUs, e.g. 0,1 (0,0: both halves on "
        "GPU 0); shown per GPU with a predicted decode rate. Default: every GPU when the host "
        "has two or more",
    )
    p.add_argument(
        "--per-gpu",
        action="store_true",
        help="one plan per GPU, for one instance per GPU (glm53@N.service), each with its share "
        "of the lane CPUs; warns when their pinned RAM does not fit together",
    )
    p.add_argument(
        "--compare",
        metavar="FILE",
        help="a bench/sweep.py --json result to set beside the prediction",
    )
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip the micro-measurements (DRAM, PCIe, CPU lane, store read)",
    )
    p.add_argument("--timeout", metavar="S", type=float, default=30.0, help="per probe (seconds)")
    p.add_argument("--capture", metavar="DIR", help="also save the raw probe outputs under DIR")
    p.add_argument(
        "--replay",
        metavar="DIR",
        help="plan from outputs saved with --capture instead of this host",
    )
    p.add_argument(
        "--host",
        metavar="FILE",
        action="append",
        help="predict for a host described in a TOML file (or a shipped one by name: "
        f"{', '.join(shipped())}) instead of probing this one; may be given more than once",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --host: print one markdown table of every host and mode (docs/performance.md)",
    )
    p.set_defaults(func=run)


def _request(args) -> PlanRequest:
    return PlanRequest(
        model_dir=os.path.abspath(args.model) if args.model else None,
        store=os.path.abspath(args.store) if args.store else None,
        ram_cap_bytes=parse_size(args.ram_cap) if args.ram_cap else None,
        cpus=parse_cpu_list(args.cpus) if args.cpus else None,
        ec_max_slots=args.ec_max_slots,
        gpu_index=args.gpu,
        compare=args.compare,
        gpus=list(parse_gpus(args.gpus)) if args.gpus else None,
    )


def run(args) -> int:
    err = Console(stderr=True)
    if args.host:
        return _run_hosts(args.host, args.json, args.markdown, err)
    try:
        req = _request(args)
    except ValueError as e:
        err.print(f"glm53 doctor: {e}")
        return 2
    if args.replay:
        source = FixtureSource(args.replay)
    else:
        source = LiveSource(timeout_s=args.timeout)
        if not args.json:
            err.print("probing this host (each probe bounded by a timeout) ...")
    host = probe_host(
        source,
        measure_host=not args.no_measure,
        store=req.store,
        cpus=req.cpus,
        timeout_s=args.timeout,
    )
    if args.per_gpu:
        return _run_per_gpu(host, req, args.json, err)
    try:
        plan = make_plan(host, req)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"glm53 doctor: {e}")
        return 2
    report = DoctorReport(host=host, checks=run_checks(host, plan, req), plan=plan)
    if args.capture and isinstance(source, LiveSource):
        written = source.capture_to(Path(args.capture))
        err.print(f"captured {len(written)} probe outputs under {args.capture}")
    if args.json:
        sys.stdout.write(to_json(report) + "\n")
    else:
        render(report, Console(highlight=False))
    failed = [c.name for c in report.checks if c.verdict == Verdict.FAIL]
    if failed:
        err.print(f"glm53 doctor: {len(failed)} check(s) failed: {', '.join(failed)}")
        return 1
    return 0


def _run_per_gpu(host, req: PlanRequest, as_json: bool, err: Console) -> int:
    try:
        fleet = plan_per_gpu(host, req)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"glm53 doctor: {e}")
        return 2
    if as_json:
        sys.stdout.write(msgspec.json.encode({"per_gpu": fleet}).decode() + "\n")
        return 0
    out = Console(highlight=False)
    for gpu_plan in fleet.plans:
        plan = gpu_plan.plan
        out.print(f"GPU {gpu_plan.gpu_index}: {plan.headline}")
        out.print(
            f"  {gpu_plan.unit} on port {gpu_plan.port}, lane CPUs {format_cpu_list(plan.lane_cpus)}"
            f" (GLM53_CT_CPUS in /etc/glm53/{gpu_plan.unit}.env), "
            f"{gpu_plan.pinned_bytes / 2**30:.1f} GiB of RAM pinned"
        )
        for step in plan.steps:
            out.print(f"  $ {step}")
    budget = "unknown" if fleet.budget_bytes is None else f"{fleet.budget_bytes / 2**30:.1f} GiB"
    out.print(f"all instances: {fleet.pinned_bytes / 2**30:.1f} GiB pinned, budget {budget}")
    if fleet.warning:
        out.print(f"WARNING: {fleet.warning}")
    return 0


def _run_hosts(names: list[str], as_json: bool, markdown: bool, err: Console) -> int:
    from glm53.doctor import host_outlook
    from glm53.doctor.hostfile import load

    try:
        outlooks = [host_outlook.outlook(load(name)) for name in names]
    except (HostFileError, ValueError) as e:
        err.print(f"glm53 doctor: {e}", markup=False, highlight=False)
        return 2
    if as_json:
        sys.stdout.write(msgspec.json.encode(outlooks).decode() + "\n")
    elif markdown:
        sys.stdout.write(host_outlook.render_markdown(outlooks))
    else:
        sys.stdout.write("\n".join(host_outlook.render_text(o) for o in outlooks))
    return 0
