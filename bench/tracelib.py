"""Reading a PyTorch profiler trace (torch.profiler's chrome-trace JSON, CUPTI's GPU activity in
it) into where one scenario's time went: pure Python, no torch, so CI tests it on CPU traces and
hand-built ones. bench/gpu_trace.py records the traces on the GPU machine.

A scenario is the host range `record_function(SCENARIO)` wraps (its wall clock). Inside it:

    lead     host time before the scenario's first GPU activity starts
    tail     host time after its last GPU activity ends (sync, sampling, bookkeeping)
    kernel   the union of every kernel's interval, on any stream
    copy     the union of the memcpy intervals, per direction (bytes and the rate over that union)
    overlap  copy time with a kernel running beside it (a stage hidden behind compute)
    idle     GPU span with neither a kernel nor a copy running: the GPU waited for the host
    gaps     the longest idle intervals, each with the kernels around it and the host calls
             (CUDA runtime/driver calls, and the innermost profiler ranges) spanning its middle

`named` picks kernels by a substring of their name (glm53's own: the lane's wait, publish and
select; the expert cache's stage and route) and gives their count and duration spread; a lane
wait kernel's duration is how long the GPU waited for the CPU lane.

Timestamps are the trace's microseconds; every figure here is in milliseconds.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from itertools import pairwise

SCENARIO = "g53_scenario"
STEP = "g53_step"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALL_CATS = ("cuda_runtime", "cuda_driver")
HOST_RANGE_CATS = ("user_annotation", "cpu_op", "python_function")

# glm53's kernels (cuda/lane.cu, cuda/ec.cu, each in an anonymous namespace), by their short
# name (short_name: no namespace, no arguments) -> figure name
NAMED = {
    "wait_kernel": "lane_wait",
    "publish_kernel": "lane_publish",
    "select_kernel": "lane_select",
    "stage_layer_kernel": "cache_stage",
    "stage_kernel": "cache_stage",
    "unstage_kernel": "cache_unstage",
    "route_kernel": "cache_route",
    "copy_kernel": "cache_copy",
    "point_picks_kernel": "nvme_point_picks",
}

Interval = tuple[float, float]


def events(trace: dict) -> list[dict]:
    """The complete ('X') events of a chrome trace, each with ts and dur."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[Interval]) -> list[Interval]:
    """Sorted, merged intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlaps(iv: Interval, merged: list[Interval]) -> bool:
    """Whether `iv` shares time with any interval of `merged` (union's output: sorted,
    disjoint)."""
    i = bisect.bisect_right(merged, (iv[1],)) - 1  # the last one starting before iv ends
    return i >= 0 and merged[i][1] > iv[0] and merged[i][0] < iv[1]


def length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """Total length covered by both interval sets."""
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(e: dict, lo: float, hi: float) -> Interval | None:
    s, t = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
    return (s, t) if t > s else None


def short_name(name: str, width: int = 90) -> str:
    """A kernel's name without its argument list and template noise, at most `width` chars."""
    cut = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    cut = cut.split("(")[0] if "(" in cut and not cut.startswith("Memcpy") else cut
    return cut if len(cut) <= width else cut[: width - 3] + "..."


def copy_direction(e: dict) -> str:
    """'HtoD', 'DtoH', 'DtoD', 'HtoH' or 'other' from a memcpy event's name."""
    for d in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
        if d in e.get("name", ""):
            return d
    return "other"


def scenario_window(evs: list[dict], name: str = SCENARIO) -> Interval | None:
    """The host range named `name` (the last one, if the trace holds several)."""
    found = [e for e in evs if e.get("name") == name and e.get("cat") in HOST_RANGE_CATS]
    if not found:
        return None
    e = max(found, key=lambda e: e["ts"])
    return (e["ts"], e["ts"] + e["dur"])


def spread(values: list[float]) -> dict:
    """count, total, median, p90 and max of durations in ms (values in us)."""
    if not values:
        return {"count": 0, "total_ms": 0.0, "p50_ms": None, "p90_ms": None, "max_ms": None}
    v = sorted(values)
    p90 = v[min(len(v) - 1, int(round(0.9 * (len(v) - 1))))]
    return {
        "count": len(v),
        "total_ms": sum(v) / 1e3,
        "p50_ms": statistics.median(v) / 1e3,
        "p90_ms": p90 / 1e3,
        "max_ms": v[-1] / 1e3,
    }


