"""GPU benchmark on the slice checkpoint (real GLM-5.3-Flash widths): glm53 exact mode
against stock exllamav3 1.6.5 in the same run.

Rows: stock with every expert in VRAM (the ceiling); stock with every routed expert read
zero-copy from pinned RAM (the floor); glm53 exact with a VRAM expert cache of --share of
the experts (default 11.4 %, the 24 GB RTX 3090's 1,376 / 12,096), with its admission
filter (exact) and without (exact_clock: plain CLOCK); stock exllamav3's own offload at the
same VRAM budget, without and with its pinned arena. Decode tok/s at concurrency 1, 2, 4
(512-token prompts, 128 greedy tokens), prefill tok/s at 512 and 8k (8k at 2,048-token
chunks and as one chunk), hit rate per MoE layer, and the roofline of exact mode at its
measured hit rate.

    python bench/gpu_slice.py --model DIR [--json] [--plot out.png] [--modes stock,exact]
                              [--rows-dir DIR]      # one row per file, as measured
    python bench/gpu_slice.py --combine DIR --json   # figures of rows measured earlier
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


def prefill_run(loaded, vocab, n_tokens, seed=1, chunk=2048):
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4,
        max_chunk_size=chunk,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gen.enqueue(Job(input_ids=ids, max_new_tokens=1, sampler=ArgmaxSampler(), stop_conditions=[]))
    while gen.num_remaining_jobs():
        gen.iterate()
    torch.cuda.synchronize()
    return n_tokens / (time.perf_counter() - t0)


PREFILL = (("p512", 512, 2048), ("p8192", 8192, 2048), ("p8192_c8192", 8192, 8192))


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
    # 8k at exllamav3's default 2,048-token chunks and as one 8,192-token chunk (fewer passes
    # over the experts: exact mode stages every uncached expert once per chunk and layer)
    for name, n, chunk in PREFILL:
        # warm at the same length: a first 8k prompt takes other kernel paths (Triton JIT for
        # new shapes, reconstruct-and-hgemm above 1,024 rows) whose one-time cost is not prefill
        try:
            prefill_run(loaded, vocab, n, seed=2, chunk=chunk)
            out["prefill"][name] = prefill_run(loaded, vocab, n, chunk=chunk)
        except Exception as exc:  # keep the row: one prefill shape failing is a finding
            out["prefill"][name] = None
            out.setdefault("prefill_errors", {})[name] = repr(exc)[:500]
    return out


# exact_clock: exact mode with the admission filter off (plain CLOCK), for comparison
ALL_MODES = ("stock", "zerocopy", "exact", "exact_clock", "stock_offload", "stock_offload_arena")


def measure_mode(args, mode) -> dict:
    """One row: load the slice in `mode`, measure it, unload. Offload rows run in a subprocess."""
    from exllamav3 import Config

    from glm53.engine import exl3_load
    from glm53.engine.exl3_load import moe_geometry

    geo = moe_geometry(Config.from_directory(args.model).stc)
    info = {
        "moe_layers": len(geo.moe_layers),
        "experts": geo.n_experts,
        "record_bytes": sum(geo.part_bytes),
        "device": torch.cuda.get_device_name(),
    }
    if mode.startswith("stock_offload"):
        import subprocess

        split = geo.n_experts - max(1, round(args.share * geo.n_experts))
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "exl3_offload.py"),
               "--model", args.model, "--split", str(split), "--json",
               "--timeout", str(args.offload_timeout)]  # fmt: skip
        cmd += ["--pinned-arena"] if mode.endswith("arena") else []
        cmd += ["--quick"] if args.quick else []
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = p.stdout.strip().splitlines()
        res = json.loads(lines[-1])["figures"] if lines else {"error": p.stderr[-2000:]}
        info["split"] = split
        return {"mode": mode, "info": info, "row": res}
    kw = {}
    if mode.startswith("exact"):
        kw["ec_max_slots"] = max(1, int(round(args.share * len(geo.moe_layers) * geo.n_experts)))
        kw["ec_freq_window"] = 0 if mode == "exact_clock" else None
    with torch.inference_mode():
        t0 = time.perf_counter()
        loaded = exl3_load.load(
            args.model, mode.split("_")[0], cache_tokens=16384, max_batch=4, **kw
        )
        load_s = time.perf_counter() - t0
        row = measure(loaded, loaded.config.vocab_size, args.quick)
        row["load_s"] = load_s
        if loaded.ec is not None:
            row["slots"] = loaded.ec.n_slots
            row["freq_window"] = loaded.ec.freq_window
        loaded.close()
        del loaded
        torch.cuda.empty_cache()
    return {"mode": mode, "info": info, "row": row}


def combine(results: list[dict], args) -> dict:
    """Figures and ratios of the rows measured (in one run or in several processes)."""
    rows = {r["mode"]: r["row"] for r in results if "decode" in r["row"]}
    errors = {r["mode"]: r["row"] for r in results if "decode" not in r["row"]}
    info = dict(results[0]["info"])
    info.update(split=next((r["info"]["split"] for r in results if "split" in r["info"]), None))
    rec, n_moe = info["record_bytes"], info["moe_layers"]
    picks_per_token = 8 * n_moe

    def c1(m):
        return rows[m]["decode"]["c1"]["per_stream_tok_s"] if m in rows else None

    # roofline of exact mode at its measured hit rate: per token, the all-VRAM time plus the
    # miss bytes at the zero-copy bandwidth measured between the stock and zerocopy rows
    zc_gbps = roof = hit = None
    if c1("stock") and c1("zerocopy"):
        t_vram, t_zc = 1 / c1("stock"), 1 / c1("zerocopy")
        zc_gbps = picks_per_token * rec / (t_zc - t_vram) / 1e9 if t_zc > t_vram else None
    if "exact" in rows:
        hit = rows["exact"]["decode_hit_rate"] or 0.0
        if zc_gbps:
            roof = 1 / (1 / c1("stock") + (1 - hit) * picks_per_token * rec / (zc_gbps * 1e9))
    ex = c1("exact")
    stream_bound = chunk_bound = None
    if zc_gbps:
        touched = n_moe * info["experts"] * rec  # an 8k prompt touches every routed expert
        # the bound: every touched expert streamed once at the measured bandwidth
        stream_bound = 8192 / (touched / (zc_gbps * 1e9))
        # what chunked prefill (2,048-token chunks) must stream when nothing stays resident
        chunk_bound = 8192 / (-(-8192 // 2048) * touched / (zc_gbps * 1e9))

    def best8k(m):  # the faster of the two chunk sizes (rows without the 8k chunk: 2k only)
        if m not in rows:
            return None
        p = rows[m]["prefill"]
        return max(p["p8192"], p.get("p8192_c8192") or 0.0)

    # the target's reference: the slower of all-VRAM prefill (at its better chunk size, the
    # stricter choice) and streaming every touched expert once
    prefill_ref = None
    if "stock" in rows:
        prefill_ref = min(best8k("stock"), stream_bound or float("inf"))

    def ratio(a, b):
        return a / b if a and b else None

    figures = {
        "decode_c1_tok_s": {m: c1(m) for m in rows},
        "decode_c2_per_stream_tok_s": {
            m: rows[m]["decode"]["c2"]["per_stream_tok_s"] for m in rows
        },
        "decode_c4_per_stream_tok_s": {
            m: rows[m]["decode"]["c4"]["per_stream_tok_s"] for m in rows
        },
        "decode_c4_aggregate_tok_s": {m: rows[m]["decode"]["c4"]["aggregate_tok_s"] for m in rows},
        "prefill_512_tok_s": {m: rows[m]["prefill"]["p512"] for m in rows},
        "prefill_8192_tok_s": {m: rows[m]["prefill"]["p8192"] for m in rows},
        "prefill_8192_chunk8192_tok_s": {m: rows[m]["prefill"].get("p8192_c8192") for m in rows},
        "exact_hit_rate": hit,
        "exact_clock_hit_rate": rows["exact_clock"]["decode_hit_rate"]
        if "exact_clock" in rows
        else None,
        "exact_layer_hit_rate": rows["exact"]["cache"]["layer_hit_rate"]
        if "exact" in rows
        else None,
        "zero_copy_gbps": zc_gbps,
        "roofline_tok_s": roof,
        "prefill8k_stream_bound_tok_s": stream_bound,
        "prefill8k_per_chunk_stream_bound_tok_s": chunk_bound,
    }
    offload = [c1(m) for m in ("stock_offload", "stock_offload_arena") if c1(m)]
    ratios = {
        "exact_vs_roofline": ratio(ex, roof),
        "exact_vs_zerocopy": ratio(ex, c1("zerocopy")),
        "exact_vs_stock_vram": ratio(ex, c1("stock")),
        "exact_vs_stock_offload": ratio(ex, c1("stock_offload")),
        "exact_vs_best_stock_offload": ratio(ex, max(offload)) if offload else None,
        "exact_vs_exact_clock": ratio(ex, c1("exact_clock")),
        "prefill8k_vs_target_ref": ratio(best8k("exact"), prefill_ref),
        "prefill8k_chunk2048_vs_target_ref": ratio(
            rows["exact"]["prefill"]["p8192"] if "exact" in rows else None, prefill_ref
        ),
    }
    config = {
        "model": args.model,
        "moe_layers": n_moe,
        "experts": info["experts"],
        "record_bytes": rec,
        "share": args.share,
        "slots": rows["exact"]["slots"] if "exact" in rows else None,
        "freq_window": rows["exact"].get("freq_window") if "exact" in rows else None,
        "prefill": "8k prompts at 2,048-token chunks (exllamav3's default) and as one 8,192-token "
        "chunk; each length warmed once first; target ref = min(stock at its faster chunk, "
        "stream bound)",
        "device": info["device"],
        "stock_offload": f"moe_cpu_split={info.get('split')} with EXL3_MOE_CPU_PIN=0 and a sysfs "
        "exl3_moe_cpu_core_order in parent and worker (stock segfaults without that workaround)",
        "errors": errors,
        "rows": rows,
    }
    return {"bench": "gpu_slice", "figures": figures, "ratios": ratios, "config": config}


def plot(rows: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(rows)
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / 3
    for i, b in enumerate((1, 2, 4)):
        xs = [j + (i - 1) * width for j in range(len(modes))]
        ax[0].bar(xs, [rows[m]["decode"][f"c{b}"]["per_stream_tok_s"] for m in modes],
                  width, label=f"concurrency {b}")  # fmt: skip
    ax[0].set_xticks(range(len(modes)), modes, rotation=20)
    ax[0].set_ylabel("decode tok/s per stream")
    ax[0].legend()
    for i, (name, n, chunk) in enumerate(PREFILL):
        xs = [j + (i - 1) * width for j in range(len(modes))]
        ax[1].bar(xs, [rows[m]["prefill"].get(name) or 0 for m in modes], width,
                  label=f"{n} tokens, chunk {chunk}")  # fmt: skip
    ax[1].set_xticks(range(len(modes)), modes, rotation=20)
    ax[1].set_ylabel("prefill tok/s")
    ax[1].set_yscale("log")
    ax[1].legend()
    fig.suptitle("slice checkpoint: stock exllamav3 1.6.5 rows vs glm53 exact")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"))
    ap.add_argument("--share", type=float, default=1376 / 12096)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="32 decode tokens instead of 128")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--modes", default=",".join(ALL_MODES),
                    help=f"comma-separated rows to measure, of {','.join(ALL_MODES)}")  # fmt: skip
    ap.add_argument("--rows-dir", default=None,
                    help="write each row to DIR/row-MODE.json as soon as it is measured")  # fmt: skip
    ap.add_argument("--combine", default=None, metavar="DIR",
                    help="measure nothing: combine the row files in DIR")  # fmt: skip
    ap.add_argument("--offload-timeout", type=int, default=600,
                    help="seconds for each stock-offload subprocess")  # fmt: skip
    args = ap.parse_args(argv)
    if args.combine:
        files = sorted(f for f in os.listdir(args.combine) if f.startswith("row-"))
        if not files:
            ap.error(f"--combine {args.combine}: no row-*.json files there")
        results = [json.load(open(os.path.join(args.combine, f))) for f in files]
        results.sort(key=lambda r: ALL_MODES.index(r["mode"]))
    else:
        if not args.model:
            ap.error("--model (or GLM53_TEST_SLICE) must name a slice checkpoint")
        modes = [m for m in args.modes.split(",") if m]
        bad = [m for m in modes if m not in ALL_MODES]
        if bad:
            ap.error(f"--modes: unknown {bad}; choose from {', '.join(ALL_MODES)}")
        results = []
        for mode in modes:
            r = measure_mode(args, mode)
            results.append(r)
            if args.rows_dir:
                os.makedirs(args.rows_dir, exist_ok=True)
                with open(os.path.join(args.rows_dir, f"row-{mode}.json"), "w") as f:
                    json.dump(r, f, default=float)
            print(f"# {mode}: {json.dumps(r['row'], default=float)[:400]}", flush=True)
    result = combine(results, args)
    rows = result["config"]["rows"]
    if args.plot and rows:
        plot(rows, args.plot)
    if not args.json:
        print(f"{'mode':20} {'dec c1':>9} {'dec c2':>9} {'dec c4':>9} {'pre 512':>9} {'pre 8k':>9}")
        for m, r in rows.items():
            d = r["decode"]
            print(f"{m:20} {d['c1']['per_stream_tok_s']:9.1f} {d['c2']['per_stream_tok_s']:9.1f} "
                  f"{d['c4']['per_stream_tok_s']:9.1f} {r['prefill']['p512']:9.0f} "
                  f"{r['prefill']['p8192']:9.0f}")  # fmt: skip
        f = result["figures"]
        print(f"exact hit rate {f['exact_hit_rate']}, roofline {f['roofline_tok_s']}, "
              f"zero-copy {f['zero_copy_gbps']} GB/s")  # fmt: skip
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
