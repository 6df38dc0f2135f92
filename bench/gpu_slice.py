"""GPU benchmark on the slice or deep checkpoint (real GLM-5.3-Flash widths): glm53 exact mode
against stock exllamav3 1.6.5 in the same run, with glm53 doctor's prediction beside each row.

Rows: stock with every expert in VRAM (the ceiling); stock with every routed expert read
zero-copy from pinned RAM (the floor); glm53 exact with a VRAM expert cache of --share of
the experts (default 11.4 %, the 24 GB RTX 3090's 1,376 / 12,096), with its admission
filter (exact) and without (exact_clock: plain CLOCK); stock exllamav3's own offload at the
same VRAM budget (with --vram-budget, the expert bytes of exact's cache and staging buffers
together; without, the share's experts only, while exact also holds its staging buffers),
without and with its pinned arena; glm53 fast (exact's tiers + the CPU lane
and its router, `--modes ...,fast` only), and on the same load a sweep of
fixed shares of the misses on the lane (--fixed-splits, default 0, 10, 20, 30, 40 %) to compare
the router against (ratios.fast_router_vs_best_fixed_split: the router measured again right
after the sweep, as the sweep is, figures.fast_router_after_sweep), again with the lane kept awake
longer after each job for each --lane-spin-us value (figures.fast_fixed_split_c1_tok_s_by_spin:
what the poller's and the workers' wake-ups cost); exact_layer_major (exact's load
with layer-major prefill, issue 28, `--modes ...,exact_layer_major` only: first run on an H100 on
2026-12-05, bench/results/h100-gpu_slice-layer-major-long-2026-12-05.json)
and stock_offload_stream (stock's offload with EXL3_MOE_STREAM_T pinned, --stream-t), with a
32k prefill row (--long-prefill) for them and for stock and exact, against the one-pass stream
bound (ratios.prefill8k_chunk2048_vs_stream_once, prefill32k_vs_stream_once) and exact's
chunk-major 8k of the same run (prefill8k_chunk2048_vs_before), and against stock with every
expert in VRAM at the same chunks (prefill8k_chunk2048_vs_stock_vram: the compute floor, which
on the H200 lies below the stream bound). Decode tok/s at concurrency 1, 2, 4
(512-token prompts, 128 greedy tokens), prefill tok/s at 512 and 8k (8k at 2,048-token
chunks and as one chunk), hit rate per MoE layer, and the roofline of exact mode at its
measured hit rate.

The disk bound (nvme_exact rows, --store): beside each nvme row the bench reads the store with
O_DIRECT through the engine's own reader (glm53.store.read_rate: ExpertStore with its 4 reader
threads, the engine's queue depth, --read-batch distinct random records per batch, for
--read-rate-s seconds), giving R bytes/s on the store's disk. Each nvme row counts the bytes its
RAM tier read from the store (the RAM home's bytes_read counter) per token: per decoded token
while every stream decodes, per prefilled token over the measured prefill. With exact's measured
seconds per token t in the same phase (exact reads nothing from the store; its routed experts
sit in pinned RAM) and the row's store bytes per token b, figures.disk_bound_tok_s gives
serial = 1 / (t + b / R) (reads stall compute, as nvme-exact's blocking reads do) and
overlap = 1 / max(t, b / R) (reads hidden behind compute). ratios.nvme_exact_ramNN_vs_disk_bound
is the row's decode c1 tok/s over its serial bound.

nvme rows (nvme_ram70, nvme_ram40: `--modes ...,nvme_ram70,nvme_ram40` with --store, run on an
H200 on 2026-12-05: bench/results/h200-gpu_slice-nvme-2026-12-05.json): nvme mode, the
nvme_exact row's load with the CPU lane over its RAM tier on top (as `glm53 serve --mode nvme`
builds it); figures.nvme_lane has each row's lane counts and ratios.nvme_vs_nvme_exact_ramNN its
decode c1 over the nvme_exact row's at the same cap.

nvme_exact prefetch rows (nvme_exact_ram70_prefetch, nvme_exact_ram40_prefetch:
`--modes ...,nvme_exact_ram70,nvme_exact_ram70_prefetch` with --store, not yet run on a GPU): the
nvme_exact row's load with decode prefetch on (--nvme-prefetch next-layer,
glm53.tiers.decode_prefetch); figures.nvme_prefetch has every nvme_exact row's prefetch counters
(keys submitted, hits, wasted, faults; zeros where it is off) and
ratios.nvme_exact_ramNN_prefetch_vs_off its decode c1 over the row without prefetch, same cap.

--vram-budget SIZE plans exact mode within SIZE as on a card that size (glm53.exl3.loader.vram_plan_for);
the expert cache is then as large as the budget allows unless --share caps it, and the stock
offload rows keep as many experts per layer in VRAM as exact's cache and staging take. Every
row the cost model covers (stock: all slots, zerocopy: none, exact: its slots) gets doctor's
prediction for this checkpoint's geometry (glm53.doctor.costmodel.exact_rows) and the ratio
measured / predicted; exact's ratio then scales doctor's full GLM-5.3-Flash prediction at the
same budget ("full_model"). Prefill predictions take the GPU's compute from the run's stock row
when it has p512 and p8192_c8192 (every expert in VRAM: compute alone) and exact's staging as
it ran (row stage_dma; issue 29, docs/performance.md "Prefill: where the time goes").

    python bench/gpu_slice.py --model DIR [--json] [--plot out.png] [--modes stock,exact]
                              [--vram-budget 24G] [--rows-dir DIR]  # one row per file
    python bench/gpu_slice.py --combine DIR --json   # figures of rows measured earlier
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import msgspec
import torch

from glm53.config import parse_size
from glm53.doctor import costmodel
from glm53.doctor.geometry import GLM53_FLASH, Geometry, geometry_of
from glm53.doctor.pcie_probe import pcie_h2d_gbps
from glm53.tiers.thread_pins import lane_threads_pinned

REAL_24GB_SHARE = 1376 / 12096  # the 24 GB RTX 3090's slots of GLM-5.3-Flash's experts (seed)
# doctor's inputs for the H200 this bench runs on: the UVA read rate into the EXL3 kernels
# (exllamav3.md App. A, 49.3-50.6 GB/s) and the spec sheet's HBM3e bandwidth and fp16 rate
H200_PCIE_GBPS = 50.0  # only for rows that measured no link rate (before 2026-12-06)
H200_VRAM_GBPS = 4800.0
H200_FP16_TFLOPS = 989.0


def decode_run(
    loaded, vocab, batch, prompt_len=512, n_new=128, seed=0, step=None, store_bytes=None,
    layer_major=None,
):  # fmt: skip
    """`step`: called after each Generator iteration (fast mode's FastLane.step, as the
    engine calls it). `store_bytes`: the store's bytes read so far (nvme rows); the result
    then has the bytes read per token decoded once every stream is decoding. `layer_major`:
    a function of the Generator that returns the LayerMajorPrefill driving it (the
    exact_layer_major row; its prompts here are shorter than a chunk, so they keep the
    Generator's path, with the hooks in place as in the engine)."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4
    )
    lm = layer_major(gen) if layer_major is not None else None
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(0, vocab, (1, prompt_len), generator=g)
        job = Job(input_ids=ids, max_new_tokens=n_new, sampler=ArgmaxSampler(),
                  stop_conditions=[], identifier=i)  # fmt: skip
        gen.enqueue(job)
        if lm is not None:
            lm.watch(job)
    first, last, count = {}, {}, {}
    bytes0, window_tokens = None, 0
    while gen.num_remaining_jobs():
        results = lm_iterate(gen, lm)
        if step is not None:
            step()
        for r in results:
            if r.get("stage") != "streaming" or "token_ids" not in r:
                continue
            i, now = r["identifier"], time.perf_counter()
            n = r["token_ids"].numel()
            if i not in first:
                first[i], count[i] = now, 0
                if store_bytes is not None and len(first) == batch:
                    bytes0 = store_bytes()
            else:
                count[i] += n
                window_tokens += n if bytes0 is not None else 0
            last[i] = now
    torch.cuda.synchronize()
    per_stream = [count[i] / (last[i] - first[i]) for i in first if last[i] > first[i]]
    t0, t1 = max(first.values()), min(last.values())  # all streams decoding together
    agg = sum(per_stream) if t1 > t0 else None
    out = {"per_stream_tok_s": sum(per_stream) / len(per_stream), "aggregate_tok_s": agg}
    if bytes0 is not None and window_tokens:
        out["store_bytes_per_token"] = (store_bytes() - bytes0) / window_tokens
    return out


