"""CPU engine speed on the demo preset: prefill tok/s, greedy decode tok/s, RAM-tier hit rate.

    python bench/cpu_engine.py [--json] [--prompt 512] [--tokens 128] [--checkpoint DIR]
                               [--repeat N]

A 512-token prompt is prefilled in one chunk, then 128 tokens are decoded greedily, once with a
RAM tier that holds every routed expert and once capped to a quarter of them (both start
cold, in a freshly loaded engine, so the first touches of each expert are misses). Then one
more stream decodes through Engine.step, its tokens alternating between the per-stream tier
counts (usage.glm53) on and off: their decode tok/s and ratio (goal: under 1 % slower). Targets on
the 2-core CI-size machine: decode >= 20 tok/s, prefill >= 200 tok/s (issue 7).

Shared CI machines are noisy: the load average (os.getloadavg) is recorded before every run,
and with --repeat N the pair of runs is repeated N times and each figure is the median over
them (every run's figures are listed under "runs").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchlib import git_commit


def prompt_ids(tokenizer, length: int) -> list[int]:
    from glm53.models.tokenizer import CORPUS_PATH

    head = "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>"
    ids = tokenizer.encode(head + CORPUS_PATH.read_text(encoding="utf-8"))[: length - 2]
    return ids + tokenizer.encode("<|assistant|><think>")


def run_once(checkpoint: Path, ram_cap: int | None, ids: list[int], new_tokens: int, args) -> dict:
    from glm53.engine.cpu import CpuEngine
    from glm53.engine.cpu_options import CpuEngineOptions

    options = CpuEngineOptions(
        ram_cap=ram_cap, cpu_threads=args.lane_threads, torch_threads=args.torch_threads
    )
    engine = CpuEngine(checkpoint, options)
    engine.load()
    cache = engine.new_cache()
    start = time.perf_counter()
    logits = engine.forward(ids, cache)
    prefill_s = time.perf_counter() - start
    token = int(logits.argmax())
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(engine.forward([token], cache).argmax())
    decode_s = time.perf_counter() - start
    ram = engine.stats()["tiers"]["ram"]
    layers = engine.stats()["tiers"]["layers"]
    result = {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": new_tokens / decode_s,
        "hit_rate": ram["hit_rate"],
        "slots": ram["slots"],
        "bytes_read": sum(c["bytes_read"] for c in layers.values()),
        "lane_s": sum(c["lane_ns"] for c in layers.values()) / 1e9,
    }
    engine.close()
    return result


def telemetry_overhead(checkpoint: Path, ids: list[int], pairs: int, args) -> dict:
    """Greedy decode of one stream through Engine.step in a warm engine, its tokens alternating
    between the per-stream tier counts (usage.glm53) on and off, so that both see the same
    load; decode tok/s of each from the median time per token (robust to the preemptions of a
    shared host), and their ratio."""
    from glm53.engine.base import StreamWork
    from glm53.engine.cpu import CpuEngine
    from glm53.engine.cpu_options import CpuEngineOptions

    options = CpuEngineOptions(cpu_threads=args.lane_threads, torch_threads=args.torch_threads)
    engine = CpuEngine(checkpoint, options)
    engine.load()
    token = int(engine.step([StreamWork(0, ids, 0, True)])[0].argmax())
    pos = len(ids)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * pairs):
        counted = step % 2 == 0
        engine.count_streams = counted
        start = time.perf_counter()
        token = int(engine.step([StreamWork(0, [token], pos, True)])[0].argmax())
        seconds[counted].append(time.perf_counter() - start)
        pos += 1
    engine.close()
    on, off = (1 / statistics.median(seconds[c]) for c in (True, False))
    return {"decode_tok_s_counted": on, "decode_tok_s_uncounted": off, "ratio": on / off}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens to decode (default 128)")
    p.add_argument("--checkpoint", help="demo checkpoint dir (default: write one, seed 0)")
    p.add_argument(
        "--small-cap-share",
        type=float,
        default=0.25,
        help="the capped run's RAM tier as a share of all experts (default 0.25)",
    )
    p.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads (default torch's)"
    )
    p.add_argument(
        "--lane-threads", type=int, default=None, help="CPU lane threads (default layout)"
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="run the pair N times, report medians (default 1)"
    )
    p.add_argument(
        "--telemetry-pairs",
        type=int,
        default=64,
        help="decode tokens with the per-stream tier counts on, and as many off (default 64)",
    )
    args = p.parse_args()
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    load_start = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "demo"
        if not args.checkpoint:
            from glm53.synth.shapes import preset
            from glm53.synth.writer import write_checkpoint

            write_checkpoint(preset("demo"), checkpoint, seed=0)
        from glm53.engine.tokenizer import CheckpointTokenizer
        from glm53.models.checkpoint import Checkpoint
        from glm53.tiers.expert_source import SafetensorsSource

        ids = prompt_ids(CheckpointTokenizer.from_dir(checkpoint), args.prompt)
        source = SafetensorsSource(Checkpoint(checkpoint))
        num_keys, record = len(source.layouts), source.record_bytes
        source.close()
        small_cap = max(1, int(args.small_cap_share * num_keys)) * record
        runs = []
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            full = run_once(checkpoint, None, ids, args.tokens, args)
            capped = run_once(checkpoint, small_cap, ids, args.tokens, args)
            runs.append({"load_1min": round(load, 2), "all": full, "quarter_cap": capped})
        telemetry = telemetry_overhead(checkpoint, ids, args.telemetry_pairs, args)

    def medians(which: str) -> dict:
        """The first run's figures with the timings replaced by their medians over the runs
        (hit rates, slots and bytes read repeat from run to run: greedy decoding, cold start;
        each run's hit rates are listed under "runs" as well)."""
        out = dict(runs[0][which])
        for key in ("prefill_tok_s", "decode_tok_s", "lane_s"):
            out[key] = statistics.median(run[which][key] for run in runs)
        return out

    full, capped = medians("all"), medians("quarter_cap")
    figures = {
        "prefill_tok_s": round(full["prefill_tok_s"], 1),
        "decode_tok_s": round(full["decode_tok_s"], 2),
        "hit_rate_all_experts": round(full["hit_rate"], 4),
        "hit_rate_quarter_cap": round(capped["hit_rate"], 4),
        "decode_tok_s_quarter_cap": round(capped["decode_tok_s"], 2),
        "prefill_tok_s_quarter_cap": round(capped["prefill_tok_s"], 1),
        "bytes_read_quarter_cap": capped["bytes_read"],
        "lane_s_all_experts": round(full["lane_s"], 3),
        "decode_tok_s_tier_counts_on": round(telemetry["decode_tok_s_counted"], 2),
        "decode_tok_s_tier_counts_off": round(telemetry["decode_tok_s_uncounted"], 2),
    }
    ratios = {
        "decode_vs_target_20": round(full["decode_tok_s"] / 20.0, 3),
        "prefill_vs_target_200": round(full["prefill_tok_s"] / 200.0, 3),
        "decode_quarter_cap_vs_all": round(capped["decode_tok_s"] / full["decode_tok_s"], 3),
        # goal >= 0.99: counting usage.glm53 costs under 1 % of decode tok/s
        "tier_counts_on_vs_off": round(telemetry["ratio"], 4),
    }
    config = {
        "preset": "demo",
        "seed": 0,
        "prompt_tokens": len(ids),
        "new_tokens": args.tokens,
        "slots_all": full["slots"],
        "slots_quarter_cap": capped["slots"],
        "torch_threads": torch.get_num_threads(),
        "lane_threads": args.lane_threads,
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "commit": git_commit(),
        "repeat": args.repeat,
        "load_avg_1_5_15_start": [round(x, 2) for x in load_start],
        "load_avg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
    }
    per_run = [
        {
            "load_1min": run["load_1min"],
            "prefill_tok_s": round(run["all"]["prefill_tok_s"], 1),
            "decode_tok_s": round(run["all"]["decode_tok_s"], 2),
            "prefill_tok_s_quarter_cap": round(run["quarter_cap"]["prefill_tok_s"], 1),
            "decode_tok_s_quarter_cap": round(run["quarter_cap"]["decode_tok_s"], 2),
            "hit_rate_all_experts": round(run["all"]["hit_rate"], 4),
            "hit_rate_quarter_cap": round(run["quarter_cap"]["hit_rate"], 4),
        }
        for run in runs
    ]
    if not args.json:
        print(f"{'':28s}{'all experts':>14s}{'quarter cap':>14s}")
        print(f"{'prefill tok/s':28s}{full['prefill_tok_s']:14.1f}{capped['prefill_tok_s']:14.1f}")
        print(f"{'decode tok/s':28s}{full['decode_tok_s']:14.2f}{capped['decode_tok_s']:14.2f}")
        print(f"{'RAM-tier hit rate':28s}{full['hit_rate']:14.4f}{capped['hit_rate']:14.4f}")
        print(f"{'RAM-tier slots':28s}{full['slots']:14d}{capped['slots']:14d}")
        print(
            f"{'decode tok/s, tier counts':28s}{telemetry['decode_tok_s_counted']:14.2f} on"
            f"{telemetry['decode_tok_s_uncounted']:11.2f} off"
        )
        print(f"load average at start {load_start}, runs {[r['load_1min'] for r in runs]}")
        return 0
    print(
        json.dumps(
            {
                "bench": "cpu_engine",
                "figures": figures,
                "ratios": ratios,
                "config": config,
                "runs": per_run,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
