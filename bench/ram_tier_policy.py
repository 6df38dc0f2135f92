"""The RAM tier's policy headroom: its hit rate on the VRAM cache's misses against plain CLOCK and
Belady's offline optimum, on the same trace at the same number of slots (glm53.tiers.policy_sim).

The trace is either a file (--trace, glm53.tiers.policy_sim's .npz format) or synthetic: per
MoE layer a stand-in router fitted to GLM-5.3-Flash's pick skew (glm53.synth.routing.
stand_in_decode_picks: the hottest 25 % of experts serve 73.5 % of picks, consecutive tokens
share picks), --streams streams decoding together (one forward per layer and step holds every
stream's picks), through a VRAM cache of --vram-share of the experts (CLOCK); its misses are
the RAM tier's waves. The RAM tier holds --ram-share of the experts.

    python bench/ram_tier_policy.py [--json] [--tokens 256] [--streams 1] [--ram-share 0.7]
    python bench/ram_tier_policy.py --trace FILE.npz --ram-share 0.4 --json
    python bench/ram_tier_policy.py --write-trace FILE.npz   # keep the synthetic trace
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np
from benchlib import git_commit

from glm53.tiers import policy_sim

REAL_24GB_SHARE = 1376 / 12096  # the 24 GB RTX 3090's VRAM slots of GLM-5.3-Flash's experts


def synthetic_trace(args) -> policy_sim.Trace:
    from glm53.synth.routing import stand_in_decode_picks

    shape = (args.experts, args.top_k, args.hidden, args.tokens, args.seed)
    per_layer = [
        stand_in_decode_picks("glm53", *shape, layer, num_streams=args.streams)
        for layer in range(args.layers)
    ]
    forwards = []
    for t in range(args.tokens):
        for layer, picks in enumerate(per_layer):
            experts = picks[:, t, :].reshape(-1)
            forwards.append(np.stack([np.full_like(experts, layer), experts], axis=1))
    num_keys = args.layers * args.experts
    vram_slots = max(1, round(args.vram_share * num_keys))
    waves = policy_sim.misses_after_vram(forwards, args.experts, vram_slots)
    return policy_sim.Trace(waves, num_keys, args.experts)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="replay this trace file instead")
    ap.add_argument("--write-trace", default=None, help="write the synthetic trace here")
    ap.add_argument("--ram-share", type=float, default=0.7,
                    help="the RAM tier's slots as a share of all experts (default 0.7)")  # fmt: skip
    ap.add_argument("--vram-share", type=float, default=REAL_24GB_SHARE,
                    help="synthetic: the VRAM cache's share of the experts (default: the 24 GB "
                    "card's 11.4 %%)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=42, help="synthetic: MoE layers")
    ap.add_argument("--experts", type=int, default=288, help="synthetic: experts per layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512,
                    help="synthetic: width of the stand-in router inputs")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=256, help="synthetic: decode steps")
    ap.add_argument("--streams", type=int, default=1, help="synthetic: streams per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not 0 < args.ram_share <= 1:
        ap.error(f"--ram-share {args.ram_share} must be in (0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    trace = policy_sim.read_trace(args.trace) if args.trace else synthetic_trace(args)
    if args.write_trace:
        policy_sim.write_trace(args.write_trace, trace)
    slots = max(1, round(args.ram_share * trace.num_keys))
    widest = max((len(w) for w in trace.waves), default=0)
    results = {
        "ram_tier": policy_sim.replay_ram_tier(trace.waves, slots, trace.num_keys),
        "clock": policy_sim.replay_clock(trace.waves, slots, trace.num_keys),
        "oracle": policy_sim.replay_belady(trace.waves, slots, trace.num_keys),
    }
    rate = {name: r.hit_rate for name, r in results.items()}
    figures = {
        "ram_tier_hit_rate": rate["ram_tier"],
        "clock_hit_rate": rate["clock"],
        "oracle_hit_rate": rate["oracle"],
        "oracle_minus_ram_tier_points": 100 * (rate["oracle"] - rate["ram_tier"]),
        "hits": {name: r.hits for name, r in results.items()},
        "accesses": trace.num_accesses,
        "waves": len(trace.waves),
        "widest_wave": widest,
    }
    ratios = {
        "ram_tier_vs_oracle": rate["ram_tier"] / rate["oracle"] if rate["oracle"] else None,
        "ram_tier_vs_clock": rate["ram_tier"] / rate["clock"] if rate["clock"] else None,
    }
    config = {
        "trace": args.trace or "synthetic",
        "num_keys": trace.num_keys,
        "num_experts": trace.num_experts,
        "ram_share": args.ram_share,
        "ram_slots": slots,
        "commit": git_commit(),
        "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "python": platform.python_version(),
    }
    if not args.trace:
        config["synthetic"] = {
            k: getattr(args, k)
            for k in ("layers", "experts", "top_k", "hidden", "tokens", "streams", "seed")
        }
        config["synthetic"]["vram_share"] = args.vram_share
    if not args.json:
        print(f"{trace.num_accesses} RAM-tier accesses in {len(trace.waves)} waves, {slots} slots")
        for name, r in results.items():
            print(f"{name:9} {r.hits:9d} hits  {100 * r.hit_rate:6.2f} %")
    print(json.dumps({"bench": "ram_tier_policy", "figures": figures, "ratios": ratios,
                      "config": config}))  # fmt: skip


if __name__ == "__main__":
    main()