def host_at(evs: list[dict], t: float, limit: int = 4) -> list[str]:
    """The host calls spanning time t: CUDA runtime/driver calls first, then the innermost
    profiler ranges (shortest first), as 'name' strings, at most `limit`."""
    calls = [
        e for e in evs if e.get("cat") in HOST_CALL_CATS and e["ts"] <= t <= e["ts"] + e["dur"]
    ]
    ranges = [
        e
        for e in evs
        if e.get("cat") in HOST_RANGE_CATS
        and e["ts"] <= t <= e["ts"] + e["dur"]
        and e.get("name") not in (SCENARIO,)
    ]
    ranges.sort(key=lambda e: e["dur"])
    names = [e["name"] for e in calls] + [e["name"] for e in ranges]
    out: list[str] = []
    for n in names:
        if n not in out:
            out.append(n)
    return out[:limit]


def summarize(
    trace: dict, top_gaps: int = 8, top_kernels: int = 12, min_gap_us: float = 20.0
) -> dict:
    """Where the scenario's time went (module doc). Raises ValueError when the trace has no
    SCENARIO range."""
    evs = events(trace)
    window = scenario_window(evs)
    if window is None:
        raise ValueError(f"the trace has no '{SCENARIO}' range: record the scenario inside one")
    lo, hi = window
    wall = hi - lo
    # each GPU event inside the window, with its interval clipped to it
    gpu = [(e, iv) for e in evs if e.get("cat") in GPU_CATS and (iv := clip(e, lo, hi))]
    kernels = [(e, iv) for e, iv in gpu if e["cat"] == "kernel"]
    copies = [(e, iv) for e, iv in gpu if e["cat"] == "gpu_memcpy"]
    k_iv = [iv for _, iv in kernels]
    c_iv = [iv for _, iv in copies]
    all_iv = union([iv for _, iv in gpu])
    out: dict = {"wall_ms": wall / 1e3, "gpu_events": len(gpu)}
    if not all_iv:
        out.update({"lead_ms": wall / 1e3, "tail_ms": 0.0, "gpu_span_ms": 0.0, "kernel_ms": 0.0,
                    "copy_ms": 0.0, "overlap_ms": 0.0, "idle_ms": 0.0, "gaps": [],
                    "copies": {}, "streams": {}, "kernels": [], "named": {}})  # fmt: skip
        return out
    first, last = all_iv[0][0], all_iv[-1][1]
    span = last - first
    busy = length(all_iv)
    idle_iv = [(a[1], b[0]) for a, b in pairwise(all_iv) if b[0] > a[1]]
    out.update(
        {
            "lead_ms": (first - lo) / 1e3,
            "tail_ms": (hi - last) / 1e3,
            "gpu_span_ms": span / 1e3,
            "kernel_ms": length(k_iv) / 1e3,
            "copy_ms": length(c_iv) / 1e3,
            "overlap_ms": intersection(k_iv, c_iv) / 1e3,
            "idle_ms": (span - busy) / 1e3,
        }
    )
    # copies per direction: bytes, time (union), rate over that time
    by_dir: dict[str, list] = defaultdict(list)
    for e, iv in copies:
        by_dir[copy_direction(e)].append((e, iv))
    out["copies"] = {}
    for d, items in sorted(by_dir.items()):
        nbytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e, _ in items)
        t = length([iv for _, iv in items])
        out["copies"][d] = {
            "count": len(items),
            "bytes": nbytes,
            "ms": t / 1e3,
            "gbps": nbytes / (t * 1e3) if t > 0 and nbytes else None,
        }
    streams: dict[str, list] = defaultdict(list)
    for e, iv in gpu:
        streams[str((e.get("args") or {}).get("stream", e.get("tid")))].append(iv)
    out["streams"] = {
        s: {"events": len(iv), "busy_ms": length(iv) / 1e3} for s, iv in sorted(streams.items())
    }
    by_name: dict[str, list[float]] = defaultdict(list)
    beside: dict[str, list[float]] = defaultdict(list)  # launches that a copy overlaps
    named: dict[str, list[float]] = defaultdict(list)
    copy_union = union(c_iv)
    for e, iv in kernels:
        name = short_name(e["name"])
        by_name[name].append(iv[1] - iv[0])
        if overlaps(iv, copy_union):
            beside[name].append(iv[1] - iv[0])
        fig = NAMED.get(name) if "anonymous namespace" in e["name"] else None
        if fig is not None:
            named[fig].append(iv[1] - iv[0])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    kernel_total = sum(sum(v) for v in by_name.values()) or 1.0
    # each kernel's launches that ran while a copy was in flight (on any stream), apart: a
    # kernel slower beside a copy than alone shares something with it (issue 29: exact's
    # prefill MoE kernels for few-token experts ran 2.7-5.8x stock's on an H100)
    out["kernels"] = [
        {"name": n, "count": len(v), "ms": sum(v) / 1e3, "share": sum(v) / kernel_total,
         "beside_copy": {"count": len(beside[n]), "ms": sum(beside[n]) / 1e3}}
        for n, v in ranked[:top_kernels]
    ]  # fmt: skip
    out["named"] = {fig: spread(v) for fig, v in sorted(named.items())}
    # the longest idle gaps, with what ran around them and what the host was doing
    host = [e for e in evs if e.get("cat") in HOST_CALL_CATS + HOST_RANGE_CATS]
    ordered = sorted((e for e, _ in gpu), key=lambda e: e["ts"])
    ends = sorted((e["ts"] + e["dur"], short_name(e["name"], 60)) for e in ordered)
    gaps = sorted((g for g in idle_iv if g[1] - g[0] >= min_gap_us), key=lambda g: g[0] - g[1])
    out["gaps"] = []
    for s, t in gaps[:top_gaps]:
        before = [n for end, n in ends if end <= s + 1e-6]
        after = [short_name(e["name"], 60) for e in ordered if e["ts"] >= t - 1e-6]
        out["gaps"].append(
            {
                "at_ms": (s - lo) / 1e3,
                "ms": (t - s) / 1e3,
                "after_gpu": before[-1] if before else None,
                "before_gpu": after[0] if after else None,
                "host": host_at(host, (s + t) / 2),
            }
        )
    out["gaps_total"] = {"count": len(idle_iv), "over_min_count": len(gaps),
                         "over_min_ms": sum(t - s for s, t in gaps) / 1e3}  # fmt: skip
    # idle time by the host call spanning each gap's middle (what the GPU waited behind)
    by_host: dict[str, float] = defaultdict(float)
    for s, t in idle_iv:
        if t - s < min_gap_us:
            by_host[f"(gaps under {min_gap_us:g} us)"] += t - s
            continue
        h = host_at(host, (s + t) / 2, limit=1)
        by_host[h[0] if h else "(no host range)"] += t - s
    out["idle_by_host"] = {
        k: v / 1e3 for k, v in sorted(by_host.items(), key=lambda kv: -kv[1])[:8]
    }
    return out


