"""Prefix reuse across the turns of a chat: time to first token (TTFT) of each turn, and of a cold
prompt as long as what each later turn actually prefilled.

A conversation of --turns turns, at the token level through POST /generate (streamed, greedy,
ignore_eos): turn 1 is --first-tokens random token ids; every later turn is the previous
prompt, its answer (--answer-tokens) and --turn-tokens new ids. Later turns resume from the
server's prefix cache: meta_info.cached_tokens says how much of each prompt was reused, and
prompt - cached is what it prefilled. Then, for each later turn, a cold prompt (fresh random
ids, nothing to reuse) of that prefilled length. Every shape is run once before it is measured
(a warm-up conversation and warm-up cold prompts with other random ids: the first long prompt
pays one-time costs such as Triton compiles on the GPU), and the measured requests never share
a prefix with the warm-up ones.

Goals (issue 14): on the CPU demo, turns 2.. TTFT at most 1/10 of turn 1
(ratios.ttft_first_vs_later >= 10); on the GPU, each later turn's TTFT at most 1.2x the cold
prompt of its prefilled length (ratios.later_vs_cold_same_prefill <= 1.2).

    python bench/prefix_cache.py --demo [--chunk-size 2048] [--json]
    python bench/prefix_cache.py --url http://127.0.0.1:30000 [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchlib import host_fields, sse_events


def generate(client: httpx.Client, ids: list[int], answer_tokens: int) -> dict:
    """One streamed greedy /generate: TTFT (s, to the first event with a token), the answer's
    ids and the prompt tokens the server reused."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": answer_tokens,
            "ignore_eos": True,
        },
    }
    start = time.perf_counter()
    ttft_s, last = None, None
    for event in sse_events(client, "/generate", body):
        if ttft_s is None and event["output_ids"]:
            ttft_s = time.perf_counter() - start
        last = event
    return {
        "ttft_s": ttft_s,
        "output_ids": last["output_ids"],
        "cached_tokens": last["meta_info"]["cached_tokens"],
        "prompt_tokens": len(ids),
    }


def conversation(client: httpx.Client, rng: random.Random, vocab: int, args) -> list[dict]:
    ids = [rng.randrange(vocab) for _ in range(args.first_tokens)]
    turns = []
    for _ in range(args.turns):
        turn = generate(client, ids, args.answer_tokens)
        turns.append(turn)
        ids = ids + turn["output_ids"] + [rng.randrange(vocab) for _ in range(args.turn_tokens)]
    return turns


def measure(url: str, args) -> dict:
    with httpx.Client(base_url=url, timeout=args.timeout) as client:
        vocab = client.get("/server_info").json()["vocab_size"]
        rng = random.Random(args.seed)
        warm = conversation(client, rng, vocab, args)
        turns = conversation(client, rng, vocab, args)
        prefilled = [t["prompt_tokens"] - t["cached_tokens"] for t in turns[1:]]
        if [t["prompt_tokens"] - t["cached_tokens"] for t in warm[1:]] != prefilled:
            raise RuntimeError("the warm-up turns prefilled other lengths than the measured ones")
        colds = []
        for n in prefilled:
            generate(client, [rng.randrange(vocab) for _ in range(n)], 1)  # warm-up
            cold = generate(client, [rng.randrange(vocab) for _ in range(n)], 1)
            if cold["cached_tokens"]:
                raise RuntimeError(
                    f"a cold prompt of {n} random ids reused {cold['cached_tokens']}"
                )
            colds.append(cold)
        server = client.get("/server_info").json()
    return {"turns": turns, "colds": colds, "server": server}


def start_demo(args, tmp: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "glm53", "serve", "--demo", "--engine", "cpu", "--port", str(port)]
    cmd += ["--chunk-size", str(args.chunk_size), "--max-batch", "1", "--log-level", "warning"]
    cmd += ["-cs", str(args.context)]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    log = tmp / "server.log"
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become ready:\n{log.read_text()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running glm53 server")
    where.add_argument("--demo", action="store_true", help="start `glm53 serve --demo` (CPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--first-tokens", type=int, default=8192, help="turn 1 prompt (default 8192)")
    p.add_argument("--turn-tokens", type=int, default=64, help="new ids per later turn (64)")
    p.add_argument("--answer-tokens", type=int, default=32, help="answer per turn (default 32)")
    p.add_argument("--turns", type=int, default=4, help="turns (default 4)")
    p.add_argument("--seed", type=int, default=0, help="random ids' seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800, help="per-request timeout (s)")
    p.add_argument("--chunk-size", type=int, default=2048, help="--demo: the server's chunk")
    p.add_argument("--context", type=int, default=16384, help="--demo: the server's context")
    p.add_argument("--cache-dir", help="--demo: the server's --cache-dir (the demo checkpoint)")
    args = p.parse_args()
    if args.turns < 2:
        p.error("--turns must be at least 2")

    proc = None
    with tempfile.TemporaryDirectory(prefix="glm53-prefix-") as tmp:
        try:
            if args.demo:
                proc, url = start_demo(args, Path(tmp))
            else:
                url = args.url.rstrip("/")
            result = measure(url, args)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)

    turns, colds, server = result["turns"], result["colds"], result["server"]
    later = [t["ttft_s"] for t in turns[1:]]
    cold_ttft = [c["ttft_s"] for c in colds]
    vs_cold = [t / c for t, c in zip(later, cold_ttft, strict=True)]
    figures = {
        "ttft_s_by_turn": [round(t["ttft_s"], 4) for t in turns],
        "prompt_tokens_by_turn": [t["prompt_tokens"] for t in turns],
        "cached_tokens_by_turn": [t["cached_tokens"] for t in turns],
        "prefilled_tokens_by_turn": [t["prompt_tokens"] - t["cached_tokens"] for t in turns],
        "cold_ttft_s_same_prefill": [round(c, 4) for c in cold_ttft],
        "later_vs_cold_by_turn": [round(r, 3) for r in vs_cold],
    }
    ratios = {
        "ttft_first_vs_later": round(turns[0]["ttft_s"] / statistics.median(later), 3),
        "later_vs_cold_same_prefill": round(statistics.median(vs_cold), 3),
    }
    out = {
        "bench": "prefix_cache",
        "figures": figures,
        "ratios": ratios,
        "config": {
            "target": "demo" if args.demo else url,
            "engine": server.get("engine"),
            "chunk_size": server["settings"]["chunk_size"]["value"],
            "prefix_cache_gb": server["settings"]["prefix_cache_gb"]["value"],
            "first_tokens": args.first_tokens,
            "turn_tokens": args.turn_tokens,
            "answer_tokens": args.answer_tokens,
            "turns": args.turns,
            "seed": args.seed,
            "goals": "CPU demo: ttft_first_vs_later >= 10; GPU: later_vs_cold_same_prefill <= 1.2",
            **host_fields(),
        },
    }
    if not args.json:
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft s':>8} {'cold s':>8} {'ratio':>6}")
        for i, t in enumerate(turns):
            cold = f"{cold_ttft[i - 1]:>8.3f} {vs_cold[i - 1]:>6.2f}" if i else ""
            print(
                f"{i + 1:>4} {t['prompt_tokens']:>7} {t['cached_tokens']:>7} "
                f"{t['ttft_s']:>8.3f} {cold}"
            )
        print(f"turn 1 / median later: {ratios['ttft_first_vs_later']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
