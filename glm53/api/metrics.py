"""Server counters, and their Prometheus text exposition for GET /metrics."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping
from typing import Any

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0, 256, 1024, 4096, 16384, 65536, 262144)
_RECENT_REQUESTS = 32  # finished requests listed in /stats


class Histogram:
    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets=_LATENCY_BUCKETS_S):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        at = bisect.bisect_left(self.buckets, value)
        if at < len(self.counts):
            self.counts[at] += 1
        self.count += 1
        self.total += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        """The exposition lines; `labels` like 'mode="fast"' go on every line."""
        out, running = [], 0
        extra, braces = (labels + ",") if labels else "", f"{{{labels}}}" if labels else ""
        for bound, n in zip(self.buckets, self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{extra}le="{bound}"}} {running}')
        out += [
            f'{name}_bucket{{{extra}le="+Inf"}} {self.count}',
            f"{name}_sum{braces} {self.total:.6f}",
            f"{name}_count{braces} {self.count}",
        ]
        return out


# usage.glm53's counts, as Prometheus counters glm53_tier_<name>_total{mode} (help texts)
TIER_COUNTS = {
    "vram_hits": "Expert lookups served from a VRAM slot (GPU engine).",
    "zero_copy_misses": "Expert lookups read over PCIe from pinned RAM (GPU engine).",
    "cpu_lane_picks": "Token-expert picks computed on the CPU lane.",
    "ram_hits": "Expert lookups that hit the RAM tier.",
    "ram_misses": "Expert lookups that missed the RAM tier and were read from the source.",
    "store_read_bytes": "Bytes the RAM tier read from the expert source on misses.",
    "prefix_cached_tokens": "Prompt tokens taken from the prefix cache.",
}


class TierTotals:
    """usage.glm53 summed over the finished requests of one mode."""

    __slots__ = ("counts", "decode_seconds", "prefill_seconds", "requests")

    def __init__(self):
        self.requests = 0
        self.counts = dict.fromkeys(TIER_COUNTS, 0)
        self.prefill_seconds = Histogram()
        self.decode_seconds = Histogram()

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            **self.counts,
            "prefill_seconds": round(self.prefill_seconds.total, 6),
            "decode_seconds": round(self.decode_seconds.total, 6),
        }


class Metrics:
    """Counters owned by the event loop."""

    def __init__(self):
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cached_tokens_per_request = Histogram(_TOKEN_BUCKETS)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=_RECENT_REQUESTS)
        self.time_to_first_token_s = Histogram()
        self.request_seconds = Histogram()
        self.tiers: dict[str, TierTotals] = {}

    def count_tiers(self, mode: str, usage: Any) -> None:
        """Add one finished request's tier usage (a StreamUsage) to the totals of `mode`."""
        totals = self.tiers.get(mode) or self.tiers.setdefault(mode, TierTotals())
        totals.requests += 1
        for name in TIER_COUNTS:
            totals.counts[name] += getattr(usage, name)
        totals.prefill_seconds.observe(usage.prefill_seconds)
        totals.decode_seconds.observe(usage.decode_seconds)

    def count_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def count_tokens(self, request_id: str, prompt: int, completion: int, cached: int) -> None:
        """One finished request: its prompt, generated and prefix-cached prompt tokens."""
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.cached_tokens += cached
        self.cached_tokens_per_request.observe(cached)
        self.recent.append(
            {
                "id": request_id,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": completion,
            }
        )

    def summary(self) -> dict[str, Any]:
        return {
            "requests": sum(self.requests.values()),
            "requests_by_route": _by_route(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "recent_requests": list(self.recent),
            "tiers_by_mode": {mode: t.summary() for mode, t in self.tiers.items()},
        }

    def prometheus(self, scheduler: Mapping[str, Any], engine: Mapping[str, Any]) -> bytes:
        lines = [
            "# HELP glm53_requests_total HTTP requests by route and status.",
            "# TYPE glm53_requests_total counter",
        ]
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'glm53_requests_total{{route="{route}",status="{status}"}} {n}')
        lines += [
            "# TYPE glm53_prompt_tokens_total counter",
            f"glm53_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE glm53_completion_tokens_total counter",
            f"glm53_completion_tokens_total {self.completion_tokens}",
            "# HELP glm53_prompt_cached_tokens_total Prompt tokens restored from the prefix cache.",
            "# TYPE glm53_prompt_cached_tokens_total counter",
            f"glm53_prompt_cached_tokens_total {self.cached_tokens}",
            "# HELP glm53_prompt_cached_tokens Prompt tokens restored from the prefix cache, per request.",
            "# TYPE glm53_prompt_cached_tokens histogram",
            *self.cached_tokens_per_request.lines("glm53_prompt_cached_tokens"),
            "# HELP glm53_time_to_first_token_seconds From admission to the first token.",
            "# TYPE glm53_time_to_first_token_seconds histogram",
            *self.time_to_first_token_s.lines("glm53_time_to_first_token_seconds"),
            "# HELP glm53_request_seconds Generating requests, from admission to the last token.",
            "# TYPE glm53_request_seconds histogram",
            *self.request_seconds.lines("glm53_request_seconds"),
        ]
        lines += self._tier_lines()
        lines += _lane_lines(engine)
        lines += _gauges("glm53_scheduler", scheduler)
        lines += _gauges("glm53_engine", engine)
        return ("\n".join(lines) + "\n").encode()

    def _tier_lines(self) -> list[str]:
        lines = []
        for name, help_text in TIER_COUNTS.items():
            metric = f"glm53_tier_{name}_total"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
            for mode, totals in sorted(self.tiers.items()):
                lines.append(f'{metric}{{mode="{mode}"}} {totals.counts[name]}')
        for phase in ("prefill", "decode"):
            metric = f"glm53_request_{phase}_seconds"
            lines += [
                f"# HELP {metric} Per request: {phase} seconds (usage.glm53.{phase}_seconds).",
                f"# TYPE {metric} histogram",
            ]
            for mode, totals in sorted(self.tiers.items()):
                lines += getattr(totals, f"{phase}_seconds").lines(metric, f'mode="{mode}"')
        return lines