def lm_iterate(gen, lm) -> list:
    """One Generator iteration as the GPU engine runs it (GpuEngine.iterate): with a
    layer-major pass active, its next module first, then the Generator's own iteration."""
    if lm is None:
        return gen.iterate()
    lm.step()
    results = gen.iterate()
    lm.after_iterate(any("token_ids" in r for r in results))
    return results


def prefill_run(loaded, vocab, n_tokens, seed=1, chunk=2048, layer_major=None, stats=None):
    """Prefill tok/s of one `n_tokens` prompt at `chunk`-token chunks, to its first token.
    `layer_major` as in decode_run: a prompt longer than one chunk then runs layer-major;
    `stats` (a dict) receives the LayerMajorPrefill's stats after the prompt."""
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(
        model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer, max_batch_size=4,
        max_chunk_size=chunk,
    )  # fmt: skip
    lm = layer_major(gen) if layer_major is not None else None
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, n_tokens), generator=g)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    job = Job(input_ids=ids, max_new_tokens=1, sampler=ArgmaxSampler(), stop_conditions=[])
    gen.enqueue(job)
    if lm is not None:
        lm.watch(job)
    while gen.num_remaining_jobs():
        lm_iterate(gen, lm)
    torch.cuda.synchronize()
    tok_s = n_tokens / (time.perf_counter() - t0)
    if lm is not None and stats is not None:
        stats.update(lm.stats())
    return tok_s


# (name, prompt tokens, chunk tokens); PREFILL_LONG only for the LONG_PREFILL_MODES rows, whose
# cache then holds PREFILL_CACHE_TOKENS (issue 28's 32k row, the checkpoint's context allowing)
PREFILL = (("p512", 512, 2048), ("p8192", 8192, 2048), ("p8192_c8192", 8192, 8192))
PREFILL_LONG = (("p32768", 32768, 2048),)
LONG_PREFILL_MODES = ("stock", "exact", "exact_layer_major", "stock_offload_stream")
PREFILL_CACHE_TOKENS = 32768 + 2048


def prefill_shapes(long: bool, context: int | None) -> tuple:
    """The prefill rows a mode measures: PREFILL, and PREFILL_LONG when `long` and the
    checkpoint's context (max_position_embeddings) holds the prompt and its first token."""
    extra = tuple(p for p in PREFILL_LONG if long and (context is None or p[1] < context))
    return PREFILL + extra


def store_bytes_counter(loaded):
    """The nvme rows' bytes read from the store so far (the RAM home's counter), else None."""
    if getattr(loaded, "nvme", None) is None:
        return None
    return lambda: loaded.nvme.home.counters["bytes_read"]


def hit_counts(before: dict, after: dict) -> dict:
    """The VRAM cache's decode lookups between two states: hits, misses and the hit rate (the
    cost model's decode prediction at concurrency b rests on it: issue 29)."""
    hits = after["hits"] - before["hits"]
    misses = after["misses"] - before["misses"]
    looked = hits + misses
    return {"hits": hits, "misses": misses, "hit_rate": hits / looked if looked else None}


def measure(loaded, vocab, quick=False, step=None, layer_major=None, shapes=PREFILL):
    """A row's decode and prefill figures; `layer_major` as in decode_run, `shapes` the
    prefill rows (prefill_shapes)."""
    out = {"decode": {}, "prefill": {}}
    lm = {"layer_major": layer_major}
    store_bytes = store_bytes_counter(loaded)
    decode_run(loaded, vocab, 1, prompt_len=64, n_new=16, step=step, **lm)  # warm-up (Triton JIT)
    if loaded.ec is not None:
        st0 = loaded.ec.state()
    for b in (1, 2, 4):
        n_new = 32 if quick else 128
        before = loaded.ec.state() if loaded.ec is not None else None
        out["decode"][f"c{b}"] = run = decode_run(
            loaded, vocab, b, n_new=n_new, step=step, store_bytes=store_bytes, **lm
        )
        if before is not None:  # this concurrency's own lookups (prefill chunks look up none)
            run.update(hit_counts(before, loaded.ec.state()))
    if loaded.ec is not None:
        st1 = loaded.ec.state()
        out["decode_hit_rate"] = hit_counts(st0, st1)["hit_rate"]  # every concurrency's
        out["cache"] = st1
    # 8k at exllamav3's default 2,048-token chunks and as one 8,192-token chunk (fewer passes
    # over the experts: exact mode stages every uncached expert once per chunk and layer)
    for name, n, chunk in shapes:
        # warm at the same length: a first 8k prompt takes other kernel paths (Triton JIT for
        # new shapes, reconstruct-and-hgemm above 1,024 rows) whose one-time cost is not prefill
        try:
            prefill_run(loaded, vocab, n, seed=2, chunk=chunk, **lm)
            bytes0 = store_bytes() if store_bytes is not None else None
            stats = {}
            out["prefill"][name] = prefill_run(loaded, vocab, n, chunk=chunk, stats=stats, **lm)
            if layer_major is not None:  # its passes, staging skips and pauses, per shape
                out.setdefault("layer_major", {})[name] = stats
            if bytes0 is not None:
                per_token = (store_bytes() - bytes0) / n
                out.setdefault("prefill_store_bytes_per_token", {})[name] = per_token
        except Exception as exc:  # keep the row: one prefill shape failing is a finding
            out["prefill"][name] = None
            out.setdefault("prefill_errors", {})[name] = repr(exc)[:500]
    return out


# exact_clock: exact mode with the admission filter off (plain CLOCK), for comparison;
# nvme_exact_ramNN: nvme-exact (exact's VRAM cache over the RAM tier capped at NN % of the
# experts, filled from --store); measured only when --store is given
# fast: exact's tiers + the CPU lane (glm53.exl3.fast, glm53.tiers.fast_lane); measured only
# when --modes names it
# exact_layer_major: exact's load with layer-major prefill (glm53.exl3.layer_major, not
# yet run on a GPU); stock_offload_stream: stock_offload_arena (the faster stock offload) with
# EXL3_MOE_STREAM_T pinned (--stream-t: in prefill, an expert that many tokens of a chunk pick
# is streamed to the GPU; unset, as in the other offload rows, exllamav3 scales it from 8)
# nvme_ramNN: nvme mode, nvme_exact_ramNN + the same lane over the RAM tier (glm53.tiers.nvme_lane);
# measured only when --modes names it and --store is given (run on an H200, 2026-12-05)
# nvme_exact_ramNN_prefetch: nvme_exact_ramNN with decode prefetch (--nvme-prefetch next-layer,
# glm53.tiers.decode_prefetch); measured only when --modes names it and --store is given (not
# yet run on a GPU)
# exact_loan: exact with the staging loan (--ec-stage-loan: the staging buffers are cache slots
# in decode, glm53.tiers.vram_cache.StagingLoan); measured only when --modes names it
# exact_copy_first: exact with its prefill stages queuing the copy before the unstage kernel
# (PrefillStager.copy_first, not yet run on a GPU), against exact in the same run
# (ratios.exact_copy_first_prefill*_vs_exact); measured only when --modes names it
# nvme_exact_ramNN_layer_major: nvme_exact_ramNN with layer-major prefill (the store read once
# per layer per prompt, glm53.exl3.layer_major in the store modes); measured only when --modes
# names it and --store is given (first run, unstaged, on an H100 on 2026-12-05:
# bench/results/h100-gpu_slice-nvme-layer-major-2026-12-05.json)
ALL_MODES = ("stock", "zerocopy", "exact", "exact_clock", "stock_offload", "stock_offload_arena",
             "nvme_exact_ram70", "nvme_exact_ram40", "nvme_ram70", "nvme_ram40", "fast",
             "exact_layer_major", "stock_offload_stream", "nvme_exact_ram70_prefetch",
             "nvme_exact_ram40_prefetch", "exact_loan", "nvme_exact_ram70_layer_major",
             "nvme_exact_ram40_layer_major", "exact_copy_first")  # fmt: skip
