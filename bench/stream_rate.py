"""Is streaming delivery even? Streams one long answer from a running glm53 server through chat
SSE and through /generate SSE, and records when each piece of text arrives.

Reports, per endpoint: the share of the text that arrives in the last chunk and in the last
second, the share received by the time midpoint (even delivery gives about 0.5), and the gaps
between chunks. PASS when half_share >= 0.40 and last_chunk_share <= 0.10 on both endpoints.
No max_tokens cap: the answer ends at EOS or at the end of the context.

    python bench/stream_rate.py [--url http://127.0.0.1:30000] [--api-key KEY] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import httpx
from benchlib import sse_events

PROMPT = "Write an essay of at least 1200 words on the history of the printing press."


def chat_events(client: httpx.Client, model: str, prompt: str):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    for chunk in sse_events(client, "/v1/chat/completions", body):
        if chunk["choices"]:
            delta = chunk["choices"][0]["delta"]
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if text:
                yield time.perf_counter(), len(text)


def generate_events(client: httpx.Client, prompt: str):
    body = {"text": f"[gMASK]<sop><|user|>{prompt}<|assistant|><think></think>", "stream": True}
    body["sampling_params"] = {"temperature": 0}
    seen = 0
    for event in sse_events(client, "/generate", body):
        if len(event["text"]) > seen:  # events carry the cumulative text
            yield time.perf_counter(), len(event["text"]) - seen
            seen = len(event["text"])


def evenness(arrivals: list[tuple[float, int]]) -> dict:
    if len(arrivals) < 2:
        raise RuntimeError(
            f"only {len(arrivals)} text chunks arrived; the answer is too short to judge"
        )
    total = sum(n for _, n in arrivals)
    t0, t1 = arrivals[0][0], arrivals[-1][0]
    mid = (t0 + t1) / 2
    gaps = [(b[0] - a[0]) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "chars": total,
        "chunks": len(arrivals),
        "seconds": round(t1 - t0, 3),
        "half_share": round(sum(n for t, n in arrivals if t <= mid) / total, 4),
        "last_chunk_share": round(arrivals[-1][1] / total, 4),
        "last_second_share": round(sum(n for t, n in arrivals if t >= t1 - 1.0) / total, 4),
        "gap_ms_median": round(statistics.median(gaps), 3),
        "gap_ms_p99": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))], 3),
        "gap_ms_max": round(max(gaps), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=None) as client:
        info = client.get("/server_info").json()
        model = client.get("/v1/models").json()["data"][0]["id"]
        results = {
            "chat": evenness(list(chat_events(client, model, args.prompt))),
            "generate": evenness(list(generate_events(client, args.prompt))),
        }
    passed = all(
        r["half_share"] >= 0.40 and r["last_chunk_share"] <= 0.10 for r in results.values()
    )
    figures = {f"{ep}_{k}": v for ep, r in results.items() for k, v in r.items()}
    result = {
        "bench": "stream_rate",
        "figures": figures,
        "ratios": {
            f"{ep}_half_share_over_even": round(r["half_share"] / 0.5, 4)
            for ep, r in results.items()
        },
        "config": {
            "url": args.url,
            "engine": info.get("engine"),
            "engine_description": info.get("engine_description"),
            "pass": passed,
            "criteria": "half_share >= 0.40 and last_chunk_share <= 0.10 on both endpoints",
            "host": platform.node(),
        },
    }
    if not args.json:
        keys = list(results["chat"])
        print(f"{'':>10} " + " ".join(f"{k:>17}" for k in keys))
        for endpoint, r in results.items():
            print(f"{endpoint:>10} " + " ".join(f"{r[k]:>17}" for k in keys))
        print("PASS" if passed else "FAIL")
    print(json.dumps(result))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
