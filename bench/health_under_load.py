"""How long /health takes while the server prepares large requests: a real `glm53 serve` with
the scripted engine on 127.0.0.1, the load of tests/test_api_stall.py (two ~3M-character
completions prompts, two chats of 2,000 tool-call pairs, an 8,000-property schema with n=4),
and /health polled every --poll-ms from a thread of this process while the load is in flight
(the bodies are encoded before each round, so that this process's GIL is free for the poller).
The test asserts only a generous liveness bound; the target here is issue #24's: /health
within 100 ms. `--only` runs one kind of request at a time, to find which one stalls.

    python bench/health_under_load.py [--json] [--reps 2] [--only completion|chat|schema]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from benchlib import host_fields
from server_overhead import free_port, make_checkpoint, start_server

MODEL = "glm-5.3-flash"
TARGET_MS = 100.0


def load(only: str | None) -> list[tuple[str, dict]]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "héllo", "world", "x1", "42"]
    prompt = " ".join(rng.choice(words) for _ in range(600_000))
    messages = [{"role": "user", "content": "go"}]
    for i in range(2000):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"r{i}"})
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8000)}}
    kinds = {
        "completion": [("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})] * 2,
        "chat": [("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})] * 2,
        "schema": [("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "n": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "wide", "schema": schema}}})],
    }  # fmt: skip
    return [r for kind, reqs in kinds.items() if only in (None, kind) for r in reqs]


def encoded(requests: list[tuple[str, dict]]) -> list[tuple[str, bytes]]:
    """The bodies as httpx's `json=` writes them. Encoded before a round: json.dumps of a 3 MB
    body held this process's GIL up to 55 ms, and the poller's own wait for it was counted
    as /health's latency."""
    return [(path, json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False).encode()) for path, body in requests]  # fmt: skip


def one_round(url: str, requests: list[tuple[str, bytes]], poll_ms: float) -> dict:
    """The load sent at once; /health polled until every request has answered."""
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=300) as http, ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        heavy = [pool.submit(http.post, path, content=body, headers=headers)
                 for path, body in requests]  # fmt: skip
        polls = []
        while True:  # at least one poll, then until every request has answered
            t0 = time.monotonic()
            status = http.get("/health", timeout=60).status_code
            polls.append(((t0 - start) * 1e3, (time.monotonic() - t0) * 1e3, status))
            if all(f.done() for f in heavy):
                break
            time.sleep(poll_ms / 1e3)
        codes = [f.result().status_code for f in heavy]
    return {"polls": polls, "codes": codes, "load_s": time.monotonic() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument("--only", choices=["completion", "chat", "schema"])
    args = ap.parse_args()
    requests = encoded(load(args.only))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "checkpoint").mkdir()
        checkpoint = make_checkpoint(tmp_path / "checkpoint")
        script = tmp_path / "script.json"
        script.write_text(json.dumps({"default": "</think>ok"}), encoding="utf-8")
        port = free_port()
        proc = start_server(checkpoint, script, port, 8, tmp_path / "server.log")
        try:
            rounds = [one_round(f"http://127.0.0.1:{port}", requests, args.poll_ms)
                      for _ in range(args.reps)]  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    lat = sorted(ms for r in rounds for _, ms, _ in r["polls"])
    worst = max((p for r in rounds for p in r["polls"]), key=lambda p: p[1])
    pct = statistics.quantiles(lat, n=100) if len(lat) >= 2 else lat * 99
    figures = {
        "health_polls": len(lat),
        "health_median_ms": statistics.median(lat),
        "health_p90_ms": pct[89],
        "health_p99_ms": pct[98],
        "health_max_ms": lat[-1],
        "health_worst_at_ms": worst[0],  # when in its round the worst poll started
        "health_non_200": sum(s != 200 for r in rounds for *_, s in r["polls"]),
        "load_s": [r["load_s"] for r in rounds],
        "load_status_codes": [r["codes"] for r in rounds],
    }
    result = {
        "bench": "health_under_load",
        "config": {**host_fields(), "only": args.only, "reps": args.reps,
                   "poll_ms": args.poll_ms, "target_ms": TARGET_MS, "bodies": "encoded first"},
        "figures": figures,
        "ratios": {"health_max_vs_target": lat[-1] / TARGET_MS, "health_p99_vs_target": pct[98] / TARGET_MS},
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in figures.items():
            print(f"{k:24s} {v}")
        slow = sorted(((ms, i, at) for i, r in enumerate(rounds) for at, ms, _ in r["polls"]),
                      reverse=True)[:5]  # fmt: skip
        print(
            "slowest polls (ms, round, started at ms):",
            [(round(a), i, round(b)) for a, i, b in slow],
        )
        print(f"max / {TARGET_MS:.0f} ms target: {result['ratios']['health_max_vs_target']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