ON_REQUEST = ("fast", "exact_layer_major", "stock_offload_stream", "nvme_ram70",
              "nvme_ram40", "nvme_exact_ram70_prefetch",
              "nvme_exact_ram40_prefetch", "exact_loan", "nvme_exact_ram70_layer_major",
              "nvme_exact_ram40_layer_major",
              "exact_copy_first")  # not in the default --modes  # fmt: skip
NVME_RAM_SHARE = {"nvme_exact_ram70": 0.7, "nvme_exact_ram40": 0.4, "nvme_ram70": 0.7,
                  "nvme_ram40": 0.4, "nvme_exact_ram70_prefetch": 0.7,
                  "nvme_exact_ram40_prefetch": 0.4, "nvme_exact_ram70_layer_major": 0.7,
                  "nvme_exact_ram40_layer_major": 0.4}  # fmt: skip
LAYER_MAJOR_ROWS = ("exact_layer_major", "nvme_exact_ram70_layer_major",
                    "nvme_exact_ram40_layer_major")  # rows with layer-major prefill  # fmt: skip
PREFETCH_ROWS = ("nvme_exact_ram70_prefetch", "nvme_exact_ram40_prefetch")  # prefetch on
# the RAM stats' prefetch counters each nvme_exact row reports (figures.nvme_prefetch)
PREFETCH_COUNTERS = ("prefetch_waves", "prefetch_keys", "prefetch_hits", "prefetch_wasted",
                     "prefetch_faults", "prefetch_cut", "prefetch_bytes")  # fmt: skip
LANE_ROWS = ("fast", "nvme_ram70", "nvme_ram40")  # rows with the CPU lane on their load


def cache_share(args) -> float | None:
    """The share of the experts exact mode may cache: --share, else the 24 GB card's 11.4 %
    without a budget; with --vram-budget and no --share, none (the budget decides)."""
    if args.share is not None:
        return args.share
    return None if args.vram_budget is not None else REAL_24GB_SHARE


