"""Diagnosis on a GPU: exact mode's cache-free forward (what prompt logprobs and
`glm53 reference make` run) against stock exllamav3's with every expert in VRAM, in one process.

    python tools/diag_forward_parity.py MODEL_DIR OUT.json [--slots N]

For each prompt length, random ids: stock's logits twice (its own determinism), exact's on a cold
cache, then again after 64 single-token forwards (decode-shaped calls that admit experts into
the VRAM cache). Reports torch.equal and the max |difference| for each.
"""

from __future__ import annotations

import argparse
import json

LENGTHS = (1, 2, 5, 8, 9, 16, 25, 64, 128, 200, 255, 256, 300, 1000)


def main() -> int:
    import torch

    from glm53.engine import exl3_load

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--slots", type=int, default=197)
    a = ap.parse_args()
    stock = exl3_load.load(a.model, "stock", cache_tokens=8192, max_batch=1)
    exact = exl3_load.load(a.model, "exact", cache_tokens=8192, max_batch=4, ec_max_slots=a.slots)
    vocab = stock.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (1, n), generator=gen) for n in LENGTHS}

    def fwd(loaded, ids):
        return loaded.model.forward(ids, {})[0].float().cpu()

    rows = []
    ref = {n: fwd(stock, ids) for n, ids in prompts.items()}
    cold = {n: fwd(exact, ids) for n, ids in prompts.items()}
    for _ in range(64):
        fwd(exact, torch.randint(0, vocab, (1, 1), generator=gen))
    warm = {n: fwd(exact, ids) for n, ids in prompts.items()}
    again = {n: fwd(stock, ids) for n, ids in prompts.items()}
    for n in LENGTHS:
        row = {"length": n}
        for name, got in (("stock_again", again), ("exact_cold", cold), ("exact_warm", warm)):
            row[name + "_equal"] = bool(torch.equal(ref[n], got[n]))
            row[name + "_max_diff"] = float((ref[n] - got[n]).abs().max())
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "slots": a.slots, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
