"""Anchor: stock exllamav3 1.6.5's own expert offload (`moe_cpu_split`: the last N experts of
every MoE layer on the CPU worker, the rest in VRAM), optionally with its pinned arena, on the
same checkpoint and protocol as bench/gpu_slice.py. Runs the segfault workaround in
bench/anchors/sitecustomize.py (EXL3_MOE_CPU_PIN=0 + a sysfs core order, parent and worker).

    python bench/exl3_offload.py --model DIR --split N [--pinned-arena] [--stream-t T]
                                 [--cache-tokens N] [--long-prefill] --json

--stream-t T sets EXL3_MOE_STREAM_T: in prefill, an expert that T or more tokens of a chunk pick
is streamed to the GPU and computed there (unset, exllamav3 scales its threshold from 8 by the
link's measured rate). --long-prefill adds gpu_slice's 32k prefill row (the cache must hold it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_child(args) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from exllamav3 import Cache, Config, Model, Tokenizer
    from gpu_slice import measure, prefill_shapes

    from glm53.exl3.loaded import Loaded, moe_geometry

    with torch.inference_mode():
        config = Config.from_directory(args.model)
        geo = moe_geometry(config.stc)
        model = Model.from_config(config)
        cache = Cache(model, max_num_tokens=args.cache_tokens, max_batch_size=4)
        model.load("cuda:0")
        loaded = Loaded("stock-offload", config, model, cache, Tokenizer.from_config(config), geo)
        shapes = prefill_shapes(args.long_prefill, None)
        out = measure(loaded, config.vocab_size, args.quick, shapes=shapes)
        model.unload()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--split", type=int, required=True, help="experts per layer on the CPU")
    ap.add_argument("--pinned-arena", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stream-t", type=int, default=None, help="EXL3_MOE_STREAM_T (default unset)")
    ap.add_argument("--cache-tokens", type=int, default=16384)
    ap.add_argument("--long-prefill", action="store_true", help="gpu_slice's 32k prefill row too")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for the measuring child")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args), default=float))
        return 0
    env = dict(os.environ)
    env.update(
        EXL3_MOE_CPU_SPLIT=str(args.split),
        EXL3_MOE_PINNED_ARENA="1" if args.pinned_arena else "0",
        EXL3_MOE_CPU_PIN="0",
        GLM53_EXL3_CORE_ORDER_FIX="1",
        PYTHONPATH=os.path.join(HERE, "anchors") + os.pathsep + env.get("PYTHONPATH", ""),
    )
    if args.stream_t is not None:
        env["EXL3_MOE_STREAM_T"] = str(args.stream_t)
    cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--split",
           str(args.split), "--child", "--cache-tokens", str(args.cache_tokens)]  # fmt: skip
    cmd += (["--quick"] if args.quick else []) + (["--long-prefill"] if args.long_prefill else [])
    rc = 124
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired as exc:  # its output is bytes even with text=True
        tail = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")[-2000:]
        result = {"error": f"stock offload timed out after {args.timeout} s", "tail": tail}
    else:
        if rc != 0:
            tail = (p.stdout + p.stderr)[-2000:]
            result = {"error": f"stock offload exited {rc}", "tail": tail}
        else:
            result = json.loads(p.stdout.strip().splitlines()[-1])
    out = {
        "bench": "exl3_offload",
        "figures": result,
        "ratios": {},
        "config": {"split": args.split, "pinned_arena": args.pinned_arena,
                   "stream_t": args.stream_t, "cache_tokens": args.cache_tokens,
                   "workaround": "EXL3_MOE_CPU_PIN=0 + sysfs exl3_moe_cpu_core_order"},
    }  # fmt: skip
    print(json.dumps(out, default=float))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
