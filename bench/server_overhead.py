"""What the server adds to each streamed token: a real `glm53 serve` with the scripted engine
(each step takes a fixed time), C concurrent chat streams over HTTP, side by side with the same
engine stepped directly in this process.

added per stream token = (a stream's time between tokens, as its client sees it)
                         - (the engine's own time per step, from the server's counters)
added per token        = added per stream token / streams per step (the server's cost per
                         generated token; equal to the former at 1 stream)
Target: <= 0.1 ms per token added; 0 errors at 256 streams.

    python bench/server_overhead.py [--json] [--step-ms 40] [--tokens 100] [--conc 1 64 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from benchlib import host_fields

from glm53.chat.render import default_template
from glm53.engine.scripted import Script, ScriptedEngine
from glm53.models.tokenizer import write_tokenizer

WORD = " x"  # one token per word with the synthetic tokenizer (checked at start)
MODEL = "glm-5.3-flash"


def make_checkpoint(directory: Path) -> Path:
    template = default_template()
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    write_tokenizer(directory, 2048, template, 65536)
    (directory / "config.json").write_text('{"model_type": "glm5_next"}', encoding="utf-8")
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def content_tokens(event: bytes) -> int:
    """Tokens in one chat chunk: the content is WORD repeated, so count its letters."""
    at = event.find(b'"content":"')
    if at < 0:
        return 0
    end = event.find(b'"', at + 11)
    return event.count(b"x", at + 11, end)


async def one_stream(client: httpx.AsyncClient, tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[tuple[float, int]] = []  # (time, content tokens so far)
    count, done, start, buf = 0, False, time.perf_counter(), b""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}"}
            async for data in response.aiter_raw():
                now = time.perf_counter()
                *events, buf = (buf + data).split(b"\n\n")
                for event in events:
                    if event == b"data: [DONE]":
                        done = True
                    elif b'"error"' in event[:20]:
                        return {"error": event.decode(errors="replace")}
                    elif n := content_tokens(event):
                        count += n
                        arrivals.append((now, count))
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not done or count != tokens:
        return {"error": f"stream ended with {count} of {tokens} tokens (done={done})"}
    (t0, n0), (t1, n1) = arrivals[0], arrivals[-1]
    return {
        "ttft_ms": (t0 - start) * 1e3,
        "gap_ms": (t1 - t0) / (n1 - n0) * 1e3,
        "chunks": len(arrivals),
    }


async def run_level(url: str, conc: int, tokens: int) -> list[dict]:
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, tokens) for _ in range(conc)))


def start_server(
    checkpoint: Path, script_path: Path, port: int, max_batch: int, log: Path
) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "glm53",
        "serve",
        "--engine",
        "scripted",
        "--script",
        str(script_path),
    ]
    args += ["--model", str(checkpoint), "--port", str(port), "--max-batch", str(max_batch)]
    args += ["--queue-limit", str(max_batch), "--log-level", "warning"]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become ready:\n{log.read_text()}")


def engine_counters(url: str) -> tuple[int, float]:
    engine = httpx.get(url + "/stats", timeout=30).json()["engine"]
    return engine["steps"], engine["busy_seconds"]


def measure(url: str, conc: int, tokens: int) -> dict:
    """One round of `conc` streams; the engine's own time per step comes from the server's
    counters over the same round."""
    steps0, busy0 = engine_counters(url)
    results = asyncio.run(run_level(url, conc, tokens))
    steps1, busy1 = engine_counters(url)
    ok = [r for r in results if "error" not in r]
    step_ms = (busy1 - busy0) / max(1, steps1 - steps0) * 1e3
    gap_ms = statistics.mean(r["gap_ms"] for r in ok) if ok else float("nan")
    return {
        "engine_step_ms": step_ms,
        "stream_gap_ms": gap_ms,
        "added_ms": gap_ms - step_ms,
        "ttft_ms": statistics.median(r["ttft_ms"] for r in ok) if ok else float("nan"),
        "chunks": statistics.mean(r["chunks"] for r in ok) if ok else float("nan"),
        "errors": [r["error"] for r in results if "error" in r],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument("--step-ms", type=float, default=40.0, help="engine time per step")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument(
        "--conc", type=int, nargs="+", default=[1, 64, 256], help="concurrent streams"
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="rounds per level; the median is reported"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="glm53-overhead-") as tmp:
        tmp_path = Path(tmp)
        checkpoint = make_checkpoint(tmp_path)
        probe = ScriptedEngine(checkpoint, Script(), context_length=1024, num_slots=1)
        probe.load()
        if len(probe.tokenizer.encode(WORD * 10)) != 10:
            raise SystemExit(f"{WORD!r} is not one token with this tokenizer; pick another word")
        script_path = tmp_path / "script.json"
        script_path.write_text(
            json.dumps({"default": "</think>" + WORD * args.tokens, "step_ms": args.step_ms})
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(checkpoint, script_path, port, max(args.conc), tmp_path / "server.log")
        rounds: dict[int, list[dict]] = {}
        try:
            asyncio.run(run_level(url, 2, args.tokens))  # warm-up
            for conc in args.conc:
                rounds[conc] = [measure(url, conc, args.tokens) for _ in range(args.reps)]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)

    figures, rows = {}, []
    for conc, results in rounds.items():
        best = sorted(results, key=lambda r: r["added_ms"])[len(results) // 2]  # the median round
        errors = [e for r in results for e in r["errors"]]
        figures.update(
            {
                f"c{conc}_engine_step_ms": round(best["engine_step_ms"], 4),
                f"c{conc}_stream_gap_ms": round(best["stream_gap_ms"], 4),
                f"c{conc}_added_ms_per_stream_token": round(best["added_ms"], 4),
                f"c{conc}_added_ms_per_token": round(best["added_ms"] / conc, 5),
                f"c{conc}_ttft_ms": round(best["ttft_ms"], 2),
                f"c{conc}_chunks_per_stream": round(best["chunks"], 1),
                f"c{conc}_errors": len(errors),
            }
        )
        rows.append((conc, best, len(errors), errors[:1]))
    levels = list(rounds)
    result = {
        "bench": "server_overhead",
        "figures": figures,
        "ratios": {
            f"c{c}_added_per_token_over_target": round(figures[f"c{c}_added_ms_per_token"] / 0.1, 4)
            for c in levels
        },
        "config": {
            "step_ms": args.step_ms,
            "tokens_per_stream": args.tokens,
            "conc": args.conc,
            "reps": args.reps,
            "target_added_ms_per_token": 0.1,
            "target_errors_at_256": 0,
            "definitions": "added_ms_per_stream_token = client gap between a stream's tokens - engine time per "
            "step (server counters, same rounds); added_ms_per_token = that / streams per step",
            **host_fields(),
        },
    }
    if not args.json:
        print(
            f"{'streams':>8} {'engine ms/step':>15} {'client ms/token':>16} {'added/stream':>13} "
            f"{'added/token':>12} {'ttft ms':>8} {'errors':>7}"
        )
        for conc, best, n_err, first_err in rows:
            print(
                f"{conc:>8} {best['engine_step_ms']:>15.3f} {best['stream_gap_ms']:>16.3f} {best['added_ms']:>13.3f} "
                f"{best['added_ms'] / conc:>12.4f} {best['ttft_ms']:>8.1f} {n_err:>7}"
            )
            if first_err:
                print(f"{'':>8} first error: {first_err[0]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
