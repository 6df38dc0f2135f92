"""Decode tok/s with and without logprobs, side by side on one server: the same greedy
/generate request (fixed length: ignore_eos) alternates between plain and `return_logprob`
with `top_logprobs_num` K, for R rounds; the figure is each side's median tok/s over the
generated tokens (prefill included, so keep the prompt short), the ratio logprobs / plain.

    python bench/logprobs_overhead.py --url http://127.0.0.1:30000 [--top-k 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
from benchlib import host_fields


def timed(client: httpx.Client, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    response = client.post("/generate", json=body)
    response.raise_for_status()
    seconds = time.perf_counter() - start
    out = response.json()
    return out["meta_info"]["completion_tokens"] / seconds, out


def top_counts(out: dict) -> list[int]:
    """How many top logprobs each generated token came with."""
    return [len(t or []) for t in out["meta_info"].get("output_top_logprobs") or []]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of requests")
    parser.add_argument("--top-k", type=int, default=5, help="top_logprobs_num")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    plain = {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True},
    }
    with_lp = {**plain, "return_logprob": True, "top_logprobs_num": args.top_k}
    rates: dict[str, list[float]] = {"plain": [], "logprobs": []}
    with httpx.Client(base_url=args.url, headers=headers, timeout=None) as client:
        info = client.get("/server_info").json()
        _, ref = timed(client, plain)  # warm-up, both shapes
        _, ref_lp = timed(client, with_lp)
        # asking for logprobs must not change a greedy answer, and every token gets its top K
        same_tokens = ref_lp["output_ids"] == ref["output_ids"]
        full_tops = top_counts(ref_lp) == [args.top_k] * len(ref_lp["output_ids"])
        for _ in range(args.rounds):
            rates["plain"].append(timed(client, plain)[0])
            rates["logprobs"].append(timed(client, with_lp)[0])
    medians = {k: statistics.median(v) for k, v in rates.items()}
    out = {
        "bench": "logprobs_overhead",
        "figures": {
            "tok_s_plain": medians["plain"],
            "tok_s_logprobs": medians["logprobs"],
            "runs": rates,
            "same_tokens_with_logprobs": same_tokens,
            "every_token_has_top_k": full_tops,
        },
        "ratios": {"logprobs_over_plain": medians["logprobs"] / medians["plain"]},
        "config": {
            "url": args.url,
            "engine": info.get("engine"),
            "tokens": args.tokens,
            "rounds": args.rounds,
            "top_k": args.top_k,
            **host_fields(),
        },
    }
    if not args.json:
        print(
            f"plain {medians['plain']:.1f} tok/s, logprobs (top {args.top_k}) "
            f"{medians['logprobs']:.1f} tok/s: {out['ratios']['logprobs_over_plain']:.3f}"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