def offload_split(args, n_experts: int, n_moe: int, plan, record_bytes: int) -> int:
    """Experts per layer that stock offload runs on the CPU: the rest stay in VRAM. With a
    budget, as many as exact's row holds in its cache (at --share, when given: `plan` is the
    row's, row_vram_plan) and its staging buffers together, so both rows hold the same expert
    bytes in the same budget; without one, as many as exact caches by --share (its staging
    buffers, which the unbudgeted slice rows also hold, are not counted: say so beside a
    ratio against this row)."""
    if plan is not None:
        on_gpu = (plan.cache_bytes + plan.stage_bytes) // record_bytes
        return n_experts - max(1, min(n_experts, on_gpu // n_moe))
    return n_experts - max(1, round(cache_share(args) * n_experts))


def exact_kwargs(args, mode: str, n_experts: int, n_moe: int) -> dict:
    """glm53.exl3.loader.load arguments of an exact row."""
    kw = {"ec_freq_window": 0 if mode == "exact_clock" else None}
    share = cache_share(args)
    if share is not None:
        kw["ec_max_slots"] = max(1, int(round(share * n_moe * n_experts)))
    if args.vram_budget is not None:
        kw["vram_budget"] = args.vram_budget
    return kw


CACHE_TOKENS, MAX_BATCH, MAX_CHUNK = 16384, 4, 2048
EC_RESERVE_GB = 1.0  # glm53.exl3.load's default reserve, which layer-major's room keeps too


def row_vram_plan(args, geo, cache_tokens: int):
    """Exact mode's plan within --vram-budget as the row loads it (glm53.exl3.loader's), its
    cache capped by --share as exact_kwargs caps it: the plan's cache and free bytes are then
    the run's, not those of a cache as large as the budget allows."""
    from glm53.exl3 import loader as exl3_load

    cap = exact_kwargs(args, "exact", geo.n_experts, len(geo.moe_layers)).get("ec_max_slots")
    return exl3_load.vram_plan_for(
        args.model, geo, args.vram_budget, cache_tokens, MAX_BATCH, MAX_CHUNK, ec_max_slots=cap
    )


def layer_major_driver(args, loaded):
    """exact_layer_major: a function of a Generator that returns the LayerMajorPrefill driving
    it, built as GpuEngine._start_layer_major builds it, at the Generator's chunk size."""
    from glm53.exl3 import LayerMajorPrefill

    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        text_config = json.load(f)["text_config"]
    reserve = int(EC_RESERVE_GB * 2**30)
    nvme = getattr(loaded, "nvme", None)
    if nvme is not None:  # the store modes' rows measure the pass staging each layer once
        nvme.pass_staging = True  # (glm53.modes.UNRUN["store-pass-staging"]; off: zero-copy)
    return lambda gen: LayerMajorPrefill(
        loaded, gen, gen.max_chunk_size, text_config, reserve, "cuda:0"
    )


def row_prefill(args, mode: str) -> tuple[tuple, int]:
    """A row's prefill shapes and its cache's tokens: the 32k shape (and the cache to hold it)
    for the LONG_PREFILL_MODES rows when --long-prefill is on."""
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        context = json.load(f)["text_config"].get("max_position_embeddings")
    shapes = prefill_shapes(args.long_prefill and mode in LONG_PREFILL_MODES, context)
    longest = max(n for _, n, _ in shapes)
    return shapes, PREFILL_CACHE_TOKENS if longest > CACHE_TOKENS - MAX_CHUNK else CACHE_TOKENS


def measure_mode(args, mode) -> dict:
    """One row: load the checkpoint in `mode`, measure it, unload. Offload rows run in a
    subprocess."""
    from exllamav3 import Config

    from glm53.exl3 import loader as exl3_load
    from glm53.exl3.loader import moe_geometry
    from glm53.exl3.options import LoadOptions

    geo = moe_geometry(Config.from_directory(args.model).stc)
    info = {
        "moe_layers": len(geo.moe_layers),
        "experts": geo.n_experts,
        "record_bytes": sum(geo.part_bytes),
        "device": torch.cuda.get_device_name(),
        "geometry": msgspec.to_builtins(geometry_of(args.model)),
        # the run's link rate (main: measured once, before the first row loads)
        "pcie_h2d_gbps": args.pcie_h2d_gbps,
    }
    shapes, cache_tokens = row_prefill(args, mode)
    info["cache_tokens"] = cache_tokens
    plan = None
    if args.vram_budget is not None:
        plan = row_vram_plan(args, geo, cache_tokens)
        info["vram_plan"] = msgspec.to_builtins(plan)
    if mode.startswith("stock_offload"):
        import subprocess

        split = offload_split(args, geo.n_experts, len(geo.moe_layers), plan, sum(geo.part_bytes))
        cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "exl3_offload.py"),
               "--model", args.model, "--split", str(split), "--json",
               "--timeout", str(args.offload_timeout)]  # fmt: skip
        cmd += ["--pinned-arena"] if mode.endswith(("arena", "stream")) else []
        cmd += ["--quick"] if args.quick else []
        cmd += ["--stream-t", str(args.stream_t)] if mode.endswith("stream") else []
        cmd += ["--cache-tokens", str(cache_tokens)] + (
            ["--long-prefill"] if len(shapes) > len(PREFILL) else []
        )
        p = subprocess.run(cmd, capture_output=True, text=True)
        lines = p.stdout.strip().splitlines()
        res = json.loads(lines[-1])["figures"] if lines else {"error": p.stderr[-2000:]}
        info["split"] = split
        info["stream_t"] = args.stream_t if mode.endswith("stream") else None
        return {"mode": mode, "info": info, "row": res}
    kw, load_mode = {}, mode.split("_")[0]
    if mode == "fast":  # exact's load; the lane goes on top of it below
        load_mode = "exact"
        kw = exact_kwargs(args, "exact", geo.n_experts, len(geo.moe_layers))
    if mode.startswith("exact"):
        kw = exact_kwargs(args, mode, geo.n_experts, len(geo.moe_layers))
        if mode == "exact_loan":
            kw["stage_loan"] = True
    if mode in NVME_RAM_SHARE:
        load_mode = "nvme-exact"
        kw = exact_kwargs(args, "exact", geo.n_experts, len(geo.moe_layers))
        # prefill staging on, as exact's rows have it (--ec-stage-gb's default; nvme-exact
        # reads each layer into the RAM tier ahead of its stage: glm53.tiers.prefill_ahead)
        kw.update(store=args.store, ram_cap=nvme_ram_cap(args.store, mode))
        if mode in PREFETCH_ROWS:
            kw["nvme_prefetch"] = "next-layer"
        info["ram_share"] = NVME_RAM_SHARE[mode]
        info["store_read"] = store_read_rate(args)
    dev = torch.device("cuda:0")  # glm53.exl3.loader.load's default device
    with torch.inference_mode():
        t0 = time.perf_counter()
        loaded = exl3_load.load(args.model, LoadOptions(
            mode=load_mode, cache_tokens=cache_tokens, max_batch=MAX_BATCH,
            max_chunk=MAX_CHUNK, **kw,
        ))  # fmt: skip
        if mode == "exact_copy_first":
            loaded.stager.copy_first = True
        fast = start_fast_row(args, loaded) if mode in LANE_ROWS else None
        load_s = time.perf_counter() - t0
        resident = (loaded.resident_bytes, loaded.load_peak_bytes)
        if fast is not None:  # the load's count, with the lane's device buffers
            held = exl3_load.held_vram_bytes(loaded.vram_before, exl3_load.vram_use(dev))
            resident = held if held is not None else (None, None)
        step = fast.step if fast is not None else None
        lm = layer_major_driver(args, loaded) if mode in LAYER_MAJOR_ROWS else None
        pinned = (
            lane_threads_pinned(fast.lane, args.lane_pins)
            if fast is not None
            else contextlib.nullcontext({})
        )
        with pinned as pins:  # the next rows run unpinned again, as before this one
            row = measure(loaded, loaded.config.vocab_size, args.quick, step, lm, shapes)
            row["load_s"] = load_s
            if pins:
                row["thread_pins"] = {role: list(pin.cpus) for role, pin in pins.items()}
            if fast is not None:
                from glm53.exl3 import stop_fast

                row["lane"] = fast.stats()
                if mode == "fast" and args.fixed_splits:  # the sweep: fast only
                    row["fixed_splits"] = fixed_split_sweep(
                        loaded, fast, args.fixed_splits, args.quick
                    )
                    # the router again, right after the sweep and measured as it is: the row's
                    # own figures come first, on a colder host (H100, 2026-12-05: its c1 144
                    # against the sweep's share 0 at 160, exact's row at 153)
                    row["router_after_sweep"] = lane_decode(loaded, fast, None, args.quick)
                    if args.lane_spin_us:
                        row["fixed_splits_by_spin"] = spin_sweep(
                            loaded, fast, args.fixed_splits, args.quick, args.lane_spin_us
                        )
                stop_fast(fast, loaded)
        row["resident_bytes"], row["load_peak_bytes"] = resident
        if loaded.ec is not None:
            row["slots"] = loaded.ec.n_slots
            row["freq_window"] = loaded.ec.freq_window
            row["stage_slots"] = loaded.stager.buf_slots if loaded.stager is not None else 0
            if loaded.stager is not None:  # copy-engine DMA of layer ranges, or an SM gather
                row["stage_dma"] = bool(loaded.stager.dma)
                # the MoE layers the stager stages in prefill (all but the last since
                # 2026-12-05; rows without the field staged every one: prefill_inputs)
                row["stage_layers"] = loaded.stager.prefill_layers
                if loaded.stager.loan is not None:  # slots above include the lent buffers
                    row["stage_loan"] = loaded.stager.loan.stats()
            if loaded.nvme is not None and loaded.stager is None:  # a finding, not a failure
                row["staging_off"] = "the VRAM plan left no room for staging buffers"
        if loaded.nvme is not None:
            row["ram"] = loaded.nvme.stats()
        loaded.close()
        del loaded
        torch.cuda.empty_cache()
    return {"mode": mode, "info": info, "row": row}


LANE_COUNTS = ("jobs", "fallbacks", "lane_picks")


def lane_decode(loaded, fast, share: float | None, quick: bool) -> dict:
    """fast mode's decode at concurrency 1 and 4 with `share` of each layer's misses forced on
    the lane (None: the router's own split), and the lane's jobs, fallbacks and picks in it."""
    n_new = 32 if quick else 128
    vocab = loaded.config.vocab_size
    fast.router.set_forced_share(share)
    try:
        before = fast.stats()
        decode = {f"c{b}": decode_run(loaded, vocab, b, n_new=n_new, step=fast.step)
                  for b in (1, 4)}  # fmt: skip
        after = fast.stats()
    finally:
        fast.router.set_forced_share(None)
    lane = {k: (after[k] - before[k]) if after[k] is not None else None for k in LANE_COUNTS}
    lane.update(where_the_time_goes(before, after))
    return {"decode": decode, "lane": lane}


def fixed_split_sweep(loaded, fast, percents: list[int], quick: bool) -> dict:
    """fast mode at fixed shares of each layer's misses on the lane (the router's forced_share,
    its waits still predicted), on the row's load: per share (its percent as the key) decode
    tok/s at concurrency 1 and 4, and the lane's jobs, fallbacks and picks in those runs."""
    return {str(pct): lane_decode(loaded, fast, pct / 100, quick) for pct in percents}


def spin_sweep(loaded, fast, percents: list[int], quick: bool, spins_us: list[int]) -> dict:
    """The fixed-split sweep again with the lane awake for each of `spins_us` after every job
    (MailboxLane.idle_spin_ns: the poller and the pool's workers; the default is 200 us, and a
    layer's job arriving later pays their wake-ups), keyed by the spin in us."""
    mailbox = fast.lane
    default = mailbox.idle_spin_ns
    out = {}
    try:
        for us in spins_us:
            mailbox.idle_spin_ns = us * 1000
            out[str(us)] = fixed_split_sweep(loaded, fast, percents, quick)
    finally:
        mailbox.idle_spin_ns = default
    return out


