"""Score a running server against a reference panel, teacher-forced through its API: each
prompt goes to /v1/completions as token ids with echo, max_tokens 0 and logprobs k (tokens as
ids), and each position's top-k is compared with the panel's: top-1 agreement, KL(reference ||
server) on the reference's top-k support (glm53.reference.top_k_kl), and the worst positions.

    python bench/score_ref_panel.py --url http://127.0.0.1:30000 --panel reference/demo-panel.json [--json]

Against a panel made by the same engine on the same checkpoint (the committed demo panel and
the CPU engine) this is a self-consistency check of the tooling: top-1 1.0 and KL 0 up to the
rounding of chunked prefill against one cache-free forward.
"""

from __future__ import annotations

import argparse
import json

import httpx
from benchlib import host_fields, server_top_k

from glm53.reference import compare, read_panel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--panel", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--worst", type=int, default=5, help="worst positions to list")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    panel = read_panel(args.panel)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = []
    with httpx.Client(base_url=args.url, headers=headers, timeout=None) as client:
        info = client.get("/server_info").json()
        model = client.get("/v1/models").json()["data"][0]["id"]
        for prompt in panel.prompts:
            tops = server_top_k(client, model, prompt.token_ids, panel.top_k)
            for i, (ref, test) in enumerate(zip(prompt.positions, tops, strict=True)):
                rows.append((prompt.name, i, ref.top_ids, ref.top_logprobs, test))
    result = compare(rows, worst=args.worst)
    out = {
        "bench": "score_ref_panel",
        "figures": {
            "top1_agreement": result.top1_agreement,
            "kl_mean": result.kl_mean,
            "kl_max": result.kl_max,
            "kl_p99": result.kl_p99,
            "num_positions": result.num_positions,
            "num_missing_support": result.num_missing_support,
            "worst": result.worst,
        },
        "ratios": {"top1_agreement": result.top1_agreement},
        "config": {
            "url": args.url,
            "panel": args.panel,
            "panel_engine": panel.engine,
            "panel_fingerprint": panel.checkpoint_fingerprint,
            "panel_versions": panel.versions,
            "server_engine": info.get("engine"),
            "server_checkpoint": info.get("checkpoint"),
            "top_k": panel.top_k,
            **host_fields(),
        },
    }
    if not args.json:
        print(
            f"{result.num_positions} positions: top-1 {result.top1_agreement:.4f}, "
            f"KL mean {result.kl_mean:.3g} max {result.kl_max:.3g}"
        )
        for w in result.worst:
            print(f"  {w}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
