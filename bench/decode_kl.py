"""Paired decode between two servers: A decodes each prompt greedily (its top-k logprobs at
every generated token), B is teacher-forced on A's tokens (/v1/completions echo of prompt +
A's tokens, max_tokens 0), and each generated position is compared: KL(A || B) on A's top-k
support (glm53.reference.top_k_kl) and top-1 agreement, with the mean and the tails.

    python bench/decode_kl.py --a http://127.0.0.1:30000 --b http://127.0.0.1:30001 [--json]

With A and B the same server this is its rounding floor: its decode (with the cache, one token
a step) against its own cache-free-order prefill of the same tokens.
"""

from __future__ import annotations

import argparse
import json

import httpx
from benchlib import host_fields, server_top_k, token_id_top

from glm53.reference import compare

PROMPTS = (
    "The river ran quietly past the old mill, and",
    "def parse(line):\n    key, value =",
    "Shopping list:\n1. eggs\n2.",
    "Once upon a time",
)


def decode(client: httpx.Client, model: str, prompt: str, n: int, k: int):
    """A's side: (prompt ids, generated ids, top-k at each generated token)."""
    ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": n,
        "temperature": 0,
        "logprobs": k,
        "return_tokens_as_token_ids": True,
    }
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    lp = response.json()["choices"][0]["logprobs"]
    generated = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    tops = []
    for token, value, top in zip(generated, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        entry = token_id_top(top)
        entry.setdefault(token, value)
        tops.append(entry)
    return ids, generated, tops


def teacher_forced(client: httpx.Client, model: str, ids: list[int], k: int):
    """B's side: top-k at every position of `ids` (index i scores token i; index 0 is None)."""
    return [None, *server_top_k(client, model, ids, k)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="URL of the server that decodes")
    parser.add_argument("--b", required=True, help="URL of the server that is teacher-forced")
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per prompt")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    with (
        httpx.Client(base_url=args.a, headers=headers, timeout=None) as a,
        httpx.Client(base_url=args.b, headers=headers, timeout=None) as b,
    ):
        model_a = a.get("/v1/models").json()["data"][0]["id"]
        model_b = b.get("/v1/models").json()["data"][0]["id"]
        engines = [
            a.get("/server_info").json().get("engine"),
            b.get("/server_info").json().get("engine"),
        ]
        for p, prompt in enumerate(PROMPTS):
            ids, generated, tops_a = decode(a, model_a, prompt, args.tokens, args.top_k)
            tops_b = teacher_forced(b, model_b, ids + generated, args.top_k)
            for j, top_a in enumerate(tops_a):
                ref_ids = sorted(top_a, key=lambda i: (-top_a[i], i))
                rows.append(
                    (f"prompt{p}", j, ref_ids, [top_a[i] for i in ref_ids], tops_b[len(ids) + j])
                )
    result = compare(rows)
    out = {
        "bench": "decode_kl",
        "figures": {
            "top1_agreement": result.top1_agreement,
            "kl_mean": result.kl_mean,
            "kl_p50": result.kl_p50,
            "kl_p90": result.kl_p90,
            "kl_p99": result.kl_p99,
            "kl_max": result.kl_max,
            "num_positions": result.num_positions,
            "worst": result.worst,
        },
        "ratios": {"top1_agreement": result.top1_agreement},
        "config": {
            "a": args.a,
            "b": args.b,
            "engines": engines,
            "tokens": args.tokens,
            "top_k": args.top_k,
            **host_fields(),
        },
    }
    if not args.json:
        print(
            f"{result.num_positions} positions: top-1 {result.top1_agreement:.4f}, KL mean "
            f"{result.kl_mean:.3g} p99 {result.kl_p99:.3g} max {result.kl_max:.3g}"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
