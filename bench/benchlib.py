"""What every benchmark records beside its figures. The benchmarks run as scripts
(`python bench/NAME.py`), so their folder is on sys.path and they import this as `benchlib`."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host_fields() -> dict:
    """Commit, host name, CPU count, 1-minute load average and Python version, for `config`."""
    return {
        "commit": git_commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def token_id_top(entry: dict[str, float]) -> dict[int, float]:
    """A logprobs `top_logprobs` entry written with return_tokens_as_token_ids ("token_id:N")
    as {id: logprob}."""
    return {int(t.removeprefix("token_id:")): v for t, v in entry.items()}


def server_top_k(
    client: httpx.Client, model: str, ids: list[int], k: int
) -> list[dict[int, float]]:
    """The server's top-k (id -> logprob) at each position of a prompt (n - 1 positions), the
    scored token's own logprob included."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 0,
        "echo": True,
        "logprobs": k,
        "return_tokens_as_token_ids": True,
    }
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    lp = response.json()["choices"][0]["logprobs"]
    out = []
    for i in range(1, len(ids)):
        top = token_id_top(lp["top_logprobs"][i])
        top.setdefault(ids[i], lp["token_logprobs"][i])
        out.append(top)
    return out


def sse_events(client: httpx.Client, path: str, body: dict):
    """The decoded events of one streamed POST (server-sent `data:` lines up to `[DONE]`); an
    in-band error event raises RuntimeError with its message."""
    with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            yield event
