"""Exact-mode prefill against the size and kind of its staging buffers, on the slice checkpoint
(288 experts per MoE layer and 9 MiB records, as GLM-5.3-Flash). Rows, all in one run:

    off      no staging: every uncached expert is read zero-copy by the MoE kernels
    gather   --ec-stage-gb 2.25 with the SM gather copy (dma=False): the uncached experts of a
             layer, as many as a buffer holds, copied by a kernel on a side stream
    range    the same 2.25 GiB with one copy-engine transfer of each layer's first 128 records
             (the default when a quarter of the VRAM left is 2.25 GiB, e.g. 10 GiB free and the
             1 GiB reserve, which is about what a 24 GB card leaves after the model)
    whole    two whole layers (the default when they fit in a quarter of the VRAM left)

Each row: 8,192-token prompts at 2,048-token chunks and as one chunk, each warmed once first.

    python bench/prefill_staging.py --model SLICE [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import git_commit  # noqa: E402
from gpu_slice import prefill_run  # noqa: E402

ROWS = {
    "off": {"ec_stage_gb": 0.0},
    "gather": {"ec_stage_gb": 2.25, "stage_dma": False},
    "range": {"ec_stage_gb": 2.25, "stage_dma": True},
    "whole": {"ec_stage_gb": None},
}
PROMPTS = (("p8192", 8192, 2048), ("p8192_c8192", 8192, 8192))


def main() -> int:
    from exllamav3 import Config

    from glm53.exl3 import loader as exl3_load
    from glm53.exl3.loaded import moe_geometry
    from glm53.exl3.options import LoadOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"))
    ap.add_argument("--share", type=float, default=0.11375661375661375,
                    help="VRAM cache slots as a share of the routed experts (gpu_slice's)")  # fmt: skip
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.model:
        ap.error("--model (or GLM53_TEST_SLICE) must name the slice checkpoint")
    geo = moe_geometry(Config.from_directory(args.model).stc)
    slots = max(1, int(round(args.share * len(geo.moe_layers) * geo.n_experts)))
    started = time.perf_counter()
    rows: dict[str, dict] = {}
    for name in args.rows.split(","):
        kw = ROWS[name]
        row: dict = {}
        try:
            with torch.inference_mode():
                loaded = exl3_load.load(
                    args.model,
                    LoadOptions(
                        mode="exact", cache_tokens=16384, max_batch=4, ec_max_slots=slots, **kw
                    ),
                )
                st = loaded.stager
                row["stage_slots"] = st.buf_slots if st else 0
                row["dma"] = bool(st and st.dma)
                vocab = loaded.config.vocab_size
                for key, n, chunk in PROMPTS:
                    prefill_run(loaded, vocab, n, seed=2, chunk=chunk)
                    row[key] = prefill_run(loaded, vocab, n, chunk=chunk)
                loaded.close()
                del loaded
                torch.cuda.empty_cache()
        except Exception as exc:  # a failing row is a finding; the others still run
            row["error"] = repr(exc)[:500]
        rows[name] = row
        print(name, row, file=sys.stderr, flush=True)

    def ratio(a, b, key="p8192_c8192"):
        x, y = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
        return x / y if x and y else None

    result = {
        "bench": "prefill_staging",
        "figures": {
            name: {k: rows[name].get(k) for k in ("p8192", "p8192_c8192")} for name in rows
        },
        "ratios": {
            "range_vs_gather": ratio("range", "gather"),
            "range_vs_off": ratio("range", "off"),
            "whole_vs_range": ratio("whole", "range"),
            "range_vs_gather_chunk2048": ratio("range", "gather", "p8192"),
        },
        "config": {
            "model": args.model,
            "device": torch.cuda.get_device_name(),
            "moe_layers": len(geo.moe_layers),
            "experts": geo.n_experts,
            "record_bytes": sum(geo.part_bytes),
            "cache_slots": slots,
            "rows": rows,
            "commit": git_commit(),
            "seconds": round(time.perf_counter() - started, 1),
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, row in rows.items():
            print(f"{name:>7}: {row}")
        print(result["ratios"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
