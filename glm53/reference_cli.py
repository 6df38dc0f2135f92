"""`glm53 reference make`: write a reference panel (glm53.reference, reference/README.md) from a
checkpoint, teacher-forced: each prompt runs as one cache-free forward of all its tokens.

Engines: `cpu` is glm53's CPU engine (transformers' glm5_next text model; for the demo and other
CPU-sized checkpoints); `stock-exllamav3` is exllamav3 1.6.5 as shipped, every weight in VRAM
(needs a CUDA GPU and the gpu extra), the reference for exact mode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# The default prompts: short, of different kinds, so a panel covers prose, code, lists and
# the chat markup without a prompts file.
DEFAULT_PROMPTS = (
    ("prose", "The river ran quietly past the old mill, and the miller watched the water turn"),
    ("code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +"),
    ("list", "Shopping list:\n1. eggs\n2. flour\n3. milk\n4."),
    ("chat", "[gMASK]<sop><|user|>What is the capital of France?<|assistant|><think>"),
    ("numbers", "1, 2, 3, 5, 8, 13, 21, 34, 55, 89,"),
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "reference",
        help="write reference panels (teacher-forced top-k logprobs) for fidelity checks",
        description="Reference panels for bench/score_ref_panel.py; see reference/README.md.",
    )
    sub = p.add_subparsers(dest="reference_command", metavar="ACTION", required=True)
    make = sub.add_parser("make", help="write a panel from a checkpoint")
    make.add_argument("--model", required=True, help="checkpoint directory")
    make.add_argument(
        "--engine",
        choices=("cpu", "stock-exllamav3"),
        required=True,
        help="cpu: glm53's CPU engine; stock-exllamav3: exllamav3 on a CUDA GPU",
    )
    make.add_argument("--out", required=True, help="panel file to write (JSON)")
    make.add_argument(
        "--prompts",
        help='JSON file: a list of {"name", "text"} or {"name", "token_ids"} '
        "(default: five built-in prompts)",
    )
    make.add_argument(
        "--top-k", type=int, default=20, help="logprobs kept per position, 1..20 (default 20)"
    )
    make.set_defaults(func=run)
    cmp = sub.add_parser(
        "compare",
        help="compare two panels of the same checkpoint and prompts (e.g. two stock runs)",
        description="Top-1 agreement and top-k KL of panel B against panel A, position by "
        "position; both must name the same checkpoint and hold the same prompt tokens.",
    )
    cmp.add_argument("a", help="reference panel (JSON)")
    cmp.add_argument("b", help="panel compared with it (JSON)")
    cmp.add_argument("--worst", type=int, default=5, help="worst positions to list")
    cmp.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    """Print one JSON object: the comparison, and the largest logprob difference on the ids
    both panels list at a position."""
    import msgspec

    from glm53.reference import compare, read_panel

    a, b = read_panel(args.a), read_panel(args.b)
    if a.checkpoint_fingerprint != b.checkpoint_fingerprint:
        raise SystemExit(
            f"{args.b} is of another checkpoint than {args.a} (fingerprints "
            f"{b.checkpoint_fingerprint[:12]} and {a.checkpoint_fingerprint[:12]}): compare "
            "panels of one checkpoint"
        )
    rows, max_diff = [], 0.0
    for pa, pb in zip(a.prompts, b.prompts, strict=False):
        if (pa.name, pa.token_ids) != (pb.name, pb.token_ids) or len(a.prompts) != len(b.prompts):
            raise SystemExit(
                f"the panels hold other prompts ({pa.name!r} and {pb.name!r}): make both from "
                "the same --prompts"
            )
        for i, (x, y) in enumerate(zip(pa.positions, pb.positions, strict=True)):
            test = dict(zip(y.top_ids, y.top_logprobs, strict=True))
            rows.append((pa.name, i, x.top_ids, x.top_logprobs, test))
            shared = [
                abs(v - test[t])
                for t, v in zip(x.top_ids, x.top_logprobs, strict=True)
                if t in test
            ]
            max_diff = max([max_diff, *shared])
    out = msgspec.to_builtins(compare(rows, args.worst))
    out["max_abs_logprob_diff_shared_ids"] = max_diff
    out["identical"] = all(
        pa.positions == pb.positions for pa, pb in zip(a.prompts, b.prompts, strict=True)
    )
    print(json.dumps(out))
    return 0


def _prompts(path: str | None, tokenizer) -> list[tuple[str, list[int]]]:
    if path is None:
        items = [{"name": n, "text": t} for n, t in DEFAULT_PROMPTS]
    else:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for i, item in enumerate(items):
        if "token_ids" in item:
            ids = [int(t) for t in item["token_ids"]]
        elif "text" in item:
            ids = tokenizer.encode(item["text"])
        else:
            raise ValueError(f"prompt {i} of {path} has neither text nor token_ids")
        if len(ids) < 2:
            raise ValueError(
                f"prompt {i} ({item.get('name')}) has under 2 tokens: nothing to score"
            )
        out.append((str(item.get("name", i)), ids))
    return out


def _cpu_logits(model_dir: str):
    from glm53.engine.cpu import CpuEngine
    from glm53.engine.cpu_options import CpuEngineOptions

    engine = CpuEngine(model_dir, CpuEngineOptions(max_batch=1))
    engine.load()

    def logits(ids: list[int]):
        return engine.forward_all(ids)

    return logits, engine.close


def _stock_logits(model_dir: str):
    import torch

    from glm53 import exl3

    loaded = exl3.load(model_dir, exl3.LoadOptions(mode="stock", cache_tokens=8192, max_batch=1))

    @torch.inference_mode()
    def logits(ids: list[int]):
        return loaded.model.forward(torch.tensor([ids], dtype=torch.long), {})[0].float().cpu()

    return logits, loaded.close


def run(args: argparse.Namespace) -> int:
    from glm53.engine.logprobs import log_softmax, top_k
    from glm53.engine.tokenizer import CheckpointTokenizer
    from glm53.reference import (
        FORMAT,
        Panel,
        PanelPrompt,
        Position,
        fingerprint,
        versions,
        write_panel,
    )

    if not 1 <= args.top_k <= 20:
        raise SystemExit(f"--top-k {args.top_k}: must be 1..20 (the API's top_logprobs range)")
    start = time.monotonic()
    tokenizer = CheckpointTokenizer.from_dir(args.model)
    prompts = _prompts(args.prompts, tokenizer)
    logits_of, close = (
        _cpu_logits(args.model) if args.engine == "cpu" else _stock_logits(args.model)
    )
    try:
        out = []
        for name, ids in prompts:
            # the server's own log-softmax and top-k (glm53.engine.logprobs): equal logits
            # then give equal logprobs, bit for bit, and a KL of exactly 0
            lp = log_softmax(logits_of(ids).float().numpy())[:-1]
            out.append(PanelPrompt(name, ids, [Position(*top_k(row, args.top_k)) for row in lp]))
    finally:
        close()
    panel = Panel(
        format=FORMAT,
        engine=args.engine,
        checkpoint_fingerprint=fingerprint(args.model),
        checkpoint_name=Path(args.model).absolute().name,
        versions=versions(args.engine),
        top_k=args.top_k,
        prompts=out,
    )
    write_panel(panel, args.out)
    n = sum(len(p.positions) for p in out)
    print(
        f"wrote {args.out}: {len(out)} prompts, {n} positions, top {args.top_k}, "
        f"engine {args.engine}, in {time.monotonic() - start:.1f} s"
    )
    return 0
