"""Prints every GPU that NVML sees as one JSON list with the fields of
glm53.doctor.host.Gpu. The doctor runs this file by path in a child process with a timeout, so
a wedged driver cannot hang the doctor and its output can be captured like any command's. It
imports nothing from glm53 (importing the package may rebuild native code first)."""

import json
import sys


def _try(fn, *args):
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_name(pid: int) -> str:
    import pynvml

    name = _try(pynvml.nvmlSystemGetProcessName, pid)
    if name:
        return _text(name)
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _processes(handle) -> list:
    import pynvml

    kinds: dict = {}
    used: dict = {}
    for kind, fn in (
        ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
        ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
    ):
        for p in _try(fn, handle) or []:
            kinds.setdefault(p.pid, set()).add(kind)
            mem = p.usedGpuMemory
            used[p.pid] = None if mem is None else mem // 2**20
    return [
        {"pid": pid, "name": _process_name(pid), "kind": "+".join(sorted(k)), "used_mib": used[pid]}
        for pid, k in sorted(kinds.items())
    ]


def dump() -> list:
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda_int = _try(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda = None if cuda_int is None else f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            cc = _try(pynvml.nvmlDeviceGetCudaComputeCapability, h)
            bus_bits = _try(pynvml.nvmlDeviceGetMemoryBusWidth, h)
            mem_mhz = _try(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM)
            pci = _try(pynvml.nvmlDeviceGetPciInfo, h)
            bandwidth = None
            if bus_bits and mem_mhz:
                # NVML's memory clock counts one edge: bytes/s = bus bytes x clock x 2
                bandwidth = round(bus_bits / 8 * mem_mhz * 2 / 1000, 1)
            gpus.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                    "memory_total_mib": mem.total // 2**20,
                    "memory_used_mib": mem.used // 2**20,
                    "memory_free_mib": mem.free // 2**20,
                    "driver_version": driver,
                    "cuda_driver_version": cuda,
                    "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
                    "pcie_gen_current": _try(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                    "pcie_gen_max": _try(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    "pcie_width_current": _try(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                    "pcie_width_max": _try(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                    "memory_bandwidth_gbps": bandwidth,
                    "processes": _processes(h),
                    "source": "nvml",
                    "pci_bus_id": None if pci is None else _text(pci.busId),
                }
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        print("nvidia-ml-py is not installed (pip install nvidia-ml-py)", file=sys.stderr)
        return 3
    try:
        gpus = dump()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        print(f"NVML: {e}", file=sys.stderr)
        return 2
    print(json.dumps(gpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