# Fast mode's counts from the GPU engine's stats()["lane"] (its FastLane), as counters
LANE_COUNTS = {
    "fallbacks": "Fast mode: decode MoE layers whose CPU-lane share missed its wait and was "
    "recomputed on the GPU (counted on the device).",
    "jobs": "Fast mode: MoE jobs the CPU lane computed.",
}


def _lane_lines(engine: Mapping[str, Any]) -> list[str]:
    lane = engine.get("lane")
    if not isinstance(lane, Mapping):
        return []
    lines = []
    for name, help_text in LANE_COUNTS.items():
        if isinstance(lane.get(name), int):  # fallbacks: None where no device reports them
            metric = f"glm53_lane_{name}_total"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
            lines.append(f"{metric} {lane[name]}")
    return lines


def _by_route(requests: Mapping[tuple[str, int], int]) -> dict[str, int]:
    out: dict[str, int] = collections.defaultdict(int)
    for (route, _), n in requests.items():
        out[route] += n
    return dict(out)


def _gauges(prefix: str, values: Mapping[str, Any]) -> list[str]:
    """Every number in a (nested) stats dict as a gauge named by its path."""
    out = []
    for key, value in values.items():
        name = f"{prefix}_{''.join(c if c.isalnum() else '_' for c in str(key))}"
        if isinstance(value, bool):
            out.append(f"{name} {int(value)}")
        elif isinstance(value, int | float):
            out += [f"# TYPE {name} gauge", f"{name} {value}"]
        elif isinstance(value, Mapping):
            out += _gauges(name, value)
    return out
