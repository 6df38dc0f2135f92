"""`glm53 synth`: write a synthetic GLM-5.3-Flash EXL3 checkpoint (demo, slice or deep preset)."""

from __future__ import annotations

import argparse
import os
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "synth",
        help="write a synthetic GLM-5.3-Flash EXL3 checkpoint",
        description="Write a random-weight checkpoint with GLM-5.3-Flash's architecture and file "
        "layout, loadable by exllamav3 1.6.5 and by glm53's CPU engine. See docs/synthetic.md.",
    )
    p.add_argument(
        "--preset",
        choices=("demo", "slice", "deep"),
        default="demo",
        help="demo: tiny, CPU-friendly; slice: real widths, 8 layers; deep: real widths and the "
        "real 45 layers, 64 experts per layer unless --experts (default demo)",
    )
    p.add_argument("--out", required=True, help="output directory (created; must be empty)")
    p.add_argument(
        "--seed", type=int, default=0, help="random seed; same seed, same bytes (default 0)"
    )
    p.add_argument(
        "--routing",
        choices=("uniform", "glm53"),
        default="glm53",
        help="router skew: glm53 (the real model's popularity curve) or uniform",
    )
    p.add_argument("--layers", type=int, help="number of layers (override)")
    p.add_argument("--dense-layers", type=int, help="leading dense-MLP layers (override)")
    p.add_argument("--experts", type=int, help="routed experts per MoE layer (override)")
    p.add_argument("--top-k", type=int, help="experts per token (override)")
    p.add_argument("--bits", type=int, help="EXL3 bits per weight K, 1..8 (default 3)")
    p.add_argument("--head-bits", type=int, help="lm_head bits (default 6)")
    p.add_argument("--shard-mb", type=int, default=2048, help="shard size in MiB (default 2048)")
    p.add_argument(
        "--jobs",
        type=int,
        help="shards written at a time, in worker processes (default: CPUs, at most 8); "
        "the bytes do not depend on it",
    )
    p.add_argument(
        "--routing-source",
        choices=("auto", "decode", "stand-in"),
        default="auto",
        help="fit the router on the checkpoint's own greedy decoding (decode: CPU-sized "
        "checkpoints only) or on stand-in inputs only; auto: decode for demo (default)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from glm53.synth.shapes import preset
    from glm53.synth.writer import write_checkpoint

    shape = preset(
        args.preset,
        num_layers=args.layers,
        num_dense_layers=args.dense_layers,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        bits=args.bits,
        head_bits=args.head_bits,
    )
    start = time.monotonic()
    report = write_checkpoint(
        shape,
        args.out,
        seed=args.seed,
        routing_mode=args.routing,
        shard_bytes=args.shard_mb << 20,
        routing_source=args.routing_source,
        jobs=args.jobs or min(8, os.cpu_count() or 1),
    )
    print(f"wrote {shape.name} checkpoint to {args.out} in {time.monotonic() - start:.1f} s")
    for line in report.lines():
        print(line)
    return 0
