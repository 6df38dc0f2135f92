"""The RAM tier's policy headroom: its hit rate on the VRAM cache's misses against plain CLOCK and
Belady's offline optimum, on the same trace at the same number of slots (glm53.tiers.policy_sim).

Policies, as policy_sim names them: `ram_tier` (the tier's own table, CLOCK with admission by
frequency, pyx/clock.h), `wave_clock` (the same waves through plain CLOCK: the tier's policy
before), `clock` (plain CLOCK one key at a time) and `oracle` (Belady). Hit rates count the
trace's accesses found resident; `us_per_wave` times each table's waves through the tier's
Python loop (policy_sim.hits_per_wave) and `c_ns_per_wave` the C batch calls alone
(Clock.replay over the waves padded with repeats, which a batch drops).

The trace is either a file (--trace, glm53.tiers.policy_sim's .npz format) or synthetic: per
MoE layer a stand-in router fitted to GLM-5.3-Flash's pick skew (glm53.synth.routing.
stand_in_decode_picks: the hottest 25 % of experts serve 73.5 % of picks, consecutive tokens
share picks), --streams streams decoding together (one forward per layer and step holds every
stream's picks), through a VRAM cache of --vram-share of the experts (CLOCK); its misses are
the RAM tier's waves. The RAM tier holds --ram-share of the experts.

--burst SHARE puts a long prompt's prefill chunk in the middle of the trace (one wave per
layer of SHARE of its experts, each key once: policy_sim.prefill_burst) and reports, per
table, the share of its resident keys that the burst left resident and the hit rate on the
next --burst-tokens tokens' waves, with and without the burst.

--warm (synthetic) also measures a warm start, as the engine makes one from the heat list it
saved at its last close: twice --streams streams are drawn from the same model; the second
half is the earlier run, replayed through the tier's table, whose residents hottest first
(ram_tier.heat_order) seed the tier's and wave CLOCK's tables (Clock.seed) before the first
half is replayed; Belady starts from the same keys.

--streams, --seed, --vram-share and --ram-share take comma-separated lists; more than one case
puts each case's figures and ratios under figures.cases and the worst of them at the top.

    python bench/ram_tier_policy.py [--json] [--tokens 256] [--streams 1] [--ram-share 0.7]
    python bench/ram_tier_policy.py --streams 1,4 --seed 0,1 --ram-share 0.4,0.7 --burst 1 --json
    python bench/ram_tier_policy.py --trace FILE.npz --ram-share 0.4 --json
    python bench/ram_tier_policy.py --write-trace FILE.npz   # keep the synthetic trace
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time

import numpy as np
from benchlib import git_commit

from glm53 import _clock
from glm53.tiers import policy_sim
from glm53.tiers.ram_tier import POLICY, heat_order, tier_table

REAL_24GB_SHARE = 1376 / 12096  # the 24 GB RTX 3090's VRAM slots of GLM-5.3-Flash's experts
TABLES = {  # the policies replayed wave by wave through a compiled table
    "ram_tier": tier_table,
    "wave_clock": lambda slots, keys: _clock.Clock(slots, keys),
}


def synthetic_picks(args, streams: int, seed: int) -> list[np.ndarray]:
    from glm53.synth.routing import stand_in_decode_picks

    shape = (args.experts, args.top_k, args.hidden, args.tokens, seed)
    return [
        stand_in_decode_picks("glm53", *shape, layer, num_streams=streams)
        for layer in range(args.layers)
    ]


def synthetic_trace(args, per_layer, vram_share: float, streams=None) -> policy_sim.Trace:
    """The RAM tier's trace of the picks' streams (all, or the `streams` slice)."""
    if streams is not None:
        per_layer = [p[streams] for p in per_layer]
    forwards = []
    for t in range(args.tokens):
        for layer, picks in enumerate(per_layer):
            experts = picks[:, t, :].reshape(-1)
            forwards.append(np.stack([np.full_like(experts, layer), experts], axis=1))
    num_keys = args.layers * args.experts
    vram_slots = max(1, round(vram_share * num_keys))
    waves = policy_sim.misses_after_vram(forwards, args.experts, vram_slots)
    return policy_sim.Trace(waves, num_keys, args.experts)


def c_ns_per_wave(waves, make, slots: int, num_keys: int, repeats: int = 3) -> float:
    """The C batch calls alone: the waves as rows of one width (each padded with its own first
    key, which the batch's dedup drops), through Clock.replay on a fresh table; the fastest of
    `repeats` runs."""
    waves = [w for w in waves if len(w)]
    if not waves:
        return 0.0
    width = max(len(w) for w in waves)
    rows = np.array([np.pad(w, (0, width - len(w)), mode="edge") for w in waves], np.int32)
    best = float("inf")
    for _ in range(repeats):
        table = make(slots, num_keys)
        start = time.perf_counter()
        table.replay(rows)
        best = min(best, time.perf_counter() - start)
    return 1e9 * best / len(waves)


def us_per_wave(waves, make, slots: int, num_keys: int, repeats: int = 3) -> float:
    """The tier's Python loop over the waves (policy_sim.hits_per_wave) on a fresh table; the
    fastest of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        table = make(slots, num_keys)
        start = time.perf_counter()
        policy_sim.hits_per_wave(waves, table)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / max(1, len(waves))


def resident(table) -> set[int]:
    return {k for k in (table.key_of(s) for s in range(table.n_slots)) if k >= 0}


def burst_figures(trace, slots: int, share: float, seed: int, num_layers: int, tokens: int) -> dict:
    """A prefill burst put in mid-trace (at a token's first layer): per table, the share of the
    keys resident before it that are still resident after it, and the hit rate on the next
    `tokens` tokens' waves with the burst and without it."""
    at = len(trace.waves) // 2 // num_layers * num_layers
    burst = policy_sim.prefill_burst(trace.num_keys, trace.num_experts, share, seed)
    after = trace.waves[at : at + tokens * num_layers]
    accesses = sum(len(w) for w in after)
    out = {
        "at_wave": at,
        "burst_waves": len(burst),
        "burst_keys": int(sum(len(w) for w in burst)),
        "after_tokens": tokens,
        "after_accesses": accesses,
    }
    for name, make in TABLES.items():
        plain = make(slots, trace.num_keys)
        policy_sim.hits_per_wave(trace.waves[:at], plain)
        table = make(slots, trace.num_keys)
        policy_sim.hits_per_wave(trace.waves[:at], table)
        before = resident(table)
        policy_sim.hits_per_wave(burst, table)
        kept = len(before & resident(table)) / max(1, len(before))
        with_burst = policy_sim.hits_per_wave(after, table).sum() / max(1, accesses)
        without = policy_sim.hits_per_wave(after, plain).sum() / max(1, accesses)
        out[name] = {
            "kept_share": kept,
            "hit_rate_after": float(with_burst),
            "hit_rate_after_without_burst": float(without),
            "points_lost": float(100 * (without - with_burst)),
        }
    return out


def warm_figures(trace, earlier, slots: int) -> dict:
    """Hit rates after a warm start from the heat list of an earlier run (`earlier`)."""
    table = tier_table(slots, trace.num_keys)
    policy_sim.hits_per_wave(earlier.waves, table)
    heat = np.array(heat_order(table), dtype=np.int32)
    rate = {}
    for name, make in TABLES.items():
        seeded = make(slots, trace.num_keys)
        seeded.seed(heat)
        rate[name] = policy_sim.replay_waves(trace.waves, seeded).hit_rate
    rate["oracle"] = policy_sim.replay_belady(trace.waves, slots, trace.num_keys, heat).hit_rate
    out = {f"{name}_hit_rate": r for name, r in rate.items()}
    out["seeded"] = len(heat)
    out["earlier_accesses"] = earlier.num_accesses
    out["oracle_minus_ram_tier_points"] = 100 * (rate["oracle"] - rate["ram_tier"])
    return out


def one_case(trace, ram_share: float, args, num_layers: int, earlier=None) -> tuple[dict, dict]:
    slots = max(1, round(ram_share * trace.num_keys))
    results = {}
    for name, make in TABLES.items():
        hits = policy_sim.hits_per_wave(trace.waves, make(slots, trace.num_keys))
        results[name] = policy_sim.PolicyResult(int(hits.sum()), trace.num_accesses)
    results["clock"] = policy_sim.replay_clock(trace.waves, slots, trace.num_keys)
    results["oracle"] = policy_sim.replay_belady(trace.waves, slots, trace.num_keys)
    rate = {name: r.hit_rate for name, r in results.items()}
    figures = {f"{name}_hit_rate": rate[name] for name in results}
    figures.update(
        {
            "oracle_minus_ram_tier_points": 100 * (rate["oracle"] - rate["ram_tier"]),
            "oracle_minus_wave_clock_points": 100 * (rate["oracle"] - rate["wave_clock"]),
            "hits": {name: r.hits for name, r in results.items()},
            "accesses": trace.num_accesses,
            "waves": len(trace.waves),
            "widest_wave": max((len(w) for w in trace.waves), default=0),
            "ram_slots": slots,
            "us_per_wave": {
                name: us_per_wave(trace.waves, make, slots, trace.num_keys)
                for name, make in TABLES.items()
            },
            "c_ns_per_wave": {
                name: c_ns_per_wave(trace.waves, make, slots, trace.num_keys)
                for name, make in TABLES.items()
            },
        }
    )
    if earlier is not None:
        figures["warm"] = warm_figures(trace, earlier, slots)
    if args.burst:
        figures["burst"] = burst_figures(
            trace, slots, args.burst, args.seed[0], num_layers, args.burst_tokens
        )

    def ratio(a, b):
        return rate[a] / rate[b] if rate[b] else None

    ratios = {
        "ram_tier_vs_oracle": ratio("ram_tier", "oracle"),
        "ram_tier_vs_clock": ratio("ram_tier", "clock"),
        "ram_tier_vs_wave_clock": ratio("ram_tier", "wave_clock"),
        "wave_clock_vs_oracle": ratio("wave_clock", "oracle"),
    }
    return figures, ratios


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="replay this trace file instead")
    ap.add_argument("--write-trace", default=None,
                    help="write the (first case's) synthetic trace here")  # fmt: skip
    ap.add_argument("--ram-share", type=floats, default=[0.7],
                    help="the RAM tier's slots as a share of all experts (default 0.7)")  # fmt: skip
    ap.add_argument("--vram-share", type=floats, default=[REAL_24GB_SHARE],
                    help="synthetic: the VRAM cache's share of the experts (default: the 24 GB "
                    "card's 11.4 %%)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=42, help="synthetic: MoE layers")
    ap.add_argument("--experts", type=int, default=288, help="synthetic: experts per layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512,
                    help="synthetic: width of the stand-in router inputs")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=256, help="synthetic: decode steps")
    ap.add_argument("--streams", type=ints, default=[1], help="synthetic: streams per step")
    ap.add_argument("--seed", type=ints, default=[0])
    ap.add_argument("--burst", type=float, default=0.0,
                    help="put a prefill chunk touching this share of each layer's experts in "
                    "mid-trace and report the hit rates after it (0: none)")  # fmt: skip
    ap.add_argument("--burst-tokens", type=int, default=16,
                    help="the decode tokens after the burst whose hit rate is reported")  # fmt: skip
    ap.add_argument("--warm", action="store_true",
                    help="synthetic: also measure a warm start from an earlier run's heat list")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.warm and args.trace:
        ap.error("--warm needs the synthetic trace (it draws the earlier run's streams)")
    for share in args.ram_share:
        if not 0 < share <= 1:
            ap.error(f"--ram-share {share} must be in (0, 1]")
    if not 0 <= args.burst <= 1:
        ap.error(f"--burst {args.burst} must be in [0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = []  # (case fields, trace)
    if args.trace:
        trace = policy_sim.read_trace(args.trace)
        cases += [({"trace": args.trace, "ram_share": r}, trace, None) for r in args.ram_share]
        num_layers = trace.num_keys // trace.num_experts
    else:
        num_layers = args.layers
        for streams, seed in itertools.product(args.streams, args.seed):
            # with --warm, streams [streams, 2 * streams) are the earlier run (the first
            # `streams` are drawn exactly as without it)
            picks = synthetic_picks(args, 2 * streams if args.warm else streams, seed)
            for vram in args.vram_share:
                trace = synthetic_trace(args, picks, vram, slice(0, streams))
                earlier = None
                if args.warm:
                    earlier = synthetic_trace(args, picks, vram, slice(streams, 2 * streams))
                if args.write_trace and not cases:
                    policy_sim.write_trace(args.write_trace, trace)
                for r in args.ram_share:
                    case = {"streams": streams, "seed": seed, "vram_share": vram, "ram_share": r}
                    cases.append((case, trace, earlier))
    out = []
    for case, trace, *earlier in cases:
        figures, ratios = one_case(trace, case["ram_share"], args, num_layers, *earlier)
        out.append({"case": case, "figures": figures, "ratios": ratios})
        if not args.json:
            print(f"{case}: {trace.num_accesses} accesses in {len(trace.waves)} waves, "
                  f"{figures['ram_slots']} slots")  # fmt: skip
            for name in ("ram_tier", "wave_clock", "clock", "oracle"):
                print(f"  {name:10} {figures['hits'][name]:9d} hits  "
                      f"{100 * figures[f'{name}_hit_rate']:6.2f} %")  # fmt: skip
            if "warm" in figures:
                warm = figures["warm"]
                print("  warm start: " + "  ".join(
                    f"{name} {100 * warm[f'{name}_hit_rate']:6.2f} %"
                    for name in ("ram_tier", "wave_clock", "oracle")))  # fmt: skip
    if len(out) == 1:
        figures, ratios = out[0]["figures"], out[0]["ratios"]
    else:
        worst = max(out, key=lambda c: c["figures"]["oracle_minus_ram_tier_points"])
        figures = {
            "cases": out,
            "max_oracle_minus_ram_tier_points": worst["figures"]["oracle_minus_ram_tier_points"],
            "worst_case": worst["case"],
        }
        if args.warm:
            figures["max_oracle_minus_ram_tier_points_warm"] = max(
                c["figures"]["warm"]["oracle_minus_ram_tier_points"] for c in out
            )
        if not args.trace:  # the worst case at each VRAM share (the 24 GB card's first)
            figures["max_oracle_minus_ram_tier_points_by_vram_share"] = {
                f"{vram:.4f}": max(
                    c["figures"]["oracle_minus_ram_tier_points"]
                    for c in out
                    if c["case"]["vram_share"] == vram
                )
                for vram in args.vram_share
            }
        ratios = {
            "ram_tier_vs_oracle_min": min(c["ratios"]["ram_tier_vs_oracle"] for c in out),
            "ram_tier_vs_wave_clock_min": min(c["ratios"]["ram_tier_vs_wave_clock"] for c in out),
        }
    config = {
        "trace": args.trace or "synthetic",
        "num_keys": cases[0][1].num_keys,
        "num_experts": cases[0][1].num_experts,
        "ram_share": args.ram_share[0] if len(args.ram_share) == 1 else args.ram_share,
        "ram_slots": max(1, round(args.ram_share[0] * cases[0][1].num_keys)),
        "ram_tier_policy": {**POLICY, "freq_window_per_slot": _clock.FREQ_WINDOW_PER_SLOT},
        "burst_share": args.burst,
        "commit": git_commit(),
        "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
    }
    if args.warm:
        config["warm"] = "the heat list of an earlier run of as many streams, same model"
    if not args.trace:
        config["synthetic"] = {
            k: getattr(args, k) for k in ("layers", "experts", "top_k", "hidden", "tokens")
        }
        for k in ("streams", "seed", "vram_share"):
            v = getattr(args, k)
            config["synthetic"][k] = v[0] if len(v) == 1 else v
    print(json.dumps({"bench": "ram_tier_policy", "figures": figures, "ratios": ratios,
                      "config": config}))  # fmt: skip


if __name__ == "__main__":
    main()
