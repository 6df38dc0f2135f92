"""The doctor's checks: each a verdict (ok / warn / fail), what was found, and the fix."""

from __future__ import annotations

import json
import os
from enum import StrEnum

import msgspec

from glm53.doctor import inputs as hi
from glm53.doctor.costmodel import (
    CHECKPOINT_BYTES,
    GIB,
    MIN_FREE_VRAM_MIB,
    STORE_MODES,
    CostInputs,
    predict,
    store_total_bytes,
)
from glm53.doctor.host import Gpu, HostProbe
from glm53.doctor.plan import Plan, PlanRequest, store_present
from glm53.exl3.version import EXLLAMAV3_VERSION

# the oldest driver branch that runs each CUDA major version (NVIDIA's compatibility table)
MIN_DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}
MEASURED_ARCH = "8.6"  # the seed measured an RTX 3090 only
GLM53_CUDA_ARCHS = ("8.6", "8.9", "9.0", "12.0")  # DESIGN §7: glm53's CUDA build targets
EXLLAMAV3_PIN = EXLLAMAV3_VERSION
_NETWORK_FS = "network filesystems are slow and do not give O_DIRECT reads from a local drive"
STORE_FILESYSTEMS_BAD = {
    "btrfs": "btrfs (and loop files on it) refuses or fakes O_DIRECT",
    "tmpfs": "tmpfs is RAM: a store there only duplicates RAM",
    "ramfs": "ramfs is RAM: a store there only duplicates RAM",
    "overlay": "overlayfs is a container layer, not a local disk",
    "nfs": _NETWORK_FS,
    "nfs4": _NETWORK_FS,
    "cifs": _NETWORK_FS,
    "smb3": _NETWORK_FS,
    "fuseblk": "FUSE filesystems usually refuse O_DIRECT",
}
STORE_FIX = "put the store on local xfs or ext4 on NVMe (seed guide step 3)"


