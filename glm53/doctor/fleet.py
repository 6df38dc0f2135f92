"""`glm53 doctor --per-gpu`: one plan per GPU, for a host that runs one glm53 instance per GPU
(packaging/systemd/glm53@.service, the NixOS module's `instances`), and a warning when the
instances' pinned RAM does not fit in the host's memory budget together.

Each instance gets its own share of the CPU lane's CPUs: the GPUs are grouped by the NUMA node
sysfs gives for them, and the lane CPUs of each group's node (those of a single-GPU plan for its
first GPU) are split into contiguous, equal runs, one per GPU of the group in index order. GPUs
whose node sysfs does not tell form one group on node 0; give those instances CPUs of their
GPU's node (`nvidia-smi topo -m`) with --cpus.
"""

from __future__ import annotations

import msgspec

from glm53.doctor.host import HostProbe
from glm53.doctor.plan import Plan, PlanRequest, make_plan
from glm53.units import GIB

FIRST_PORT = 31000  # glm53@N.service listens on 31000 + N


class GpuPlan(msgspec.Struct):
    gpu_index: int
    unit: str  # the systemd instance that serves this GPU
    port: int
    plan: Plan
    pinned_bytes: int  # host RAM the planned mode keeps (0 for a demo-only plan)


class FleetPlan(msgspec.Struct):
    plans: list[GpuPlan]
    pinned_bytes: int  # all instances together
    budget_bytes: int | None  # the host's memory budget (the same for every plan)
    warning: str | None


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    size, extra = divmod(len(cpus), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(cpus[at : at + n])
        at += n
    return out


def _pinned(plan: Plan) -> int:
    chosen = next((o for o in plan.options if o.mode == plan.mode), None)
    return (chosen.host_ram_bytes or 0) if chosen else 0


def plan_per_gpu(host: HostProbe, req: PlanRequest) -> FleetPlan:
    """One plan per GPU of `host` (each with its share of the lane CPUs), and whether the
    instances' pinned RAM fits the host's memory budget together."""
    gpus = sorted(host.gpus or [], key=lambda g: g.index)
    if not gpus:
        raise ValueError("--per-gpu: this host has no NVIDIA GPU to plan an instance for")
    whole = make_plan(host, msgspec.structs.replace(req, gpu_index=gpus[0].index))
    groups: dict[int | None, list] = {}
    for gpu in gpus:
        groups.setdefault(None if req.cpus else gpu.numa_node, []).append(gpu)
    share_of = {}
    for group in groups.values():
        first = make_plan(host, msgspec.structs.replace(req, gpu_index=group[0].index))
        lane_cpus = req.cpus or first.lane_cpus
        for gpu, cpus in zip(group, _split(lane_cpus, len(group)), strict=True):
            if not cpus:
                raise ValueError(
                    f"--per-gpu: {len(lane_cpus)} lane CPUs cannot be shared by {len(group)} "
                    "instances; list more with --cpus"
                )
            share_of[gpu.index] = cpus
    plans = []
    for gpu in gpus:
        cpus = share_of[gpu.index]
        plan = make_plan(host, msgspec.structs.replace(req, gpu_index=gpu.index, cpus=cpus))
        plans.append(
            GpuPlan(gpu.index, f"glm53@{gpu.index}", FIRST_PORT + gpu.index, plan, _pinned(plan))
        )
    pinned = sum(p.pinned_bytes for p in plans)
    budget = whole.budget_bytes
    warning = None
    if budget is not None and pinned > budget:
        modes = ", ".join(f"GPU {p.gpu_index} {p.plan.mode}" for p in plans)
        warning = (
            f"the {len(plans)} instances ({modes}) pin {pinned / GIB:.1f} GiB of RAM together, "
            f"but this host has {budget / GIB:.1f} GiB for them: run fewer instances, or nvme "
            "modes with a --ram-cap that makes their sum fit"
        )
    return FleetPlan(plans, pinned, budget, warning)
