"""Micro-benchmark: CLOCK table operations per second on a decode-like expert stream.

Stream: --layers x --experts keys, --slots slots, each token picks --top-k distinct experts per
layer (Gumbel top-k over per-layer Zipf weights, exponent fitted so the hottest quarter of a
layer's experts gets --hot-share of its picks; each layer ranks its experts differently).
One batch = one layer's picks for --batch-tokens tokens. One op = one lookup (a distinct
pick) or one admit. Three paths, in the same run, on the same stream:

- c_batch:  Clock.replay, the C batch call per layer in a nogil loop (the controller's path);
- py_call:  Clock.lookup / Clock.admit called from Python per pick;
- py_model: glm53.tiers.clock_ref.ClockRef.batch, the pure-Python twin.

The Python paths run on the first --py-tokens tokens; the C path runs the whole stream
--repeats times on fresh tables (best time). The model and the C table must end that prefix
with the same counters, which the run checks.

    python bench/micro_clock.py [--tokens 20000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from benchlib import git_commit

from glm53._clock import Clock
from glm53.tiers.clock_ref import ClockRef


def gumbel(rng, shape) -> np.ndarray:
    u = rng.random(shape, dtype=np.float32)
    return -np.log(-np.log(u + np.float32(1e-12)))


def zipf_exponent(n: int, k: int, hot_share: float, seed: int) -> float:
    """Exponent s of weights 1 / rank**s for which, drawing k distinct experts per token, the
    top quarter of the n ranks gets hot_share of the picks (fitted on 4,096 draws)."""
    noise = gumbel(np.random.default_rng(seed), (4096, n))
    log_rank = np.log(np.arange(1, n + 1, dtype=np.float32))
    lo, hi = 0.0, 8.0
    for _ in range(30):
        s = (lo + hi) / 2
        top = np.argpartition(noise - np.float32(s) * log_rank, n - k, axis=1)[:, n - k :]
        share = (top < n // 4).mean()
        lo, hi = (s, hi) if share < hot_share else (lo, s)
    return (lo + hi) / 2


def make_stream(args, s: float) -> tuple[np.ndarray, np.ndarray]:
    """int32 picks [tokens / batch_tokens * layers, batch_tokens * top_k], rows in decode
    order, and a bool [keys] mask of each layer's hottest quarter."""
    rng = np.random.default_rng(args.seed)
    n_layers, n_experts, k = args.layers, args.experts, args.top_k
    log_w = -s * np.log(np.arange(1, n_experts + 1, dtype=np.float32))
    # Each layer has its own hot set: rank r of layer l is expert perm[l, r].
    perm = np.argsort(rng.random((n_layers, n_experts)), axis=1)
    layer_log_w = np.empty((n_layers, n_experts), np.float32)
    np.put_along_axis(layer_log_w, perm, log_w[None, :], axis=1)
    hot = np.zeros((n_layers, n_experts), bool)
    np.put_along_axis(hot, perm[:, : n_experts // 4], True, axis=1)
    offsets = (np.arange(n_layers, dtype=np.int32) * n_experts)[None, :, None]
    chunks = []
    for start in range(0, args.tokens, 1024):
        t = min(1024, args.tokens - start)
        scores = layer_log_w[None] + gumbel(rng, (t, n_layers, n_experts))
        top = np.argpartition(-scores, k - 1, axis=2)[:, :, :k].astype(np.int32)
        chunks.append(top + offsets)  # [t, layers, k] keys
    picks = np.concatenate(chunks)  # [tokens, layers, k]
    b = args.batch_tokens
    n_steps = args.tokens // b
    picks = picks[: n_steps * b].reshape(n_steps, b, n_layers, k).transpose(0, 2, 1, 3)
    picks = np.ascontiguousarray(picks.reshape(n_steps * n_layers, b * k), dtype=np.int32)
    return picks, hot.ravel()


def run_c_batch(stream, args):
    best_s, counts, clock = None, None, None
    for _ in range(args.repeats):
        clock = Clock(args.slots, args.layers * args.experts)
        start = time.perf_counter()
        counts = clock.replay(stream, args.admit_limit)
        elapsed = time.perf_counter() - start
        best_s = elapsed if best_s is None else min(best_s, elapsed)
    ops = int(counts[:, 0].sum()) + int(counts[:, 2].sum())
    return ops / best_s, ops, clock.counters()


def run_py_call(rows, args):
    clock = Clock(args.slots, args.layers * args.experts)
    limit = args.admit_limit if args.admit_limit is not None else 1 << 30
    lookup, admit = clock.lookup, clock.admit
    start = time.perf_counter()
    for row in rows:
        admitted = 0
        for key in dict.fromkeys(row):
            if lookup(key) < 0 and admitted < limit:
                admit(key)
                admitted += 1
    elapsed = time.perf_counter() - start
    c = clock.counters()
    return (c["hits"] + c["misses"] + c["admits"]) / elapsed, c


def run_py_model(rows, args):
    model = ClockRef(args.slots, args.layers * args.experts)
    start = time.perf_counter()
    for row in rows:
        model.batch(row, args.admit_limit)
    elapsed = time.perf_counter() - start
    c = model.counters
    return (c["hits"] + c["misses"] + c["admits"]) / elapsed, c


def hit_rate(c) -> float:
    return c["hits"] / (c["hits"] + c["misses"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=42)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--slots", type=int, default=1376)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hot-share", type=float, default=0.73)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--batch-tokens", type=int, default=1)
    ap.add_argument("--py-tokens", type=int, default=2000)
    ap.add_argument("--admit-limit", type=int, default=None, help="per batch; default none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.py_tokens > args.tokens or args.tokens < args.batch_tokens:
        ap.error("need --batch-tokens <= --tokens and --py-tokens <= --tokens")

    s = zipf_exponent(args.experts, args.top_k, args.hot_share, args.seed)
    stream, hot = make_stream(args, s)
    py_rows_n = args.py_tokens // args.batch_tokens * args.layers
    py_rows = stream[:py_rows_n].tolist()

    c_ops_s, c_ops, c_counters = run_c_batch(stream, args)
    call_ops_s, call_counters = run_py_call(py_rows, args)
    model_ops_s, model_counters = run_py_model(py_rows, args)

    check = Clock(args.slots, args.layers * args.experts)
    check.replay(stream[:py_rows_n], args.admit_limit)
    model = ClockRef(args.slots, args.layers * args.experts)
    for row in py_rows:
        model.batch(row, args.admit_limit)
    c_slots = [check.key_of(slot) for slot in range(args.slots)]
    matches = (check.counters(), c_slots, check.hand) == (
        model.counters,
        model.key_of_slot,
        model.hand,
    )
    if not matches:
        raise SystemExit("the C table and the Python model disagree on the same stream")

    result = {
        "bench": "micro_clock",
        "figures": {
            "c_batch_mops": c_ops_s / 1e6,
            "py_call_mops": call_ops_s / 1e6,
            "py_model_mops": model_ops_s / 1e6,
            "c_batch_ops": c_ops,
            "hit_rate_c_batch": hit_rate(c_counters),
            "hit_rate_py_call": hit_rate(call_counters),
            "hit_rate_py_model": hit_rate(model_counters),
            "evictions_c_batch": c_counters["evictions"],
            "hot_quarter_pick_share": float(hot[stream].mean()),
        },
        "ratios": {
            "c_batch_over_py_model": c_ops_s / model_ops_s,
            "c_batch_over_py_call": c_ops_s / call_ops_s,
            "py_call_over_py_model": call_ops_s / model_ops_s,
        },
        "config": {
            "layers": args.layers,
            "experts": args.experts,
            "slots": args.slots,
            "top_k": args.top_k,
            "batch_tokens": args.batch_tokens,
            "tokens": args.tokens,
            "py_tokens": args.py_tokens,
            "admit_limit": args.admit_limit,
            "zipf_exponent": round(s, 4),
            "hot_share": args.hot_share,
            "repeats": args.repeats,
            "seed": args.seed,
            "model_matches_c": matches,
            "targets": {"c_batch_mops": 20, "c_batch_over_py_model": 30},
            "commit": git_commit(),
            "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus "
            f"{platform.processor() or ''}".strip(),
            "python": platform.python_version(),
        },
    }
    if args.json:
        print(json.dumps(result))
        return 0
    f, r = result["figures"], result["ratios"]
    print(
        f"stream: {args.tokens} tokens x {args.layers} layers, top-{args.top_k} of "
        f"{args.experts}, {args.slots} slots, zipf s={s:.3f}, seed {args.seed}"
    )
    print(f"{'path':<10} {'Mops/s':>9} {'hit rate':>9}")
    for name in ("c_batch", "py_call", "py_model"):
        print(f"{name:<10} {f[name + '_mops']:>9.2f} {f['hit_rate_' + name]:>9.4f}")
    print(
        f"c_batch / py_model {r['c_batch_over_py_model']:.1f}x, "
        f"c_batch / py_call {r['c_batch_over_py_call']:.1f}x (targets: >= 20 Mops/s, >= 30x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