class Verdict(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


class Check(msgspec.Struct, frozen=True):
    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


def _ok(name: str, detail: str) -> Check:
    return Check(name, Verdict.OK, detail)


def _gpu_checks(host: HostProbe, plan: Plan) -> list[Check]:
    if host.gpus is None:
        why = host.unavailable.get("gpu")
        return [Check("gpu", Verdict.WARN, f"unavailable: {why}", "run `nvidia-smi` by hand")]
    if not host.gpus:
        return [
            Check(
                "gpu",
                Verdict.FAIL,
                f"{host.gpu_source}; the plan is demo only",
                "GLM-5.3-Flash needs one NVIDIA GPU with 24 GB; without one `glm53 serve "
                "--demo` runs the synthetic demo checkpoint on the CPU",
            )
        ]
    gpu = next((g for g in host.gpus if g.index == plan.gpu_index), None)
    gpu = gpu or max(host.gpus, key=lambda g: g.memory_free_mib)
    names = ", ".join(f"{g.index}: {g.name}" for g in host.gpus)
    out = [_ok("gpu", f"{len(host.gpus)} GPU(s) via {host.gpu_source} ({names})")]
    free = gpu.memory_free_mib
    if free >= MIN_FREE_VRAM_MIB:
        out.append(_ok("vram", f"GPU {gpu.index}: {free:,} MiB free of {gpu.memory_total_mib:,}"))
    else:
        out.append(
            Check(
                "vram",
                Verdict.FAIL,
                f"GPU {gpu.index}: {free:,} MiB free, glm53 needs {MIN_FREE_VRAM_MIB:,}",
                "free the GPU's memory (its processes are listed) or pick another with --gpu N",
            )
        )
    if gpu.processes:
        listed = ", ".join(
            f"{p.name} (pid {p.pid}, {p.kind}, {p.used_mib or '?'} MiB)" for p in gpu.processes
        )
        fix = "glm53 never touches them; stop them yourself if you need their VRAM"
        if plan.mode is not None and any("graphics" in p.kind for p in gpu.processes):
            fix += "; the planned command caps the cache with --ec-max-slots for the desktop"
        out.append(Check("gpu-work", Verdict.WARN, f"GPU {gpu.index} is in use: {listed}", fix))
    else:
        out.append(_ok("gpu-work", f"GPU {gpu.index}: no other process on it"))
    busy = [g.index for g in host.gpus if g.index != gpu.index and g.processes]
    if busy:
        out.append(_ok("gpu-work-other", f"GPUs {busy} run other work; glm53 leaves them alone"))
    return out + _link_check(gpu, plan) + _arch_checks(gpu, host)


def _link_check(gpu: Gpu, plan: Plan) -> list[Check]:
    gen, width = gpu.pcie_gen_max, gpu.pcie_width_max
    if gen is None or width is None:
        return [Check("pcie-link", Verdict.WARN, "link unknown", "check `lspci -vv` (LnkSta)")]
    seen = f"PCIe {gen}.0 x{width}"
    if gpu.pcie_gen_current is not None and gpu.pcie_gen_current < gen:
        seen += f" (gen {gpu.pcie_gen_current} now: an idle GPU slows its link to save power)"
    if gen >= 4 and width >= 16:
        return [_ok("pcie-link", seen)]
    cost = ""
    option = next((o for o in plan.options if o.mode == plan.mode and o.prediction), None)
    if option is not None:
        values = {v.name: v.value for v in option.inputs}
        values["pcie_gbps"] = hi.link_gbps(4, 16, hi.PCIE_PRACTICAL)
        ref = predict(option.mode, CostInputs(**values), plan.geometry).decode_tok_s
        here = option.prediction.decode_tok_s
        cost = (
            f"; expected cost: {here:.1f} instead of {ref:.1f} tok/s decode "
            f"({100 * (1 - here / ref):.0f} % slower than on 4.0 x16)"
        )
    return [
        Check(
            "pcie-link",
            Verdict.WARN,
            f"{seen} is below 4.0 x16: expert copies over PCIe take longer{cost}",
            "an x16 slot wired to the CPU at gen 4 or newer (BIOS: PCIe generation, bifurcation)",
        )
    ]


def _arch_checks(gpu: Gpu, host: HostProbe) -> list[Check]:
    out = []
    cc = gpu.compute_capability
    if cc == MEASURED_ARCH:
        out.append(_ok("gpu-arch", "sm_86, as the seed's measured RTX 3090"))
    elif cc in GLM53_CUDA_ARCHS:
        out.append(
            Check(
                "gpu-arch",
                Verdict.WARN,
                f"compute capability {cc}: glm53 builds for it, but its speed is not measured "
                "(the seed measured sm_86 only)",
                "measure it: bench/sweep.py, then `glm53 doctor --compare RESULT`",
            )
        )
    else:
        out.append(
            Check(
                "gpu-arch",
                Verdict.WARN,
                f"compute capability {cc}: not among glm53's CUDA targets "
                f"{', '.join(GLM53_CUDA_ARCHS)}",
                f"rebuild glm53 with CUDA arch {cc} added",
            )
        )
    v = host.versions
    if v is None:
        why = host.unavailable.get("versions")
        return out + [Check("driver", Verdict.WARN, f"unavailable: {why}", "")]
    if v.torch is None:
        return out + [Check("driver", Verdict.FAIL, "torch is not installed", "pip install torch")]
    if v.torch_cuda is None:
        return out + [
            Check(
                "driver",
                Verdict.FAIL,
                f"torch {v.torch} is a CPU build: the GPU engine cannot run",
                "install a CUDA build of torch (CUDA 13 builds need driver >= 580)",
            )
        ]
    major = int(v.torch_cuda.split(".")[0])
    need = MIN_DRIVER_FOR_CUDA.get(major)
    head = gpu.driver_version.split(".")[0]
    have = int(head) if head.isdigit() else None
    if need is None or have is None:
        out.append(
            Check(
                "driver",
                Verdict.WARN,
                f"driver {gpu.driver_version}, torch CUDA {v.torch_cuda}: compatibility unknown",
                "",
            )
        )
    elif have < need:
        out.append(
            Check(
                "driver",
                Verdict.FAIL,
                f"driver {gpu.driver_version} is too old for torch's CUDA {v.torch_cuda} "
                f"(needs >= {need})",
                f"update the NVIDIA driver to {need} or newer, or use a torch built for an "
                "older CUDA",
            )
        )
    else:
        out.append(_ok("driver", f"driver {gpu.driver_version} runs torch's CUDA {v.torch_cuda}"))
    if cc and v.torch_arch_list and not torch_runs_on(v.torch_arch_list, cc):
        out.append(
            Check(
                "torch-arch",
                Verdict.FAIL,
                f"torch {v.torch} has no kernels that run on compute capability {cc} "
                f"({' '.join(v.torch_arch_list)})",
                f"install a torch build whose arch list covers sm_{cc.replace('.', '')}",
            )
        )
    if v.exllamav3 != EXLLAMAV3_PIN:
        found = f"exllamav3 {v.exllamav3}" if v.exllamav3 else "exllamav3 is not installed"
        out.append(
            Check(
                "exllamav3",
                Verdict.FAIL,
                f"{found}; the GPU engine is pinned to {EXLLAMAV3_PIN}",
                "pip install 'glm53[gpu]'",
            )
        )
    else:
        out.append(_ok("exllamav3", f"exllamav3 {v.exllamav3}"))
    return out


def torch_runs_on(arch_list: list[str], cc: str) -> bool:
    """True when a torch built for arch_list has code for a GPU of compute capability cc: a
    cubin for sm_XY runs on X.Z for Z >= Y (same major), PTX compute_XY is JIT-compiled for any
    newer GPU."""
    major, minor = (int(x) for x in cc.split("."))
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        if not digits.isdigit():
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def _cpu_checks(host: HostProbe, plan: Plan) -> list[Check]:
    cpu = host.cpu
    if cpu is None:
        return [Check("cpu-lane", Verdict.WARN, f"unavailable: {host.unavailable.get('cpu')}")]
    simd = hi.lane_simd(cpu)
    extras = [n for n, on in (("VNNI", cpu.flags.avx512_vnni), ("AMX", cpu.flags.amx_tile)) if on]
    shape = (
        f"{cpu.model}: {cpu.physical_cores} cores, {cpu.logical_cpus} logical CPUs, "
        f"{cpu.numa_nodes} NUMA node(s)"
    )
    vector = f"{simd}{' + ' + ', '.join(extras) if extras else ''}"
    lane = plan.lane_cpus
    out = []
    if simd is None:
        out.append(
            Check(
                "cpu-lane",
                Verdict.WARN,
                f"{shape}; no AVX2/FMA/F16C: the CPU lane would only have its slow scalar path",
                "use exact or nvme-exact (no CPU lane)",
            )
        )
    elif not lane:
        out.append(
            Check(
                "cpu-lane",
                Verdict.WARN,
                f"{shape}; {vector}; no core left for the CPU lane after the first two "
                "(the OS and the controller)",
                "use exact or nvme-exact, or name the lane's CPUs with --cpus",
            )
        )
    elif len(lane) < 12:
        out.append(
            Check(
                "cpu-lane",
                Verdict.WARN,
                f"{shape}; {vector}; {len(lane)} lane threads: the seed found the lane pays "
                "off from about 12 cores",
                "compare nvme with nvme-exact (or fast with exact) using bench/sweep.py",
            )
        )
    else:
        out.append(_ok("cpu-lane", f"{shape}; {vector}; lane on {len(lane)} cores"))
    gpu = next((g for g in host.gpus or [] if g.index == plan.gpu_index), None)
    layout = plan.lane_layout
    if cpu.numa_nodes > 1 and gpu and layout and gpu.numa_node is not None:
        if layout.node == gpu.numa_node:
            where = f"the lane is on GPU {gpu.index}'s, node {gpu.numa_node}"
            out.append(_ok("numa", f"{cpu.numa_nodes} NUMA nodes: {where}"))
        else:
            out.append(
                Check(
                    "numa",
                    Verdict.WARN,
                    f"the lane's CPUs are not all on GPU {gpu.index}'s NUMA node "
                    f"{gpu.numa_node}: threads on a far node read experts across the interconnect",
                    f"give --cpus cores of node {gpu.numa_node}, or leave --cpus out",
                )
            )
    elif cpu.numa_nodes > 1:
        out.append(
            Check(
                "numa",
                Verdict.WARN,
                f"{cpu.numa_nodes} NUMA nodes: lane threads on a far node read experts across "
                "the interconnect",
                "give --cpus the cores of the GPU's NUMA node",
            )
        )
    return out


def _memory_checks(host: HostProbe, plan: Plan) -> list[Check]:
    mem = host.memory
    if mem is None:
        return [Check("memory", Verdict.WARN, f"unavailable: {host.unavailable.get('memory')}")]
    out = []
    if mem.memlock_unlimited:
        out.append(_ok("memlock", "ulimit -l is unlimited"))
    else:
        out.append(
            Check(
                "memlock",
                Verdict.WARN,
                f"ulimit -l is {(mem.memlock_bytes or 0) // 1024} KiB: pinning tens of GiB of "
                "experts may fail",
                "run with `ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity; "
                "/etc/security/limits.conf: `* - memlock unlimited`)",
            )
        )
    swaps = ", ".join(f"{s.name}{' (zram)' if s.is_zram else ''}" for s in mem.swap_devices)
    if mem.cgroup_limited and mem.swap_total_bytes and mem.cgroup_swap_max_bytes != 0:
        out.append(
            Check(
                "swap",
                Verdict.WARN,
                f"swap on ({swaps}) and this cgroup may use it: pages can escape the memory cap",
                "set the cgroup's swap limit to 0 (docker: --memory-swap equal to --memory)",
            )
        )
    else:
        out.append(_ok("swap", f"swap: {swaps or 'none'}; the pinned tiers never swap"))
    if plan.budget_bytes is None:
        return out
    budget = f"budget {plan.budget_bytes / GIB:.1f} GiB ({plan.budget_how})"
    for o in plan.options:
        if o.feasible:
            tier = f" (RAM tier {o.ram_tier_bytes / GIB:.1f} GiB)" if o.ram_tier_bytes else ""
            out.append(
                _ok(
                    f"ram-{o.mode}",
                    f"needs {(o.host_ram_bytes or 0) / GIB:.1f} GiB{tier}; {budget}",
                )
            )
        elif "RAM" in o.reason or "ram-cap" in o.reason:
            out.append(
                Check(
                    f"ram-{o.mode}",
                    Verdict.FAIL,
                    o.reason,
                    "free memory, or run an nvme mode, whose RAM tier fits the budget",
                )
            )
    return out


def _store_space(req: PlanRequest, mount) -> Check:
    need = store_total_bytes(3)
    if mount.free_bytes is None or mount.total_bytes is None:
        return Check("store-space", Verdict.WARN, f"free space of {mount.target} unknown")
    left = mount.free_bytes - need
    found = (
        f"{mount.target}: {mount.free_bytes / 1e9:.1f} GB free, the store needs {need / 1e9:.1f} GB"
    )
    if store_present(req.store):
        return _ok(
            "store-space",
            f"{req.store} is not empty: if it holds a packed store, `glm53 store verify` checks "
            f"it; else give an empty directory ({found})",
        )
    if left < 0.1 * mount.total_bytes:
        return Check(
            "store-space",
            Verdict.FAIL,
            f"{found}, and pack keeps 10 % of the filesystem free",
            "free space there, or choose another filesystem",
        )
    return _ok("store-space", found)


def _store_checks(host: HostProbe, plan: Plan, req: PlanRequest) -> list[Check]:
    needed = plan.mode in STORE_MODES
    unneeded = "" if needed else f" (not needed by {plan.mode})"
    if host.storage is None:
        return [Check("store", Verdict.WARN, f"unavailable: {host.unavailable.get('storage')}")]
    if not req.store:
        need = store_total_bytes(3)
        if plan.store_location is None:
            verdict = Verdict.FAIL if needed else Verdict.OK
            found = f"no local xfs/ext4 filesystem on NVMe has {need / 1e9:.1f} GB free{unneeded}"
            return [Check("store", verdict, found, STORE_FIX)]
        return [
            Check(
                "store",
                Verdict.WARN if needed else Verdict.OK,
                f"suggested {plan.store_location}; O_DIRECT unchecked, read rate estimated{unneeded}",
                f"check and measure it: glm53 doctor --store {plan.store_location}",
            )
        ]
    mount = hi.mount_of(host.storage, req.store)
    if mount is None:
        return [Check("store", Verdict.FAIL, f"{req.store}: no mount found", STORE_FIX)]
    bad = STORE_FILESYSTEMS_BAD.get(mount.fstype)
    if bad is None and mount.fstype.startswith("fuse"):
        bad = "FUSE filesystems usually refuse O_DIRECT"
    disks = hi.backing_disks(host.storage, mount)
    on = (
        f"{req.store}: {mount.fstype} on {mount.source} ({', '.join(d.name for d in disks) or '?'})"
    )
    if bad:
        out = [Check("store-fs", Verdict.FAIL, f"{on}: {bad}", STORE_FIX)]
    elif mount.fstype not in hi.STORE_FILESYSTEMS:
        out = [Check("store-fs", Verdict.WARN, f"{on}: filesystem not measured", STORE_FIX)]
    elif not disks or not all(hi.is_nvme(d) for d in disks):
        out = [Check("store-fs", Verdict.WARN, f"{on}: not NVMe: decode waits on it", STORE_FIX)]
    else:
        out = [_ok("store-fs", on)]
    m = host.measured
    if m.odirect_ok is True:
        out.append(_ok("store-odirect", f"O_DIRECT works in {req.store}"))
    elif m.odirect_ok is False:
        out.append(
            Check("store-odirect", Verdict.FAIL, m.notes.get("odirect", "refused"), STORE_FIX)
        )
    else:
        out.append(
            Check(
                "store-odirect",
                Verdict.WARN,
                m.notes.get("odirect", "unavailable"),
                "build glm53's native modules (pip install -e .), then run the doctor again",
            )
        )
    out.append(_store_space(req, mount))
    if m.store is not None:
        fast = m.store.read_gbps >= 5
        out.append(
            Check(
                "store-read",
                Verdict.OK if fast else Verdict.WARN,
                f"O_DIRECT reads {m.store.read_gbps:.1f} GB/s, {m.store.record_latency_ms:.2f} ms "
                "per record with 16 readers",
                "" if fast else "a faster drive, or a RAID0 of NVMe drives (see the proposals)",
            )
        )
    return out


def _model_checks(plan: Plan, req: PlanRequest) -> list[Check]:
    if not req.model_dir:
        where = plan.model_location
        if where is None:
            return [
                Check(
                    "checkpoint",
                    Verdict.FAIL,
                    f"no filesystem has {CHECKPOINT_BYTES / 1e9:.1f} GB free for the checkpoint",
                    "free space on any local disk",
                )
            ]
        return [
            Check(
                "checkpoint",
                Verdict.WARN,
                f"not given (--model); {where} has room for it",
                f"glm53 download --dir {where}",
            )
        ]
    config = os.path.join(req.model_dir, "config.json")
    fetch = f"glm53 download --dir {req.model_dir}"
    if not os.path.isfile(config):
        return [Check("checkpoint", Verdict.FAIL, f"{req.model_dir} has no config.json", fetch)]
    try:
        with open(config) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [Check("checkpoint", Verdict.FAIL, f"{config}: {e}", fetch)]
    if cfg.get("model_type") != "glm5_next":
        return [
            Check(
                "checkpoint",
                Verdict.FAIL,
                f"{config}: model_type {cfg.get('model_type')!r}, expected 'glm5_next'",
                "point --model at the GLM-5.3-Flash EXL3 checkpoint",
            )
        ]
    if not os.path.isfile(os.path.join(req.model_dir, "quantization_config.json")):
        return [
            Check(
                "checkpoint",
                Verdict.FAIL,
                f"{req.model_dir} has no quantization_config.json: not an EXL3 checkpoint",
                fetch,
            )
        ]
    return [_ok("checkpoint", f"{req.model_dir}: glm5_next, EXL3")]


def _probe_checks(host: HostProbe) -> list[Check]:
    out = [
        Check(f"probe-{name}", Verdict.WARN, f"unavailable: {why}")
        for name, why in sorted(host.unavailable.items())
        if name != "gpu"
    ]
    lane_note = host.measured.notes.get("lane")
    if lane_note and host.gpus:
        out.append(
            Check(
                "lane-calibration",
                Verdict.WARN,
                lane_note,
                "the plan uses the seed's lane figures scaled to this host's cores",
            )
        )
    return out


def run_checks(host: HostProbe, plan: Plan, req: PlanRequest) -> list[Check]:
    checks = [*_gpu_checks(host, plan), *_cpu_checks(host, plan), *_memory_checks(host, plan)]
    demo_only = plan.gpu_index is None
    if req.store or not demo_only:
        checks += _store_checks(host, plan, req)
    if req.model_dir or not demo_only:
        checks += _model_checks(plan, req)
    return checks + _probe_checks(host)
