"""Record a decode routing trace for the fast-mode router's tests (tests/test_lane_router.py).

    python tools/record_lane_trace.py DEMO_DIR OUT.json [--steps 48] [--share 0.114]

Runs the CPU engine on a checkpoint (the demo), greedy, four streams decoding together, and
records every MoE layer's router picks at each decode step. A VRAM expert cache holding `share`
of the experts is replayed over those picks with glm53's CLOCK reference (tiers/clock_ref.py),
which tags each distinct pick a hit or a miss; misses are listed coldest first (fewest lookups
so far), with the rows that picked each. The output is what the router sees per layer and step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter


def record(demo: str, steps: int, share: float, streams: int = 4, seed: int = 0) -> dict:
    import torch

    from glm53.engine.base import StreamWork
    from glm53.engine.cpu import CpuEngine
    from glm53.engine.cpu_options import CpuEngineOptions
    from glm53.tiers.clock_ref import ClockRef

    engine = CpuEngine(demo, CpuEngineOptions(context=4096, max_batch=streams))
    engine.load()
    picks_log: list[tuple[int, list[list[int]]]] = []
    hooks = []
    for layer, moe in engine.moe.items():

        def hook(_mod, _inp, out, layer=layer):
            picks_log.append((layer, out[2].tolist()))

        hooks.append(moe.gate.register_forward_hook(hook))
    g = torch.Generator().manual_seed(seed)
    vocab = engine.tokenizer.vocab_size
    prompts = [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(streams)]
    last = []
    for slot, p in enumerate(prompts):
        logits = engine.step([StreamWork(slot, p, 0, True)])
        last.append(int(logits[0].argmax()))
    picks_log.clear()  # prefill is exact in every mode: only decode steps go to the router
    pos = [len(p) for p in prompts]
    events = []
    for _ in range(steps):
        work = [StreamWork(s, [last[s]], pos[s], True) for s in range(streams)]
        logits = engine.step(work)
        last = [int(r.argmax()) for r in logits]
        pos = [x + 1 for x in pos]
        events.extend(picks_log)
        picks_log.clear()
    for h in hooks:
        h.remove()
    layers = sorted(engine.moe)
    n_experts = int(engine.tier.num_experts)
    engine.close()
    n_keys = len(layers) * n_experts
    cache = ClockRef(max(8, int(share * n_keys)), n_keys)
    seen: Counter[int] = Counter()
    out = []
    for layer, rows in events:
        li = layers.index(layer)
        count: Counter[int] = Counter(e for row in rows for e in row)
        hits, misses = 0, []
        for e in count:
            key = li * n_experts + e
            if cache.lookup(key) >= 0:
                hits += 1
            else:
                misses.append((seen[key], count[e]))
                cache.admit(key)
            seen[key] += 1
        misses.sort()
        out.append({"layer": li, "rows": len(rows), "n_hit": hits,
                    "miss_rows": [c for _, c in misses]})  # fmt: skip
    return {
        "checkpoint": "glm53 synth --preset demo (glm53 routing skew)",
        "share": share,
        "streams": streams,
        "n_layers": len(layers),
        "n_experts": n_experts,
        "events": out,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("demo")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--share", type=float, default=0.114)
    a = p.parse_args(argv)
    trace = record(a.demo, a.steps, a.share)
    with open(a.out, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    print(f"{a.out}: {len(trace['events'])} layer steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
