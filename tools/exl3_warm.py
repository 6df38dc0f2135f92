"""Pay a checkpoint's first-use compiles before the GPU tests do: stock exllamav3 1.6.5 loads it
and runs its own `Model.warmup` (single rows of 1 to 64 tokens, a whole chunk, batched and
single decode steps, the long-context family) and a cache-less forward of a chunk, as
test_exact_fidelity.py's teacher-forced check runs it. What it leaves behind is the Triton cache
(TRITON_CACHE_DIR) that later processes of the same machine load instead of compiling.

    python tools/exl3_warm.py CHECKPOINT [--chunk 2048] [--batch 4] [--cache-tokens 16384]

Never imports glm53. Its GEMM kernel picks go to EXLLAMAV3_TUNE_CACHE when that is set
(tools/gpu-check.sh sets one for the whole machine, so the warm-up's picks are the ones every
later reference process and engine reads), else to a temporary file of its own.
tools/gpu-check.sh runs it in the background for each checkpoint it synthesizes when STAGES has
"warm", so that the compiles overlap the next checkpoint's synthesis (CPU work).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cache-tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    if not os.environ.get("EXLLAMAV3_TUNE_CACHE"):
        tune = tempfile.mkdtemp(prefix="exl3-warm-tune-")
        os.environ["EXLLAMAV3_TUNE_CACHE"] = os.path.join(tune, "coop_autotune_v1.bin")

    import torch
    from exllamav3 import Cache, Config, Model

    t0 = time.monotonic()
    config = Config.from_directory(args.checkpoint)
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=args.cache_tokens, max_batch_size=args.batch)
    model.load("cuda:0", max_chunk_size=args.chunk)
    t_load = time.monotonic() - t0
    with torch.inference_mode():
        failures = model.warmup(cache=cache, max_chunk_size=args.chunk, max_batch_size=args.batch)
        g = torch.Generator().manual_seed(0)
        for n in (args.chunk, 256, 1):  # cache-less forwards (no params): the teacher-forced path
            model.forward(torch.randint(0, config.vocab_size, (1, n), generator=g), {})
        torch.cuda.synchronize()
    model.unload()
    print(f"warm {args.checkpoint}: load {t_load:.1f} s, warm-up {time.monotonic() - t0 - t_load:.1f} s"
          + (f", passes that raised: {failures}" if failures else ""))  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