def where_the_time_goes(before: dict, after: dict) -> dict:
    """Between two FastLane.stats(): the lane's ms a job, and, over the device's timed decode
    calls (every glm53.exl3.fast_hooks.TIME_EVERY-th of each layer), the mean GPU share (from
    the lane's publish to the wait: the MoE call on the GPU's picks and the cache's route) and
    the mean wait for the lane after it, in ms a layer call. A share's cost beyond exact mode
    is in these two and in the calls' fixed work (the publish, the fallback launch, select)."""
    jobs = after["jobs"] - before["jobs"]
    lane_ms = after["lane_ms"] - before["lane_ms"]
    pairs = list(zip(before["layers"], after["layers"], strict=True))
    waits = sum(a["waits"] - b["waits"] for b, a in pairs)
    gpu_ms = sum(a["gpu_ms"] - b["gpu_ms"] for b, a in pairs)
    waited_ms = sum(a["waited_ms"] - b["waited_ms"] for b, a in pairs)
    return {
        "lane_ms": lane_ms,
        "lane_ms_per_job": lane_ms / jobs if jobs else None,
        "timed_calls": waits,
        "gpu_ms_per_timed_call": gpu_ms / waits if waits else None,
        "wait_ms_per_timed_call": waited_ms / waits if waits else None,
    }


def start_fast_row(args, loaded):
    """The fast row's lane as `glm53 serve --mode fast` builds it (on an nvme-exact load, the
    nvme rows' as `--mode nvme` does: the lane over the RAM tier): every CPU the default
    layout gives (one per physical core, leaving two), fast precision, the live router."""
    from glm53.exl3 import start_fast
    from glm53.tiers.cpu_lane import CpuLane, lane_layout

    return start_fast(loaded, args.model, CpuLane(lane_layout(), precision="fast"))


def store_read_rate(args) -> dict:
    """The store's O_DIRECT read rate on its disk, through the engine's reader at its queue
    depth (glm53.store.read_rate), measured in the run beside each nvme row."""
    from glm53.store.read_rate import read_rate

    rate = read_rate(args.store, batch_records=args.read_batch, max_seconds=args.read_rate_s)
    return msgspec.to_builtins(rate)


def disk_bound_tok_s(exact_tok_s, store_bytes_per_token, read_bytes_per_s) -> dict | None:
    """The rate a row could reach on this disk: exact's time per token plus the store bytes
    that row reads per token at the measured read rate (serial), or the larger of the two
    (full overlap of reads and compute). None when a figure is missing."""
    if not exact_tok_s or store_bytes_per_token is None or not read_bytes_per_s:
        return None
    compute_s, read_s = 1 / exact_tok_s, store_bytes_per_token / read_bytes_per_s
    return {"serial": 1 / (compute_s + read_s), "overlap": 1 / max(compute_s, read_s)}


# phase -> (a row's tok/s, its store bytes per token), for the disk bound
DISK_BOUND_PHASES = {
    "decode_c1": (
        lambda r: r["decode"]["c1"]["per_stream_tok_s"],
        lambda r: r["decode"]["c1"].get("store_bytes_per_token"),
    ),
    **{
        f"prefill_{name}": (
            lambda r, n=name: r["prefill"].get(n),
            lambda r, n=name: (r.get("prefill_store_bytes_per_token") or {}).get(n),
        )
        for name, _, _ in PREFILL
    },
}


def disk_bounds(rows: dict, read_rates: dict) -> tuple[dict, dict]:
    """Per nvme row and phase, its store bytes per token and disk_bound_tok_s against exact's
    measured tok/s in the same phase (`read_rates`: row -> bytes/s measured beside it)."""
    per_token, bounds = {}, {}
    exact = rows.get("exact")
    for mode, row in rows.items():
        if mode not in read_rates:
            continue
        per_token[mode], bounds[mode] = {}, {}
        for phase, (tok_s, bytes_per_token) in DISK_BOUND_PHASES.items():
            b = bytes_per_token(row)
            per_token[mode][phase] = b
            ex = tok_s(exact) if exact is not None else None
            bounds[mode][phase] = disk_bound_tok_s(ex, b, read_rates[mode])
    return per_token, bounds


def nvme_ram_cap(store: str, mode: str) -> int:
    """--ram-cap of an nvme_exact row: its share of the store's records."""
    with open(os.path.join(store, "manifest.json")) as f:
        m = json.load(f)
    layers = sum(not layer.get("is_mtp") for layer in m["layers"])
    records = layers * m["experts_per_layer"]
    return int(NVME_RAM_SHARE[mode] * records) * m["record_bytes"]


def prediction_inputs(args, slots: int) -> costmodel.CostInputs:
    return costmodel.CostInputs(
        vram_slots=slots,
        pcie_gbps=args.predict_pcie_gbps,
        vram_gbps=args.predict_vram_gbps,
        gpu_fp16_tflops=args.predict_fp16_tflops,
    )


def prefill_inputs(rows: dict, mode: str, geo: Geometry, target: Geometry | None = None) -> dict:
    """CostInputs fields for a row's prefill prediction: the GPU's compute fitted on this run's
    stock row (every expert in VRAM, so no link: its p512 and p8192_c8192,
    costmodel.prefill_compute_fit, per layer, so it carries to the full model's widths), and
    an exact row's staging as it ran (stage_dma: the copy engine moves the whole layer, the rest
    of a part-layer buffer read in place; an SM gather runs after the compute). {} where the
    rows do not say (no stock row, a shape missing). `target`: the geometry predicted for, when
    not the run's own (full_model)."""
    fields: dict = {}
    p = (rows.get("stock") or {}).get("prefill") or {}
    if p.get("p512") and p.get("p8192_c8192"):
        try:
            chunk_ms, token_us = costmodel.prefill_compute_fit(
                geo, (512, p["p512"]), (8192, p["p8192_c8192"])
            )
        except ValueError:
            pass  # no straight line through them: keep the spec-scaled rate
        else:
            fields |= {"prefill_chunk_ms": chunk_ms, "prefill_token_us": token_us}
    row = rows.get(mode) or {}
    dma = row.get("stage_dma")
    if dma is True:
        fields["stage_records"] = (target or geo).experts_per_layer
    elif dma is False:
        fields["stage_overlap"] = False
    if dma is not None and target is None:  # (another geometry: what this code stages)
        # a staged row without `stage_layers` was measured before the stager stopped staging
        # the last MoE layer (whose MLP no prefill runs): it staged all of them
        staged = row.get("stage_layers", geo.num_moe_layers)
        if staged not in (geo.num_moe_layers, geo.prefill_moe_layers):
            raise ValueError(
                f"row {mode} staged {staged} MoE layers in prefill; the cost model knows "
                f"{geo.num_moe_layers} (every one) or {geo.prefill_moe_layers} (those a prefill runs)"
            )
        fields["stage_last_layer"] = staged == geo.num_moe_layers
    return fields


def predicted_slots(mode: str, row: dict, geo: Geometry) -> int | None:
    """The VRAM slots the cost model gives a row: every expert for stock, none for zerocopy,
    the cache's for exact (without the staging loan's records: lent_slots); None for rows it
    does not model (stock exllamav3's CPU offload)."""
    if mode == "stock":
        return geo.total_experts
    if mode == "zerocopy":
        return 0
    return row["slots"] - lent_slots(row) if mode.startswith("exact") and "slots" in row else None


def lent_slots(row: dict) -> int:
    """The staging loan's records in a row's `slots` (exact_loan): cache slots in decode only."""
    return (row.get("stage_loan") or {}).get("stage_loan_slots", 0)


MEASURED = {  # prediction name -> how to read the measured row
    "decode_c1_tok_s": lambda r: r["decode"]["c1"]["per_stream_tok_s"],
    "decode_c2_per_stream_tok_s": lambda r: r["decode"]["c2"]["per_stream_tok_s"],
    "decode_c4_per_stream_tok_s": lambda r: r["decode"]["c4"]["per_stream_tok_s"],
    "decode_c4_aggregate_tok_s": lambda r: r["decode"]["c4"]["aggregate_tok_s"],
    "prefill_512_tok_s": lambda r: r["prefill"].get("p512"),
    "prefill_8192_tok_s": lambda r: r["prefill"].get("p8192"),
    "prefill_8192_chunk8192_tok_s": lambda r: r["prefill"].get("p8192_c8192"),
    "hit_rate": lambda r: r.get("decode_hit_rate"),
}


