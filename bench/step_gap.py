"""The engine thread's time between two steps at 1 stream, in one process, next to its floors.

At 1 stream bench/server_overhead.py's added latency per token is this time: the client's gap
between tokens is one engine step plus what the engine thread does before it starts the next
one (sample, bookkeeping, the post to the event loop, planning); the event loop's and the
client's work per token overlap the next step and only shift every arrival. This runs the real
Scheduler on the scripted engine (no HTTP) and, for scale, floors on the same host: a thread that
only sleeps one step at a time, and one that sleeps and then wakes the event loop once per step,
with the scheduler's Handoff (glm53._handoff) or with loop.call_soon_threadsafe: the least any
step-then-post loop pays.

    python bench/step_gap.py [--json] [--step-ms 40] [--tokens 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvloop
from benchlib import host_fields

sys.path.insert(0, str(Path(__file__).parent))
from server_overhead import WORD, make_checkpoint  # noqa: E402

from glm53._handoff import Handoff  # noqa: E402
from glm53.engine.sampling import SamplingParams  # noqa: E402
from glm53.engine.scheduler import GenerationRequest, Scheduler  # noqa: E402
from glm53.engine.scripted import Script, ScriptedEngine  # noqa: E402


async def scheduler_gaps(checkpoint: Path, step_ms: float, tokens: int) -> list[float]:
    """us between the end of one engine.step and the start of the next, one stream, greedy."""
    engine = ScriptedEngine(
        checkpoint,
        Script(default="</think>" + WORD * tokens, step_ms=step_ms),
        context_length=1024,
        num_slots=1,
    )
    marks: list[tuple[int, int]] = []
    step = engine.step

    def timed_step(work):
        start = time.perf_counter_ns()
        logits = step(work)
        marks.append((start, time.perf_counter_ns()))
        return logits

    engine.step = timed_step
    scheduler = Scheduler(engine, max_batch=1, chunk_size=512, queue_limit=1)
    await scheduler.start()
    eos = frozenset(engine.tokenizer.eos_token_ids)
    async for event in scheduler.submit(
        GenerationRequest([1, 2, 3], SamplingParams(temperature=0.0), tokens, eos)
    ):
        event.text.encode()
    await scheduler.close()
    return [(marks[i + 1][0] - marks[i][1]) / 1e3 for i in range(2, len(marks) - 1)]


async def floor_gaps(step_ms: float, steps: int, post: str) -> list[float]:
    """us from the end of one sleep to the start of the next, with one post per step through
    `post` ("handoff", "call_soon") or none ("")."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    gaps: list[float] = []
    handoff = Handoff(loop)
    wake = handoff.post if post == "handoff" else loop.call_soon_threadsafe

    def noop() -> None:
        pass

    def run() -> None:
        last = None
        for _ in range(steps):
            if last is not None:
                gaps.append((time.perf_counter_ns() - last) / 1e3)
            time.sleep(step_ms / 1e3)
            last = time.perf_counter_ns()
            if post:
                wake(noop)
        handoff.post(done.set)

    threading.Thread(target=run, daemon=True).start()
    await done.wait()
    handoff.close()
    return gaps[2:]


def stats(gaps: list[float]) -> dict:
    return {
        "mean_us": round(statistics.mean(gaps), 1),
        "median_us": round(statistics.median(gaps), 1),
    }


async def main_async(args) -> dict:
    out: dict[str, list] = {
        "scheduler": [],
        "floor_sleep_handoff": [],
        "floor_sleep_call_soon": [],
        "floor_sleep": [],
    }
    with tempfile.TemporaryDirectory(prefix="glm53-step-gap-") as tmp:
        checkpoint = make_checkpoint(Path(tmp))
        for _ in range(args.rounds):  # interleaved, so each sees the same host
            out["scheduler"].append(await scheduler_gaps(checkpoint, args.step_ms, args.tokens))
            for post in ("handoff", "call_soon", ""):
                name = f"floor_sleep_{post}" if post else "floor_sleep"
                out[name].append(await floor_gaps(args.step_ms, args.tokens, post))
    return {name: stats([g for r in rounds for g in r]) for name, rounds in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument("--step-ms", type=float, default=40.0, help="engine time per step")
    parser.add_argument("--tokens", type=int, default=100, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # as glm53 serve sets it
    figures = uvloop.run(main_async(args))
    result = {
        "bench": "step_gap",
        "figures": figures,
        "config": {
            "step_ms": args.step_ms,
            "tokens": args.tokens,
            "rounds": args.rounds,
            **host_fields(),
        },
    }
    if not args.json:
        for name, f in figures.items():
            print(f"{name:22s} mean {f['mean_us']:7.1f} us  median {f['median_us']:7.1f} us")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
