"""GPU benchmark of the layer split over two GPUs (issue #20), side by side with its anchor, one
GPU holding the same total cache, in the same run. NOT YET RUN: written in a session without
GPU time (docs/multi-gpu.md); the issue's run is `bench/results/h200x2-multi_gpu-*.json`.

Rows, exact mode on the slice or deep checkpoint (decode at concurrency 1 and 4, 512-token
prompts, greedy; prefill at 512 and 8k in 2,048-token chunks):
  one_gpu        one GPU, a VRAM cache of --share of the experts (default 11.4 %, the 24 GB
                 RTX 3090's share);
  one_gpu_same   one GPU, a cache of 2 x --share (what two such cards hold together);
  split          the layers over --gpus (default 0,1; 0,0 runs the split path on one GPU),
                 a cache of 2 x --share in all, each GPU's over its own MoE layers.
ratios.two_gpu_vs_one_gpu_same_cache is split / one_gpu_same at c1 (the issue's goal: >= 0.9);
the c4 ratio and split / one_gpu sit beside it, and doctor's prediction of the first ratio
(cost model plus the hop, glm53/doctor/multi_gpu.py) is in figures.predicted.

    python bench/multi_gpu.py --model DIR [--gpus 0,1] [--share 0.114] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from gpu_slice import (  # noqa: E402
    H200_FP16_TFLOPS,
    H200_PCIE_GBPS,
    H200_VRAM_GBPS,
    decode_run,
    prefill_run,
)

from glm53.doctor import costmodel  # noqa: E402
from glm53.doctor.geometry import geometry_of  # noqa: E402
from glm53.doctor.multi_gpu import HOP_LATENCY_MS  # noqa: E402
from glm53.plan.split import parse_gpus  # noqa: E402

CACHE_TOKENS, MAX_BATCH, MAX_CHUNK = 16384, 4, 2048


def row(args, gpus, slots) -> dict:
    """Load exact mode on `gpus` (None: one GPU) with `slots` expert slots in all, measure,
    unload."""
    from glm53.exl3 import loader as exl3_load
    from glm53.exl3.options import LoadOptions

    with torch.inference_mode():
        t0 = time.perf_counter()
        loaded = exl3_load.load(args.model, LoadOptions(
            mode="exact", cache_tokens=CACHE_TOKENS, max_batch=MAX_BATCH,
            max_chunk=MAX_CHUNK, ec_max_slots=slots, gpus=gpus,
        ))  # fmt: skip
        out = {"load_s": time.perf_counter() - t0, "decode": {}, "prefill": {}}
        vocab = loaded.config.vocab_size
        decode_run(loaded, vocab, 1, prompt_len=64, n_new=16)  # warm-up (JIT, graphs)
        for b in (1, 4):
            out["decode"][f"c{b}"] = decode_run(loaded, vocab, b, n_new=32 if args.quick else 128)
        for name, n in (("p512", 512), ("p8192", 8192)):
            prefill_run(loaded, vocab, n, seed=2, chunk=MAX_CHUNK)
            out["prefill"][name] = prefill_run(loaded, vocab, n, chunk=MAX_CHUNK)
        state = loaded.ec.state()
        out["cache"] = {k: v for k, v in state.items() if k != "layer_hit_rate"}
        out["slots"] = state["slots"]
        if loaded.split is not None:
            import msgspec

            out["split"] = msgspec.to_builtins(loaded.split)
        loaded.close()
        del loaded
        torch.cuda.empty_cache()
    return out


def predicted_ratio(args, slots: int, boundaries: int) -> dict:
    """doctor's prediction: one GPU with `slots` against the split with the same slots and
    `boundaries` hops of one token's hidden state over PCIe."""
    geo = geometry_of(args.model)
    x = costmodel.CostInputs(vram_slots=slots, pcie_gbps=H200_PCIE_GBPS,
                             vram_gbps=H200_VRAM_GBPS, gpu_fp16_tflops=H200_FP16_TFLOPS)  # fmt: skip
    same = costmodel.predict(costmodel.Mode.EXACT, x, geo).ms_per_token
    hop = HOP_LATENCY_MS + 4 * geo.hc_mult * geo.hidden_size / (H200_PCIE_GBPS * 1e6)
    return {"one_gpu_same_ms": same, "hop_ms": boundaries * hop,
            "two_gpu_vs_one_gpu_same_cache": same / (same + boundaries * hop)}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"))
    ap.add_argument("--gpus", default="0,1", help="the split's --gpus (0,0: both on GPU 0)")
    ap.add_argument("--share", type=float, default=0.114)
    ap.add_argument("--quick", action="store_true", help="32 decode tokens instead of 128")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.model or not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error("--model DIR (or GLM53_TEST_SLICE): a slice or deep checkpoint")
    gpus = list(parse_gpus(args.gpus))
    if not torch.cuda.is_available() or max(gpus) >= torch.cuda.device_count():
        ap.error(f"--gpus {args.gpus}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    geo = geometry_of(args.model)
    slots = max(8, int(args.share * geo.total_experts))
    rows = {
        "one_gpu": row(args, None, slots),
        "one_gpu_same": row(args, None, 2 * slots),
        "split": row(args, gpus, 2 * slots),
    }
    for name, r in rows.items():
        print(f"# {name}: {json.dumps(r['decode'], default=float)}", flush=True)

    def c(name, b):
        return rows[name]["decode"][f"c{b}"]["per_stream_tok_s"]

    boundaries = rows["split"]["split"]["boundaries"]
    ratios = {
        "two_gpu_vs_one_gpu_same_cache": c("split", 1) / c("one_gpu_same", 1),
        "two_gpu_vs_one_gpu_same_cache_c4": c("split", 4) / c("one_gpu_same", 4),
        "two_gpu_vs_one_gpu": c("split", 1) / c("one_gpu", 1),
        "prefill_8192_two_gpu_vs_one_gpu_same_cache": rows["split"]["prefill"]["p8192"]
        / rows["one_gpu_same"]["prefill"]["p8192"],
    }
    figures = {
        "rows": rows,
        "predicted": predicted_ratio(args, 2 * slots, boundaries),
    }
    config = {
        **benchlib.host_fields(),
        "model": args.model,
        "gpus": gpus,
        "share": args.share,
        "slots_per_share": slots,
        "devices": [torch.cuda.get_device_name(g) for g in dict.fromkeys(gpus)],
        "cache_tokens": CACHE_TOKENS,
        "max_batch": MAX_BATCH,
        "chunk": MAX_CHUNK,
    }
    result = {"bench": "multi_gpu", "figures": figures, "ratios": ratios, "config": config}
    if not args.json:
        for name in rows:
            print(f"{name:14} c1 {c(name, 1):8.1f}  c4 {c(name, 4):8.1f} tok/s per stream")
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
