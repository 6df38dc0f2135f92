"""Runs every probe of the doctor, each bounded by a timeout: a probe that fails or hangs is
reported as unavailable with its reason, never silently skipped and never blocking."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from glm53.doctor import measure
from glm53.doctor.cpu import probe_cpu
from glm53.doctor.gpu import probe_gpus
from glm53.doctor.host import HostProbe, Measured, Versions
from glm53.doctor.inputs import choose_gpu, lane_cpus
from glm53.doctor.memory import probe_memory
from glm53.doctor.source import FixtureSource, LiveSource, Source, Unavailable, bounded
from glm53.doctor.storage import probe_storage

HERE = Path(__file__).parent
PROBE_TIMEOUT_S = 30.0
MEASURE_TIMEOUT_S = 120.0


def probe_versions(source: Source) -> Versions:
    text = source.run("versions", [sys.executable, "-P", str(HERE / "versions_dump.py")])
    return msgspec.json.decode(text, type=Versions)


def _attempt(name: str, fn: Callable, timeout_s: float, unavailable: dict[str, str]):
    try:
        return bounded(fn, timeout_s, name)
    except (Unavailable, OSError, ValueError, KeyError, msgspec.DecodeError) as e:
        unavailable[name] = str(e) or type(e).__name__
        return None


def _measure(
    source: LiveSource, host: HostProbe, store: str | None, lane: list[int], timeout_s: float
) -> Measured:
    m = Measured(notes={})
    threads = host.cpu.physical_cores if host.cpu else os.cpu_count() or 1
    try:
        m.dram_gbps = round(bounded(lambda: measure.dram_gbps(threads), timeout_s, "dram"), 1)
    except (Unavailable, MemoryError) as e:
        m.notes["dram"] = f"unavailable: {e}"
    if host.gpus:
        gpu = max(host.gpus, key=lambda g: g.memory_free_mib)
        argv = [sys.executable, "-P", str(HERE / "pcie_probe.py"), str(gpu.index)]
        try:
            text = source.run("pcie", argv)
            m.pcie_h2d_gbps = float(msgspec.json.decode(text)["pcie_h2d_gbps"])
        except (Unavailable, KeyError, msgspec.DecodeError) as e:
            m.notes["pcie"] = f"unavailable: {e}"
    else:
        m.notes["pcie"] = "unavailable: no GPU"
    if lane:
        try:
            m.lane = bounded(lambda: measure.lane_calibration(lane), timeout_s, "lane")
        except Unavailable as e:
            m.notes["lane"] = (
                str(e) if str(e).startswith("not calibrated") else f"not calibrated: {e}"
            )
        except (OSError, ValueError, RuntimeError) as e:
            m.notes["lane"] = f"not calibrated: {type(e).__name__}: {e}"
    else:
        m.notes["lane"] = "not calibrated: no CPU left for the lane"
    if store is None:
        m.notes["store"] = "not measured: pass --store DIR"
        m.notes["odirect"] = "not checked: pass --store DIR"
        return m
    try:
        bounded(lambda: measure.odirect_probe(store), timeout_s, "odirect")
        m.odirect_ok = True
    except Unavailable as e:
        m.notes["odirect"] = f"unavailable: {e}"
    except OSError as e:
        m.odirect_ok = False
        m.notes["odirect"] = str(e)
    if m.odirect_ok is False:
        m.notes["store"] = "not measured: O_DIRECT refused"
        return m
    try:
        m.store = bounded(lambda: measure.store_read(store), timeout_s, "store read")
    except (Unavailable, OSError) as e:
        m.notes["store"] = f"unavailable: {e}"
    return m


def probe_host(
    source: Source,
    *,
    measure_host: bool = True,
    store: str | None = None,
    cpus: list[int] | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
    measure_timeout_s: float = MEASURE_TIMEOUT_S,
) -> HostProbe:
    """Every probe of `source`. Micro-measurements run only on a live host with measure_host;
    a captured host carries its own (cmd/measured.json)."""
    unavailable: dict[str, str] = {}
    gpu_answer = _attempt("gpu", lambda: probe_gpus(source), timeout_s, unavailable)
    gpus, gpu_source = gpu_answer if gpu_answer else (None, "")
    host = HostProbe(
        gpus=gpus,
        gpu_source=gpu_source,
        cpu=_attempt("cpu", lambda: probe_cpu(source), timeout_s, unavailable),
        memory=_attempt("memory", lambda: probe_memory(source), timeout_s, unavailable),
        storage=_attempt("storage", lambda: probe_storage(source), timeout_s, unavailable),
        versions=_attempt("versions", lambda: probe_versions(source), timeout_s, unavailable),
        measured=Measured(notes={}),
        unavailable=unavailable,
    )
    if isinstance(source, FixtureSource):
        try:
            text = source.run("measured", ["measured"])
            host.measured = msgspec.json.decode(text, type=Measured)
        except Unavailable:
            host.measured = Measured(notes={"all": "not captured"})
    elif isinstance(source, LiveSource) and measure_host:
        lane: list[int] = []
        if host.cpu is not None:
            try:
                lane = lane_cpus(host.cpu, cpus, choose_gpu(host.gpus or [], None))
            except ValueError:
                lane = []  # the plan reports the bad --cpus
        host.measured = _measure(source, host, store, lane, measure_timeout_s)
        source.recorded["cmd/measured.txt"] = msgspec.json.encode(host.measured).decode()
    else:
        host.measured = Measured(notes={"all": "not measured (--no-measure)"})
    return host