def predictions(rows: dict, geo: Geometry, args) -> tuple[dict, dict]:
    """doctor's prediction of each modelled row, and measured / predicted per figure."""
    predicted, vs = {}, {}
    for mode, row in rows.items():
        slots = predicted_slots(mode, row, geo)
        if slots is None:
            continue
        x = msgspec.structs.replace(
            prediction_inputs(args, slots), **prefill_inputs(rows, mode, geo)
        )
        pred = costmodel.exact_rows(x, geo, lent_slots(row))
        predicted[mode] = pred
        vs[mode] = {}
        for name, value in pred.items():
            got = MEASURED[name](row)
            vs[mode][name] = got / value if got and value else None
    return predicted, vs


def full_model(args, vs_exact: dict | None, prefill: dict | None = None) -> dict | None:
    """doctor's GLM-5.3-Flash figures at the same budget (or share), and those figures times
    exact's measured / predicted on this checkpoint: the measured per-layer costs carried to the
    real model's 288 experts per layer. `prefill`: prefill_inputs for GLM-5.3-Flash."""
    if not vs_exact:
        return None
    share = cache_share(args)
    if share is not None:
        slots = round(share * GLM53_FLASH.total_experts)
    else:
        slots = costmodel.vram_slots(args.vram_budget // 2**20, costmodel.Mode.EXACT)
    x = msgspec.structs.replace(prediction_inputs(args, slots), **(prefill or {}))
    pred = costmodel.exact_rows(x, GLM53_FLASH)
    scaled = {k: pred[k] * vs_exact[k] for k in pred if vs_exact.get(k)}
    return {"slots": slots, "predicted": pred, "scaled_by_measured": scaled}


def link_input(results: list[dict], given: float | None) -> tuple[float, str]:
    """The predictions' link rate (GB/s) and where it came from: --predict-pcie-gbps when given,
    else the median of the rows' measured pinned host-to-device rate (pcie_h2d_gbps, what
    glm53 doctor's probe measures on a user's host), else (rows from before 2026-12-06, which
    measured none) the H200's assumed 50 GB/s."""
    if given is not None:
        return given, "--predict-pcie-gbps"
    measured = sorted(r["info"]["pcie_h2d_gbps"] for r in results if r["info"].get("pcie_h2d_gbps"))
    if measured:
        return measured[len(measured) // 2], "measured: pinned host-to-device copies (pcie_probe)"
    return H200_PCIE_GBPS, "assumed: the rows measured no link rate"


def combine(results: list[dict], args) -> dict:
    """Figures and ratios of the rows measured (in one run or in several processes)."""
    pcie_gbps, pcie_source = link_input(results, args.predict_pcie_gbps)
    args = argparse.Namespace(**{**vars(args), "predict_pcie_gbps": pcie_gbps})
    rows = {r["mode"]: r["row"] for r in results if "decode" in r["row"]}
    errors = {r["mode"]: r["row"] for r in results if "decode" not in r["row"]}
    info = dict(results[0]["info"])
    info.update(split=next((r["info"]["split"] for r in results if "split" in r["info"]), None))
    rec, n_moe = info["record_bytes"], info["moe_layers"]
    # rows measured before predictions were recorded have no geometry
    geo = msgspec.convert(info["geometry"], Geometry) if "geometry" in info else None
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
    stream_bound = chunk_bound = stream_bound_32k = None
    if zc_gbps and geo is not None:
        # an 8k prompt touches every routed expert of every MoE layer a prefill runs (all but
        # the last: exllamav3's prefill stops after the last block's attention)
        touched = geo.prefill_moe_layers * info["experts"] * rec
        # the bound: every touched expert streamed once at the measured bandwidth
        stream_bound = 8192 / (touched / (zc_gbps * 1e9))
        # what chunked prefill (2,048-token chunks) must stream when nothing stays resident
        chunk_bound = 8192 / (-(-8192 // 2048) * touched / (zc_gbps * 1e9))
        # issue 28's "stream once" at 32k: every expert, once per layer per prompt
        stream_bound_32k = 32768 / (touched / (zc_gbps * 1e9))

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

    def prefill(m, name):  # a row's prefill tok/s at one shape; None without the row or shape
        return rows[m]["prefill"].get(name) if m in rows else None

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
        # per concurrency (rows measured before 2026-12-05's last commits have none)
        "exact_hit_rate_by_concurrency": {
            c: rows["exact"]["decode"][c].get("hit_rate") for c in ("c1", "c2", "c4")
        }
        if "exact" in rows
        else None,
        "exact_loan_hit_rate_by_concurrency": {
            c: rows["exact_loan"]["decode"][c].get("hit_rate") for c in ("c1", "c2", "c4")
        }
        if "exact_loan" in rows
        else None,
        "zero_copy_gbps": zc_gbps,
        "roofline_tok_s": roof,
        "prefill8k_stream_bound_tok_s": stream_bound,
        "prefill8k_per_chunk_stream_bound_tok_s": chunk_bound,
        # issue 28: 32k at 2,048-token chunks (the --long-prefill rows), its one-pass bound,
        # and the layer-major row's pass counters per prompt length
        "prefill_32768_tok_s": {m: rows[m]["prefill"].get("p32768") for m in rows},
        "prefill32k_stream_bound_tok_s": stream_bound_32k,
        "layer_major": rows["exact_layer_major"].get("layer_major")
        if "exact_layer_major" in rows
        else None,
        # the store modes' layer-major rows: their passes per prompt length, with the records
        # and bytes each pass read from the store (last_pass.store_reads / store_bytes)
        "nvme_layer_major": {
            m: rows[m].get("layer_major")
            for m in rows
            if m.startswith("nvme") and m.endswith("_layer_major")
        },  # fmt: skip
    }
    offload = [c1(m) for m in ("stock_offload", "stock_offload_arena") if c1(m)]
    predicted = vs_predicted = {}
    full_prefill = None
    if geo is not None:
        predicted, vs_predicted = predictions(rows, geo, args)
        full_prefill = prefill_inputs(rows, "exact", geo, GLM53_FLASH)
    figures["predicted"] = predicted
    figures["full_model"] = full_model(args, vs_predicted.get("exact"), full_prefill)
    read_rates = {
        r["mode"]: r["info"]["store_read"]["bytes_per_s"]
        for r in results
        if r["mode"] in rows and "store_read" in r["info"]
    }
    figures["store_read_bytes_per_s"] = read_rates
    figures["store_bytes_per_token"], figures["disk_bound_tok_s"] = disk_bounds(rows, read_rates)

    def vs_disk_bound(m):  # decode c1 against its serial bound
        bound = figures["disk_bound_tok_s"].get(m, {}).get("decode_c1")
        return ratio(c1(m), bound["serial"]) if bound else None

    c4_agg = rows["exact"]["decode"]["c4"]["aggregate_tok_s"] if "exact" in rows else None
    fast_c4_agg = rows["fast"]["decode"]["c4"]["aggregate_tok_s"] if "fast" in rows else None
    fast_lane = figures["fast_lane"] = (
        {k: rows["fast"]["lane"].get(k) for k in ("jobs", "fallbacks", "lane_picks", "lane_ms")}
        if "fast" in rows and "lane" in rows["fast"]
        else None
    )
    if fast_lane is not None:  # the router's row: its lane's ms a job, GPU share and wait
        lane = rows["fast"]["lane"]
        zero = {"jobs": 0, "lane_ms": 0.0,
                "layers": [dict.fromkeys(("waits", "gpu_ms", "waited_ms"), 0)
                           for _ in lane.get("layers", [])]}  # fmt: skip
        figures["fast_lane_time"] = where_the_time_goes(zero, lane)
    figures["nvme_lane"] = {  # the nvme rows' lane: as fast_lane, per row
        m: {k: rows[m]["lane"].get(k) for k in ("jobs", "fallbacks", "lane_picks", "lane_ms")}
        for m in ("nvme_ram70", "nvme_ram40")
        if m in rows and "lane" in rows[m]
    }
    figures["nvme_prefetch"] = {  # every nvme_exact row's prefetch counters (zeros: off)
        m: {k: rows[m]["ram"].get(k) for k in PREFETCH_COUNTERS}
        for m in rows
        if m.startswith("nvme_exact") and "ram" in rows[m]
    }
    splits = (rows["fast"].get("fixed_splits") or {}) if "fast" in rows else {}
    figures["fast_fixed_split_c1_tok_s"] = {
        pct: s["decode"]["c1"]["per_stream_tok_s"] for pct, s in splits.items()
    }
    figures["fast_fixed_split_c4_aggregate_tok_s"] = {
        pct: s["decode"]["c4"]["aggregate_tok_s"] for pct, s in splits.items()
    }
    figures["fast_fixed_split_lane"] = {pct: s["lane"] for pct, s in splits.items()}
    by_spin = (rows["fast"].get("fixed_splits_by_spin") or {}) if "fast" in rows else {}
    figures["fast_fixed_split_c1_tok_s_by_spin"] = {
        us: {pct: s["decode"]["c1"]["per_stream_tok_s"] for pct, s in sweep.items()}
        for us, sweep in by_spin.items()
    }
    figures["fast_fixed_split_lane_by_spin"] = {
        us: {pct: s["lane"] for pct, s in sweep.items()} for us, sweep in by_spin.items()
    }
    best_fixed = max(figures["fast_fixed_split_c1_tok_s"].values(), default=None)
    # the router measured right after the sweep, as the sweep is (rows before 2026-12-05's fifth
    # session have none: the row's own c1, measured first)
    after = (rows["fast"].get("router_after_sweep") or {}) if "fast" in rows else {}
    figures["fast_router_after_sweep"] = after or None
    router_c1 = after["decode"]["c1"]["per_stream_tok_s"] if after else c1("fast")
    ratios = {
        "exact_vs_roofline": ratio(ex, roof),
        "exact_vs_zerocopy": ratio(ex, c1("zerocopy")),
        "exact_vs_stock_vram": ratio(ex, c1("stock")),
        "exact_vs_stock_offload": ratio(ex, c1("stock_offload")),
        "exact_vs_best_stock_offload": ratio(ex, max(offload)) if offload else None,
        "exact_vs_exact_clock": ratio(ex, c1("exact_clock")),
        "exact_loan_vs_exact": ratio(c1("exact_loan"), ex),
        # the prefill stage's copy queued first (PrefillStager.copy_first) against exact's
        # order (after the unstage kernel), in the same run
        "exact_copy_first_prefill512_vs_exact": ratio(prefill("exact_copy_first", "p512"),
                                                      prefill("exact", "p512")),
        "exact_copy_first_prefill8k_vs_exact": ratio(prefill("exact_copy_first", "p8192"),
                                                     prefill("exact", "p8192")),
        "exact_copy_first_prefill8k_one_chunk_vs_exact": ratio(
            prefill("exact_copy_first", "p8192_c8192"), prefill("exact", "p8192_c8192")),
        "exact_loan_c4_aggregate_vs_exact": ratio(
            figures["decode_c4_aggregate_tok_s"].get("exact_loan"), c4_agg
        ),
        "exact_loan_vs_best_stock_offload": (
            ratio(c1("exact_loan"), max(offload)) if offload else None
        ),
        "nvme_exact_vs_exact_ram70": ratio(c1("nvme_exact_ram70"), ex),
        "nvme_exact_vs_exact_ram40": ratio(c1("nvme_exact_ram40"), ex),
        "nvme_exact_ram70_vs_disk_bound": vs_disk_bound("nvme_exact_ram70"),
        "nvme_exact_ram40_vs_disk_bound": vs_disk_bound("nvme_exact_ram40"),
        "exact_c4_aggregate_vs_c1": ratio(c4_agg, ex),
        "fast_vs_exact": ratio(c1("fast"), ex),
        "fast_vs_best_stock_offload": ratio(c1("fast"), max(offload)) if offload else None,
        "fast_c4_aggregate_vs_exact": ratio(fast_c4_agg, c4_agg),
        "fast_router_vs_best_fixed_split": ratio(router_c1, best_fixed),
        "nvme_vs_nvme_exact_ram70": ratio(c1("nvme_ram70"), c1("nvme_exact_ram70")),
        "nvme_vs_nvme_exact_ram40": ratio(c1("nvme_ram40"), c1("nvme_exact_ram40")),
        "nvme_exact_ram70_prefetch_vs_off": ratio(c1("nvme_exact_ram70_prefetch"),
                                                  c1("nvme_exact_ram70")),
        "nvme_exact_ram40_prefetch_vs_off": ratio(c1("nvme_exact_ram40_prefetch"),
                                                  c1("nvme_exact_ram40")),
        "nvme_exact_ram70_prefetch_vs_disk_bound": vs_disk_bound("nvme_exact_ram70_prefetch"),
        "nvme_exact_ram40_prefetch_vs_disk_bound": vs_disk_bound("nvme_exact_ram40_prefetch"),
        "fast_lane_fallback_share": fast_lane["fallbacks"] / fast_lane["jobs"]
        if fast_lane and fast_lane["jobs"] and fast_lane["fallbacks"] is not None
        else None,
        "exact_c1_measured_vs_predicted": (vs_predicted.get("exact") or {}).get("decode_c1_tok_s"),
        "measured_vs_predicted": vs_predicted,
        "prefill8k_vs_target_ref": ratio(best8k("exact"), prefill_ref),
        "prefill8k_chunk2048_vs_target_ref": ratio(
            rows["exact"]["prefill"]["p8192"] if "exact" in rows else None, prefill_ref
        ),
        # issue 28: layer-major prefill against the one-pass bound, and against exact's
        # chunk-major 8k at 2,048-token chunks measured in the same run ("before")
        "prefill8k_chunk2048_vs_stream_once": ratio(prefill("exact_layer_major", "p8192"),
                                                    stream_bound),
        "prefill32k_vs_stream_once": ratio(prefill("exact_layer_major", "p32768"),
                                           stream_bound_32k),
        "prefill8k_chunk2048_vs_before": ratio(prefill("exact_layer_major", "p8192"),
                                               prefill("exact", "p8192")),
        "prefill8k_chunk2048_vs_stock_stream": ratio(prefill("exact_layer_major", "p8192"),
                                                     prefill("stock_offload_stream", "p8192")),
        "prefill32k_vs_stock_stream": ratio(prefill("exact_layer_major", "p32768"),
                                            prefill("stock_offload_stream", "p32768")),
        "prefill32k_vs_stock_vram": ratio(prefill("exact_layer_major", "p32768"),
                                          prefill("stock", "p32768")),
        # the same chunks with no link at all: stock with every expert in VRAM pays each
        # chunk's fixed compute as layer-major does, which keeps both below the stream bound
        # on the H200 (glm53.doctor.prefill.chunked_compute_s)
        "prefill8k_chunk2048_vs_stock_vram": ratio(prefill("exact_layer_major", "p8192"),
                                                   prefill("stock", "p8192")),
        "layer_major_decode_c1_vs_exact": ratio(c1("exact_layer_major"), ex),
        # issues 27 and 28: nvme-exact's 8k prefill at 2,048-token chunks with layer-major
        # prefill, against the same tier chunk-major and against exact's (issue 27: >= 0.8)
        "nvme_exact_ram70_layer_major_prefill8k_vs_chunk": ratio(
            prefill("nvme_exact_ram70_layer_major", "p8192"), prefill("nvme_exact_ram70", "p8192")),
        "nvme_exact_ram40_layer_major_prefill8k_vs_chunk": ratio(
            prefill("nvme_exact_ram40_layer_major", "p8192"), prefill("nvme_exact_ram40", "p8192")),
        "nvme_exact_ram70_layer_major_prefill8k_vs_exact": ratio(
            prefill("nvme_exact_ram70_layer_major", "p8192"), prefill("exact", "p8192")),
    }  # fmt: skip
    config = {
        "model": args.model,
        "geometry": info["geometry"],
        "moe_layers": n_moe,
        "experts": info["experts"],
        "record_bytes": rec,
        "share": cache_share(args),
        "vram_budget": args.vram_budget,
        "vram_plan": info.get("vram_plan"),
        "prediction_inputs": {
            "pcie_gbps": args.predict_pcie_gbps,
            "pcie_source": pcie_source,
            "vram_gbps": args.predict_vram_gbps,
            "fp16_tflops": args.predict_fp16_tflops,
        },
        "slots": rows["exact"]["slots"] if "exact" in rows else None,
        "freq_window": rows["exact"].get("freq_window") if "exact" in rows else None,
        "prefill": "8k prompts at 2,048-token chunks (exllamav3's default) and as one 8,192-token "
        "chunk; each length warmed once first; target ref = min(stock at its faster chunk, "
        "stream bound)",
        "long_prefill": "32k at 2,048-token chunks for the stock, exact, exact_layer_major and "
        "stock_offload_stream rows (--long-prefill); stream once = every routed expert of the MoE "
        "layers a prefill runs (all but the last) crossing the link once per prompt at "
        "zero_copy_gbps",
        "stream_t": next(
            (r["info"].get("stream_t") for r in results if r["mode"] == "stock_offload_stream"),
            None,
        ),  # fmt: skip
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


FIXED_SPLITS = (0, 10, 20, 30, 40)  # percent of the misses, issue #26's sweep


def int_list(text: str, top: int, what: str) -> list[int]:
    """A comma list of integers in 0..top (empty entries skipped); `what` names them in the
    error."""
    values = [int(v) for v in text.split(",") if v.strip()]
    bad = [v for v in values if not 0 <= v <= top]
    if bad:
        raise argparse.ArgumentTypeError(f"{what} must be in 0..{top}, got {bad}")
    return values


def percent_list(text: str) -> list[int]:
    return int_list(text, 100, "percentages")


def us_list(text: str) -> list[int]:
    return int_list(text, 1_000_000, "spins in us")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"),
                    help="checkpoint directory (default $GLM53_TEST_SLICE)")  # fmt: skip
    ap.add_argument("--share", type=float, default=None,
                    help="share of the experts exact mode caches (default: 1376/12096, the 24 GB "
                    "card's, without --vram-budget; with it, as many as the budget holds)")  # fmt: skip
    ap.add_argument("--vram-budget", type=parse_size, default=None, metavar="SIZE",
                    help="plan exact mode within SIZE (e.g. 24G) as on a card that size")  # fmt: skip
    ap.add_argument("--predict-pcie-gbps", type=float, default=None,
                    help="the predictions' link rate (default: the rows' measured pinned "
                    "host-to-device rate, glm53/doctor/pcie_probe.py)")  # fmt: skip
    ap.add_argument("--predict-vram-gbps", type=float, default=H200_VRAM_GBPS)
    ap.add_argument("--predict-fp16-tflops", type=float, default=H200_FP16_TFLOPS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="32 decode tokens instead of 128")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated rows to measure, of {','.join(ALL_MODES)} (default: "
                    "all but fast; the nvme_exact rows only with --store)")  # fmt: skip
    ap.add_argument("--store", default=None,
                    help="packed store of --model, for the nvme_exact rows")  # fmt: skip
    ap.add_argument("--read-rate-s", type=float, default=5.0,
                    help="seconds of O_DIRECT reads measuring the store's rate beside each "
                    "nvme row")  # fmt: skip
    ap.add_argument("--read-batch", type=int, default=8,
                    help="records per read batch in that measurement (a decode layer's "
                    "top-k)")  # fmt: skip
    ap.add_argument("--rows-dir", default=None,
                    help="write each row to DIR/row-MODE.json as soon as it is measured")  # fmt: skip
    ap.add_argument("--combine", default=None, metavar="DIR",
                    help="measure nothing: combine the row files in DIR")  # fmt: skip
    ap.add_argument("--fixed-splits", type=percent_list, default=list(FIXED_SPLITS),
                    metavar="PCTS", help="the fast row's sweep of fixed shares of the misses on "
                    "the lane, in percent (default 0,10,20,30,40; '' for none)")  # fmt: skip
    ap.add_argument("--lane-spin-us", type=us_list, default=[], metavar="US",
                    help="repeat the fast row's fixed-split sweep with the lane awake this many "
                    "us after each job, per value (default: none; the lane's own is 200)")  # fmt: skip
    ap.add_argument("--lane-pins", action=argparse.BooleanOptionalAction, default=True,
                    help="the lane rows pin this thread (the engine's) and the lane's poller to "
                    "the cores the lane leaves, as the server does (--no-lane-pins: unpinned, as "
                    "the fast row ran before 2026-12-05's last commits)")  # fmt: skip
    ap.add_argument("--offload-timeout", type=int, default=600,
                    help="seconds for each stock-offload subprocess")  # fmt: skip
    ap.add_argument("--stream-t", type=int, default=8,
                    help="EXL3_MOE_STREAM_T of the stock_offload_stream row: an expert that this "
                    "many tokens of a prefill chunk pick is streamed to the GPU (default 8)")  # fmt: skip
    ap.add_argument("--long-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="the 32k prefill row (2,048-token chunks) for the stock, exact, "
                    "exact_layer_major and stock_offload_stream rows, whose cache then holds "
                    f"{PREFILL_CACHE_TOKENS} tokens (default: on when --modes names "
                    "exact_layer_major)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.combine is not None:
        if not any(f.startswith("row-") for f in os.listdir(args.combine)):
            ap.error(f"--combine {args.combine}: no row-*.json files there")
    else:
        if not args.model:
            ap.error("--model (or GLM53_TEST_SLICE) must name a checkpoint directory")
        if args.modes is None:
            args.modes = ",".join(
                m
                for m in ALL_MODES
                if (args.store or m not in NVME_RAM_SHARE) and m not in ON_REQUEST
            )
        bad = [m for m in args.modes.split(",") if m and m not in ALL_MODES]
        if bad:
            ap.error(f"--modes: unknown {bad}; choose from {', '.join(ALL_MODES)}")
        if not args.store and any(m in NVME_RAM_SHARE for m in args.modes.split(",")):
            ap.error("--modes: the nvme_exact rows need --store DIR (a store of --model)")
        if args.long_prefill is None:
            args.long_prefill = "exact_layer_major" in args.modes.split(",")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.combine:
        files = sorted(f for f in os.listdir(args.combine) if f.startswith("row-"))
        results = [json.load(open(os.path.join(args.combine, f))) for f in files]
        results.sort(key=lambda r: ALL_MODES.index(r["mode"]))
    else:
        # the link's pinned host-to-device rate as glm53 doctor measures it on a user's host
        # (glm53/doctor/pcie_probe.py), the predictions' link input unless --predict-pcie-gbps:
        # once a run, before any load, its buffers handed back so that no load plans around
        # the allocator's cached block (glm53.exl3.loader reads the free VRAM)
        args.pcie_h2d_gbps = pcie_h2d_gbps(0)
        torch.cuda.empty_cache()
        modes = [m for m in args.modes.split(",") if m]
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
