"""GPU benchmark on the slice checkpoint (real GLM-5.3-Flash widths): glm53 exact mode
against stock exllamav3 1.6.5 in the same run.

Rows: stock with every expert in VRAM (the ceiling); stock with every routed expert read
zero-copy from pinned RAM (the floor); glm53 exact with a VRAM expert cache of --share of
the experts (default 11.4 %, the 24 GB RTX 3090's 1,376 / 12,096). Decode tok/s at
concurrency 1, 2, 4 (512-token prompts, 128 greedy tokens), prefill tok/s at 512 and 8k,
hit rate per MoE layer, and the roofline of exact mode at its measured hit rate.

    python bench/gpu_slice.py --model DIR [--json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def decode_run(loaded, vocab, batch, prompt_len=512, n_new=128, seed=0):
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4
    )
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(0, vocab, (1, prompt_len), generator=g)
        gen.enqueue(Job(input_ids=ids, max_new_tokens=n_new, sampler=ArgmaxSampler(),
                        stop_conditions=[], identifier=i))  # fmt: skip
    first, last, count = {}, {}, {}
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") != "streaming" or "token_ids" not in r:
                continue
            i, now = r["identifier"], time.perf_counter()
            n = r["token_ids"].numel()
            if i not in first:
                first[i], count[i] = now, 0
            else:
                count[i] += n
            last[i] = now
    torch.cuda.synchronize()
    per_stream = [count[i] / (last[i] - first[i]) for i in first if last[i] > first[i]]
    t0, t1 = max(first.values()), min(last.values())  # all streams decoding together
    agg = sum(per_stream) if t1 > t0 else None
    return {"per_stream_tok_s": sum(per_stream) / len(per_stream), "aggregate_tok_s": agg}


def prefill_run(loaded, vocab, n_tokens, seed=1):
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.enqueue(Job(input_ids=ids, max_new_tokens=1, sampler=ArgmaxSampler(), stop_conditions=[]))
    while gen.num_remaining_jobs():
        gen.iterate()
    torch.cuda.synchronize()
    return n_tokens / (time.perf_counter() - t0)


def measure(loaded, vocab, quick=False):
    out = {"decode": {}, "prefill": {}}
    decode_run(loaded, vocab, 1, prompt_len=64, n_new=16)  # warm-up (Triton JIT, graphs)
    if loaded.ec is not None:
        st0 = loaded.ec.state()
    for b in (1, 2, 4):
        out["decode"][f"c{b}"] = decode_run(loaded, vocab, b, n_new=32 if quick else 128)
    if loaded.ec is not None:
        st1 = loaded.ec.state()
        looked = (st1["hits"] - st0["hits"]) + (st1["misses"] - st0["misses"])
        out["decode_hit_rate"] = (st1["hits"] - st0["hits"]) / looked if looked else None
        out["cache"] = st1
    for n in (512, 8192):
        prefill_run(loaded, vocab, 512)  # warm
        out["prefill"][f"p{n}"] = prefill_run(loaded, vocab, n)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"))
    ap.add_argument("--share", type=float, default=1376 / 12096)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="32 decode tokens instead of 128")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model (or GLM53_TEST_SLICE) must name a slice checkpoint")
    from glm53.engine import exl3_load

    rows = {}
    offload_errors = {}
    geo = None
    with torch.inference_mode():
        for mode in ("stock", "zerocopy", "exact"):
            kw = {}
            if mode == "exact":
                n_keys = len(geo.moe_layers) * geo.n_experts
                kw["ec_max_slots"] = max(1, int(round(args.share * n_keys)))
            t0 = time.perf_counter()
            loaded = exl3_load.load(args.model, mode, cache_tokens=16384, max_batch=4, **kw)
            geo = loaded.geometry
            load_s = time.perf_counter() - t0
            rows[mode] = measure(loaded, loaded.config.vocab_size, args.quick)
            rows[mode]["load_s"] = load_s
            if mode == "exact":
                rows[mode]["slots"] = loaded.ec.n_slots
            loaded.close()
            del loaded
            torch.cuda.empty_cache()

    # stock exllamav3's own offload at the same VRAM budget, in a subprocess (workaround applied)
    import subprocess

    split = geo.n_experts - max(1, round(args.share * geo.n_experts))
    for arena in (False, True):
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "exl3_offload.py"),
               "--model", args.model, "--split", str(split), "--json"]  # fmt: skip
        cmd += ["--pinned-arena"] if arena else []
        cmd += ["--quick"] if args.quick else []
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            lines = p.stdout.strip().splitlines()
            res = json.loads(lines[-1])["figures"] if lines else {"error": p.stderr[-2000:]}
        except subprocess.TimeoutExpired as exc:
            res = {"error": f"timed out after 240 s: {str(exc.stdout)[-1000:]}"}
        if "decode" in res:
            rows["stock_offload_arena" if arena else "stock_offload"] = res
        else:
            offload_errors[f"arena={arena}"] = res

    # roofline of exact mode at its measured hit rate: per token, the all-VRAM time plus the
    # miss bytes at the zero-copy bandwidth measured between the stock and zerocopy rows
    rec = sum(geo.part_bytes)
    picks_per_token = 8 * len(geo.moe_layers)
    t_vram = 1 / rows["stock"]["decode"]["c1"]["per_stream_tok_s"]
    t_zc = 1 / rows["zerocopy"]["decode"]["c1"]["per_stream_tok_s"]
    zc_gbps = picks_per_token * rec / (t_zc - t_vram) / 1e9 if t_zc > t_vram else None
    hit = rows["exact"]["decode_hit_rate"] or 0.0
    roof = 1 / (t_vram + (1 - hit) * picks_per_token * rec / (zc_gbps * 1e9)) if zc_gbps else None
    ex = rows["exact"]["decode"]["c1"]["per_stream_tok_s"]
    figures = {
        "decode_c1_tok_s": {m: rows[m]["decode"]["c1"]["per_stream_tok_s"] for m in rows},
        "decode_c4_aggregate_tok_s": {m: rows[m]["decode"]["c4"]["aggregate_tok_s"] for m in rows},
        "prefill_512_tok_s": {m: rows[m]["prefill"]["p512"] for m in rows},
        "prefill_8192_tok_s": {m: rows[m]["prefill"]["p8192"] for m in rows},
        "exact_hit_rate": hit,
        "exact_layer_hit_rate": rows["exact"]["cache"]["layer_hit_rate"],
        "zero_copy_gbps": zc_gbps,
        "roofline_tok_s": roof,
    }
    p8 = rows["exact"]["prefill"]["p8192"]
    stream_bound = None
    if zc_gbps:
        chunks = -(-8192 // 2048)
        stream_bound = 8192 / (chunks * len(geo.moe_layers) * geo.n_experts * rec / (zc_gbps * 1e9))
    prefill_ref = min(rows["stock"]["prefill"]["p8192"], stream_bound or float("inf"))
    ratios = {
        "exact_vs_roofline": ex / roof if roof else None,
        "exact_vs_zerocopy": ex / rows["zerocopy"]["decode"]["c1"]["per_stream_tok_s"],
        "exact_vs_stock_vram": ex / rows["stock"]["decode"]["c1"]["per_stream_tok_s"],
        "exact_vs_stock_offload": (
            ex / rows["stock_offload"]["decode"]["c1"]["per_stream_tok_s"]
            if "stock_offload" in rows
            else None
        ),
        "prefill8k_vs_target_ref": p8 / prefill_ref,
    }
    config = {
        "model": args.model,
        "moe_layers": len(geo.moe_layers),
        "experts": geo.n_experts,
        "record_bytes": rec,
        "share": args.share,
        "slots": rows["exact"]["slots"],
        "device": torch.cuda.get_device_name(),
        "stock_offload": f"moe_cpu_split={split} with EXL3_MOE_CPU_PIN=0 and a sysfs "
        "exl3_moe_cpu_core_order in parent and worker (stock segfaults without that workaround)",
        "stock_offload_errors": offload_errors,
        "rows": rows,
    }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        modes = list(rows)
        for b in (1, 2, 4):
            ax[0].bar([f"{m}\nc{b}" for m in modes],
                      [rows[m]["decode"][f"c{b}"]["per_stream_tok_s"] for m in modes])  # fmt: skip
        ax[0].set_ylabel("decode tok/s per stream")
        ax[1].bar(modes, [rows[m]["prefill"]["p8192"] for m in modes])
        ax[1].set_ylabel("prefill tok/s (8k)")
        fig.tight_layout()
        fig.savefig(args.plot)
    result = {"bench": "gpu_slice", "figures": figures, "ratios": ratios, "config": config}
    if not args.json:
        print(f"{'mode':10} {'dec c1':>9} {'dec c2':>9} {'dec c4':>9} {'pre 512':>9} {'pre 8k':>9}")
        for m, r in rows.items():
            d = r["decode"]
            print(f"{m:10} {d['c1']['per_stream_tok_s']:9.1f} {d['c2']['per_stream_tok_s']:9.1f} "
                  f"{d['c4']['per_stream_tok_s']:9.1f} {r['prefill']['p512']:9.0f} "
                  f"{r['prefill']['p8192']:9.0f}")  # fmt: skip
        print(f"exact hit rate {hit:.3f}, roofline {roof}, zero-copy {zc_gbps} GB/s")
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
