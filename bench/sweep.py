"""The seed's sweep protocol against a running glm53 server: prefill speed at long prompts, then
decode speed at 1, 2 and 4 concurrent streams, with TTFT. Never a max_tokens cap on the measured
answers: they run to EOS or to the end of the context (serve the demo with a small --context).

  prefill: --reps fresh prompts of uniformly random token ids per --prefill length, through
           streamed /generate; rate = prompt tokens / time to the first streamed token.
  decode:  --dec-reps rounds of C simultaneous chat streams (distinct prompts, greedy, thinking
           off); per stream = (tokens - 1) / (last - first token time), aggregate = all tokens /
           (last token - earliest first token).

    python bench/sweep.py [--url URL] [--prefill 8192 32768] [--conc 1 2 4] [--json] [--plot sweep.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time

import httpx

TOPICS = [
    "how a compiler works",
    "the water cycle",
    "public key cryptography",
    "the history of printing",
]


def prefill_once(client: httpx.Client, ids: list[int]) -> float:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    start = time.perf_counter()
    with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if '"error"' in line[:20]:
                    raise RuntimeError(line)
                return len(ids) / (time.perf_counter() - start)
    raise RuntimeError("the stream ended without an event")


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # The middle 80 % of the vocabulary: away from the special tokens at either end.
    return [rng.randrange(vocab_size // 10, vocab_size * 9 // 10) for _ in range(n)]


def decode_stream(client: httpx.Client, model: str, prompt: str, out: dict) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    start = time.perf_counter()
    times: list[float] = []
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and any(
                    chunk["choices"][0]["delta"].get(k) for k in ("content", "reasoning_content")
                ):
                    times.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - reported in the results
        out["error"] = f"{type(exc).__name__}: {exc}"
        return
    out.update(start=start, first=times[0] if times else None, last=times[-1] if times else None)


def decode_round(client: httpx.Client, model: str, conc: int, nonce: str, round_index: int) -> dict:
    outs = [{} for _ in range(conc)]
    threads = [
        threading.Thread(
            target=decode_stream,
            args=(
                client,
                model,
                f"[{nonce}-{round_index}-{i}] Write a detailed, well-structured explanation of "
                f"{TOPICS[i % len(TOPICS)]} (variant {i}).",
                outs[i],
            ),
        )
        for i in range(conc)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        return {"errors": errors}
    per_stream = [
        (o["tokens"] - 1) / (o["last"] - o["first"])
        for o in outs
        if o["tokens"] > 1 and o["last"] > o["first"]
    ]
    span = max(o["last"] for o in outs) - min(o["first"] for o in outs)
    return {
        "per_stream_tok_s": statistics.mean(per_stream) if per_stream else float("nan"),
        "aggregate_tok_s": sum(o["tokens"] for o in outs) / span if span > 0 else float("nan"),
        "ttft_s_max": max(o["first"] - o["start"] for o in outs),
        "tokens": [o["tokens"] for o in outs],
    }


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'glm53[bench]'") from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    prefill = result["figures"]["prefill_tok_s"]
    left.bar([str(k) for k in prefill], list(prefill.values()))
    left.set(title="prefill", xlabel="prompt tokens", ylabel="tok/s")
    decode = result["figures"]["decode"]
    concs = [int(c) for c in decode]
    right.plot(
        concs, [d["per_stream_tok_s"] for d in decode.values()], marker="o", label="per stream"
    )
    right.plot(
        concs, [d["aggregate_tok_s"] for d in decode.values()], marker="o", label="aggregate"
    )
    right.set(title="decode", xlabel="concurrent streams", ylabel="tok/s", xticks=concs)
    right.legend()
    fig.suptitle(f"glm53 sweep: {result['config']['engine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dec-reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write a PNG plot here")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    args = parser.parse_args()
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(
        base_url=args.url, headers=headers, timeout=None, limits=httpx.Limits(max_connections=64)
    ) as client:
        info = client.get("/server_info").json()
        model = client.get("/v1/models").json()["data"][0]["id"]
        context, vocab = info["context_length"], info["vocab_size"]
        rng = random.Random(args.seed)
        prefill_once(client, random_ids(rng, min(512, context - 2), vocab))  # warm-up, not recorded
        prefill: dict[int, list[float]] = {}
        skipped = [n for n in args.prefill if n >= context]
        for n in (n for n in args.prefill if n < context):
            prefill[n] = [
                prefill_once(client, random_ids(random.Random(args.seed * 1000 + n + r), n, vocab))
                for r in range(args.reps)
            ]
        nonce = f"{rng.getrandbits(32):08x}"
        decode = {
            c: [decode_round(client, model, c, nonce, r) for r in range(args.dec_reps)]
            for c in args.conc
        }

    figures: dict = {"prefill_tok_s": {}, "prefill_all": {}, "decode": {}}
    for n, rates in prefill.items():
        figures["prefill_tok_s"][n] = round(statistics.median(rates), 2)
        figures["prefill_all"][n] = [round(r, 2) for r in rates]
    errors = []
    for c, rounds in decode.items():
        good = [r for r in rounds if "errors" not in r]
        errors += [e for r in rounds for e in r.get("errors", [])]
        if good:
            figures["decode"][c] = {
                "per_stream_tok_s": round(
                    statistics.median(r["per_stream_tok_s"] for r in good), 3
                ),
                "aggregate_tok_s": round(statistics.median(r["aggregate_tok_s"] for r in good), 3),
                "ttft_s_max": round(max(r["ttft_s_max"] for r in good), 3),
                "tokens": [r["tokens"] for r in good],
            }
    base = figures["decode"].get(min(figures["decode"]) if figures["decode"] else None)
    result = {
        "bench": "sweep",
        "figures": figures,
        "ratios": {
            f"aggregate_c{c}_over_c1": round(d["aggregate_tok_s"] / base["aggregate_tok_s"], 3)
            for c, d in figures["decode"].items()
            if base and base["aggregate_tok_s"]
        },
        "config": {
            "url": args.url,
            "engine": info.get("engine"),
            "engine_description": info.get("engine_description"),
            "context_length": context,
            "prefill": args.prefill,
            "prefill_skipped_over_context": skipped,
            "reps": args.reps,
            "conc": args.conc,
            "dec_reps": args.dec_reps,
            "seed": args.seed,
            "errors": errors,
            "host": platform.node(),
        },
    }
    if args.plot:
        plot(result, args.plot)
    if not args.json:
        for n, rate in figures["prefill_tok_s"].items():
            print(f"prefill {n:>7} tokens: {rate:>10.1f} tok/s  (runs {figures['prefill_all'][n]})")
        for c, d in figures["decode"].items():
            print(
                f"decode  {c:>3} streams: {d['per_stream_tok_s']:>8.2f} tok/s per stream, "
                f"{d['aggregate_tok_s']:>8.2f} aggregate, TTFT max {d['ttft_s_max']:.2f} s"
            )
        for e in errors:
            print("error:", e)
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
