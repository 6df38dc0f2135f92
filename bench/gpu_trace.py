"""Where the GPU's time goes, scenario by scenario: each one traced once with torch.profiler
(CUPTI's kernels and copies beside the host's CUDA calls) on the slice, and read by
bench/tracelib.py into lead / kernel / copy / overlap / idle / tail, the longest idle gaps with
the host call behind each, the top kernels and glm53's own kernels (the lane's wait above all).

    python bench/gpu_trace.py --model SLICE [--json] [--modes stock,exact,fast]
                              [--fast-shares router,0,20] [--lane-spin-us 5000]
                              [--keep-traces DIR]

Two open questions it is for, both measured on the H200 and not explained by a bench's totals:
- issue 29: exact mode's prefill costs about 100-125 ms a prompt that the cost model does not
  have (docs/performance.md, "Prefill: where the time goes"). The stock row (every expert in
  VRAM) and the exact row run the same prompts (512; 8k in one chunk; 8k at 2,048-token chunks),
  and `figures.prefill_exact_vs_stock` splits exact's extra wall time into host lead and tail,
  kernel time, copy not hidden under a kernel, and GPU idle. On an H100 (2026-12-05) most of it
  was kernel time: exllamav3's MoE kernels for few-token experts (exl3_moe_kernel<3, 256, 2,
  16>) took 2.7-5.8x stock's, about 85 ms more a prompt at every prefill shape; the launches
  that a copy overlapped are counted apart (`kernels[].beside_copy`) to tell whether the stage
  copies running beside them are why.
- issue 26: in fast mode any share of the misses on the lane cost about 0.5 ms a MoE layer
  (2026-12-05). The fast scenarios decode at 1 stream at the router's split and at fixed shares;
  `named.lane_wait` is how long each layer's wait kernel held the GPU for the lane, beside the
  lane's own times (`lane`, from FastLane.stats, as bench/gpu_slice.py's where_the_time_goes).

Each scenario runs untraced first (the same shape, another prompt: once to warm, once timed),
then traced. The profiler adds a few us to each launch and op on the host:
`ratios.traced_vs_untraced` gives its cost per scenario. Read the structure (what overlaps,
where the GPU idles, what it waits behind), not the absolute speed; bench/gpu_slice.py
measures speed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import tracelib  # noqa: E402
from benchlib import host_fields  # noqa: E402

# exact_copy_first: exact with PrefillStager.copy_first (the stage's copy queued before the
# unstage kernel; not yet the default): --modes names it only
MODES = ("stock", "exact", "fast", "exact_copy_first")
DEFAULT_MODES = ("stock", "exact", "fast")
PREFILLS = (("p512", 512, 2048), ("p8192_c8192", 8192, 8192), ("p8192", 8192, 2048))
DECODES = (("decode_c1", 1), ("decode_c4", 4))
PROMPT, FAST_STEPS = 512, 48


def share_list(text: str) -> list[int | None]:
    """'router,0,20' -> [None, 0, 20] (None: the router's own split; the percents as
    bench/gpu_slice.py's --fixed-splits reads them)."""
    from gpu_slice import percent_list

    words = [v.strip() for v in text.split(",") if v.strip()]
    if not words:
        raise argparse.ArgumentTypeError("name at least one share")
    return [None if v == "router" else percent_list(v)[0] for v in words]


def cpu_list(text: str) -> list[int]:
    """'15' or '14,15' -> [15] / [14, 15]: CPU ids, each at least 0."""
    try:
        cpus = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: name CPUs as comma-separated ids") from None
    if not cpus or cpus[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: name at least one CPU id, each >= 0")
    return cpus


def parse_args(argv=None) -> argparse.Namespace:
    from gpu_slice import us_list

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("GLM53_TEST_SLICE"),
                    help="checkpoint directory (default $GLM53_TEST_SLICE)")  # fmt: skip
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, of {','.join(MODES)}")  # fmt: skip
    ap.add_argument("--share", type=float, default=None,
                    help="exact's cache as a share of the experts (bench/gpu_slice.py's default)")  # fmt: skip
    ap.add_argument("--decode-steps", type=int, default=16,
                    help="traced decode steps of the stock and exact scenarios")  # fmt: skip
    ap.add_argument("--fast-shares", type=share_list, default=[None, 0, 20],
                    help="fast's decode scenarios: 'router' and fixed percents of the misses on "
                    "the lane (default router,0,20)")  # fmt: skip
    ap.add_argument("--lane-spin-us", type=us_list, default=[],
                    help="also trace the last fixed share with the lane awake this many us after "
                    "each job, per value (MailboxLane.idle_spin_ns; the lane's default is 200)")  # fmt: skip
    ap.add_argument("--lane-pins", action=argparse.BooleanOptionalAction, default=True,
                    help="pin this thread and the lane's poller off the lane's cores for the fast "
                    "scenarios, as the server does (bench/gpu_slice.py's --lane-pins)")  # fmt: skip
    ap.add_argument("--poller-cpus", type=cpu_list, default=None, metavar="LIST",
                    help="also trace the last fixed share with the lane's mailbox poller pinned "
                    "to these CPUs (e.g. a lane core) instead of beside the engine thread: does "
                    "its spin take the engine thread's core?")  # fmt: skip
    ap.add_argument("--keep-traces", default=None, metavar="DIR",
                    help="write each scenario's trace there, gzipped")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model (or GLM53_TEST_SLICE) must name a checkpoint directory")
    bad = [m for m in args.modes.split(",") if m and m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if args.decode_steps < 1:
        ap.error("--decode-steps must be at least 1")
    return args


class Tracer:
    """Runs scenarios under torch.profiler and keeps each one's summary."""

    def __init__(self, keep: str | None):
        self.keep = keep
        if keep:
            os.makedirs(keep, exist_ok=True)

    def run(self, label: str, fn, untraced_ms: float | None = None) -> dict:
        """`fn()` inside tracelib.SCENARIO, traced; its summary (and fn's return as `extra`).
        `untraced_ms`: the same scenario's wall time without the profiler, for its overhead."""
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(tracelib.SCENARIO):
                extra = fn()
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                trace = json.load(f)
            if self.keep:
                with (
                    open(path, "rb") as src,
                    gzip.open(os.path.join(self.keep, f"{label}.json.gz"), "wb") as dst,
                ):
                    shutil.copyfileobj(src, dst)
        summary = tracelib.summarize(trace)
        summary["steps"] = tracelib.steps(trace)
        if untraced_ms:  # the profiler's own cost: read the structure, not the speed, above ~1.1
            summary["untraced_wall_ms"] = untraced_ms
            summary["traced_vs_untraced"] = summary["wall_ms"] / untraced_ms
        if extra:
            summary["extra"] = extra
        print(f"# {label}: wall {summary['wall_ms']:.1f} ms, lead {summary['lead_ms']:.1f}, "
              f"kernel {summary['kernel_ms']:.1f}, copy {summary['copy_ms']:.1f} "
              f"(hidden {summary['overlap_ms']:.1f}), idle {summary['idle_ms']:.1f}, "
              f"tail {summary['tail_ms']:.1f}", flush=True)  # fmt: skip
        return summary


def timed_ms(fn) -> float:
    """fn()'s wall time in ms, the device synchronized before and after."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def prefill_generator(loaded, chunk: int):
    """A Generator at `chunk`-token chunks, built outside any timed or traced region (as
    bench/gpu_slice.py's prefill_run builds its own before its clock starts)."""
    from exllamav3 import Generator

    return Generator(model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer,
                     max_batch_size=4, max_chunk_size=chunk)  # fmt: skip


def prefill_once(gen, vocab: int, n_tokens: int, seed: int) -> None:
    """One prompt of n_tokens random ids (a fresh prompt per seed: no prefix to reuse) to its
    first token on `gen`."""
    import torch
    from exllamav3 import ArgmaxSampler, Job

    ids = torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(seed))
    gen.enqueue(Job(input_ids=ids, max_new_tokens=1, sampler=ArgmaxSampler(), stop_conditions=[]))
    for _ in range(4 * n_tokens):  # bounded: one iteration per chunk, and the first token
        if not gen.num_remaining_jobs():
            return
        gen.iterate()
    raise RuntimeError(f"a {n_tokens}-token prompt did not finish its prefill in the bound")


def decode_setup(loaded, batch: int, seed: int, max_new: int, step=None):
    """A Generator with `batch` streams past their prefill (each has its first token); `step`
    after each iteration, as the engine calls fast's router."""
    import torch
    from exllamav3 import ArgmaxSampler, Generator, Job

    gen = Generator(model=loaded.model, cache=loaded.cache, tokenizer=loaded.tokenizer,
                    max_batch_size=4)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        ids = torch.randint(0, loaded.config.vocab_size, (1, PROMPT), generator=g)
        gen.enqueue(Job(input_ids=ids, max_new_tokens=max_new, sampler=ArgmaxSampler(),
                        stop_conditions=[], identifier=i))  # fmt: skip
    started: set = set()
    for _ in range(64 * batch):  # bounded: a 512-token prompt is one chunk
        for r in gen.iterate():
            if r.get("stage") == "streaming" and "token_ids" in r:
                started.add(r["identifier"])
        if step is not None:
            step()
        if len(started) == batch:
            return gen
    raise RuntimeError(f"decode setup: {len(started)} of {batch} streams started in the bound")


def decode_steps(gen, n: int, step=None) -> int:
    """n Generator iterations, each in a tracelib.STEP range (then `step`, fast's router)."""
    from torch.profiler import record_function

    done = 0
    for _ in range(n):
        if not gen.num_remaining_jobs():
            break
        with record_function(tracelib.STEP):
            gen.iterate()
            if step is not None:
                step()
        done += 1
    return done


def drain(gen, step=None) -> None:
    """Finish a scenario's streams (a later Generator reuses the cache's pages)."""
    for _ in range(256):
        if not gen.num_remaining_jobs():
            return
        gen.iterate()
        if step is not None:
            step()
    raise RuntimeError("a scenario's streams did not finish within 256 iterations")


def load(args, mode: str):
    from exllamav3 import Config
    from gpu_slice import CACHE_TOKENS, MAX_BATCH, MAX_CHUNK, exact_kwargs

    from glm53.exl3 import loader as exl3_load
    from glm53.exl3.loader import moe_geometry
    from glm53.exl3.options import LoadOptions

    geo = moe_geometry(Config.from_directory(args.model).stc)
    kw = {}
    if mode != "stock":  # exact's cache at --share (gpu_slice's default share; no VRAM budget)
        shaped = argparse.Namespace(share=args.share, vram_budget=None)
        kw = exact_kwargs(shaped, "exact", geo.n_experts, len(geo.moe_layers))
    loaded = exl3_load.load(args.model, LoadOptions(
        mode="stock" if mode == "stock" else "exact", cache_tokens=CACHE_TOKENS,
        max_batch=MAX_BATCH, max_chunk=MAX_CHUNK, **kw,
    ))  # fmt: skip
    if mode == "exact_copy_first":
        loaded.stager.copy_first = True
    return loaded


def trace_mode(args, mode: str, tracer: Tracer) -> dict:
    """Every scenario of one row: prefills and decodes (stock, exact), or fast's decodes."""
    import torch

    out: dict = {}
    with torch.inference_mode():
        loaded = load(args, mode)
        try:
            if mode in ("stock", "exact", "exact_copy_first"):
                vocab = loaded.config.vocab_size
                for name, n, chunk in PREFILLS:
                    gen = prefill_generator(loaded, chunk)
                    prefill_once(gen, vocab, n, seed=100)  # warm: this shape, another prompt
                    plain = timed_ms(lambda g=gen, n=n: prefill_once(g, vocab, n, 101))
                    out[name] = tracer.run(f"{mode}-{name}",
                                           lambda g=gen, n=n: prefill_once(g, vocab, n, 1), plain)  # fmt: skip
                steps = args.decode_steps
                for name, batch in DECODES:
                    gen = decode_setup(loaded, batch, seed=2, max_new=2 * steps + 12)
                    decode_steps(gen, 4)  # warm
                    plain = timed_ms(lambda g=gen: decode_steps(g, steps))
                    out[name] = tracer.run(f"{mode}-{name}",
                                           lambda g=gen: {"steps": decode_steps(g, steps)}, plain)  # fmt: skip
                    drain(gen)
            else:
                out.update(trace_fast(args, loaded, tracer))
        finally:
            loaded.close()
            torch.cuda.empty_cache()
    return out


def trace_fast(args, loaded, tracer: Tracer) -> dict:
    """fast's decode at 1 stream: at each share of --fast-shares, then (with --lane-spin-us)
    at the last share with the lane awake longer; the lane's times beside each trace."""
    from gpu_slice import start_fast_row, where_the_time_goes

    from glm53.exl3 import stop_fast, trace_fast_ranges
    from glm53.tiers.thread_pins import lane_threads_pinned, pin_thread

    trace_fast_ranges(True)  # the lane path's host work in named ranges (g53_fast_*)
    fast = start_fast_row(args, loaded)
    default_spin = fast.lane.idle_spin_ns
    plan = [(s, None, None) for s in args.fast_shares]
    plan += [(args.fast_shares[-1], us, None) for us in args.lane_spin_us]
    if args.poller_cpus:
        plan.append((args.fast_shares[-1], None, args.poller_cpus))
    out = {}
    # this thread and the poller off the lane's cores, as served (--no-lane-pins: unpinned)
    with lane_threads_pinned(fast.lane, args.lane_pins) as pins:
        served_poller = pins.get("lane_poller")
        try:
            for share, spin_us, poller_cpus in plan:
                fast.router.set_forced_share(None if share is None else share / 100)
                fast.lane.idle_spin_ns = default_spin if spin_us is None else spin_us * 1000
                label = "router" if share is None else f"share{share}"
                label += "" if spin_us is None else f"_spin{spin_us}us"
                if poller_cpus is not None:  # the poller away from the engine thread's cores
                    pins["lane_poller"] = pin_thread("lane_poller", fast.lane.poller.native_id,
                                                     poller_cpus)  # fmt: skip
                    label += "_poller" + "-".join(map(str, poller_cpus))
                gen = decode_setup(loaded, 1, seed=3, max_new=2 * FAST_STEPS + 40, step=fast.step)
                decode_steps(gen, 24, fast.step)  # warm: the router fits its rates here
                plain = timed_ms(lambda g=gen: decode_steps(g, FAST_STEPS, fast.step))
                before = fast.stats()
                summary = tracer.run(f"fast-decode_c1-{label}",
                                     lambda g=gen: {"steps": decode_steps(g, FAST_STEPS, fast.step)}, plain)  # fmt: skip
                summary["lane"] = where_the_time_goes(before, fast.stats())
                summary["thread_pins"] = {role: list(pin.cpus) for role, pin in pins.items()}
                drain(gen, fast.step)
                out[f"decode_c1_{label}"] = summary
        finally:
            fast.router.set_forced_share(None)
            fast.lane.idle_spin_ns = default_spin
            if served_poller is not None:
                pin_thread("lane_poller", served_poller.native_id, served_poller.cpus)
            trace_fast_ranges(False)
            stop_fast(fast, loaded)
    return out


def combine(figures: dict) -> dict:
    """The bench's ratios and the exact-vs-stock prefill breakdowns from the scenario summaries."""
    ratios: dict = {"gpu_busy_share": {}, "copy_hidden_share": {}, "lane_wait_share": {},
                    "traced_vs_untraced": {}}  # fmt: skip
    for mode, scenarios in figures.items():
        for name, s in scenarios.items():
            key = f"{mode}.{name}"
            busy = s["gpu_span_ms"] - s["idle_ms"]
            ratios["gpu_busy_share"][key] = busy / s["wall_ms"] if s["wall_ms"] else None
            if s["copy_ms"]:
                ratios["copy_hidden_share"][key] = s["overlap_ms"] / s["copy_ms"]
            if s.get("traced_vs_untraced"):
                ratios["traced_vs_untraced"][key] = s["traced_vs_untraced"]
            wait = s["named"].get("lane_wait")
            if wait and wait["count"]:
                ratios["lane_wait_share"][key] = wait["total_ms"] / s["wall_ms"]
    vs, first = {}, {}
    stock, exact = figures.get("stock", {}), figures.get("exact", {})
    copy_first = figures.get("exact_copy_first", {})
    for name, _, _ in PREFILLS:
        if name in stock and name in exact:
            vs[name] = tracelib.breakdown(exact[name], stock[name])
        if name in stock and name in copy_first:
            first[name] = tracelib.breakdown(copy_first[name], stock[name])
    return {"ratios": ratios, "prefill_exact_vs_stock": vs, "prefill_copy_first_vs_stock": first}


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    tracer = Tracer(args.keep_traces)
    started = time.perf_counter()
    figures, errors = {}, {}
    for mode in (m for m in args.modes.split(",") if m):
        try:
            figures[mode] = trace_mode(args, mode, tracer)
        except Exception as e:  # a row that fails is reported, the others still run
            errors[mode] = f"{type(e).__name__}: {e}"
            print(f"# {mode} failed: {errors[mode]}", flush=True)
    extra = combine(figures)
    result = {
        "bench": "gpu_trace",
        "figures": {
            **figures,
            "prefill_exact_vs_stock": extra["prefill_exact_vs_stock"],
            "prefill_copy_first_vs_stock": extra["prefill_copy_first_vs_stock"],
        },
        "ratios": extra["ratios"],
        "config": {
            "model": args.model,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "share": args.share,
            "decode_steps": args.decode_steps,
            "fast_steps": FAST_STEPS,
            "fast_shares": ["router" if s is None else s for s in args.fast_shares],
            "lane_spin_us": args.lane_spin_us,
            "lane_pins": args.lane_pins,
            "poller_cpus": args.poller_cpus,
            "prefills": [list(p) for p in PREFILLS],
            "errors": errors,
            "seconds": round(time.perf_counter() - started, 1),
            **host_fields(),
        },
    }
    print(json.dumps(result, default=float))
    return 1 if errors and not figures else 0


if __name__ == "__main__":
    sys.exit(main())