def steps(trace: dict, name: str = STEP) -> dict:
    """The host ranges named `name` inside the scenario (one per engine step): their count and
    duration spread, and the GPU's busy time between the first's start and the last's end per
    step. None-valued when there are none."""
    evs = events(trace)
    window = scenario_window(evs)
    rs = [e for e in evs if e.get("name") == name and e.get("cat") in HOST_RANGE_CATS]
    if window is not None:
        rs = [e for e in rs if window[0] <= e["ts"] <= window[1]]
    return spread([e["dur"] for e in rs])


def breakdown(a: dict, b: dict) -> dict:
    """What scenario summary `a` spends beyond `b` (e.g. exact's prefill beyond stock's all-VRAM
    one, the same prompt): the wall difference and how much of it each part explains. The parts
    are wall = lead + GPU span + tail, and span = kernel + copy not under a kernel + idle."""

    def parts(s: dict) -> dict:
        return {
            "lead_ms": s["lead_ms"],
            "tail_ms": s["tail_ms"],
            "kernel_ms": s["kernel_ms"],
            "copy_not_hidden_ms": s["copy_ms"] - s["overlap_ms"],
            "idle_ms": s["idle_ms"],
        }

    pa, pb = parts(a), parts(b)
    return {"wall_ms": a["wall_ms"] - b["wall_ms"], **{k: pa[k] - pb[k] for k in pa}}
