"""A glm53 fleet on 127.0.0.1 for tests/test_fleet.py and bench/fleet.py: three scripted
replicas behind a real sglang-router (the router docs/fleet.md describes), a steady load of
streamed and plain chat requests through it, one replica SIGKILLed and restarted, another
drained with SIGTERM. `run_fleet` returns what happened; the callers judge it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from serving_kit import Server, free_port, write_script, write_tokenizer_checkpoint

# A stream is 30 tokens at 30 ms a step (about 1 s); a plain answer is 3 tokens.
STREAM_ANSWER = " ".join(["word"] * 30)
SCRIPT = {
    "replies": [{"when": "stream me", "text": "</think>" + STREAM_ANSWER, "step_ms": 30}],
    "default": "</think>ok fine",
}
NUM_CLIENTS = 6
DRAIN_TIMEOUT_S = 20.0
# a drained replica answers 503 this long before its port closes: twice the router's 1 s checks
DRAIN_GRACE_S = 2.0
# The router's settings (docs/fleet.md explains each): health checks every second, one failed
# check takes a replica out and one good check brings it back, failed attempts retried on
# another replica, and a circuit breaker that lets a restarted replica back within seconds.
# round_robin, not the cache_aware policy docs/fleet.md recommends: cache_aware keeps sending
# new conversations to the replicas whose prefix trees match them, so when a restarted
# replica gets its first request is up to the prompts; round robin makes it the next turn.
ROUTER_FLAGS = [
    "--policy",
    "round_robin",
    "--health-check-endpoint",
    "/health",
    "--health-check-interval-secs",
    "1",
    "--health-check-timeout-secs",
    "2",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
    "--retry-max-retries",
    "5",
    "--retry-initial-backoff-ms",
    "50",
    "--retry-max-backoff-ms",
    "500",
    "--cb-failure-threshold",
    "5",
    "--cb-timeout-duration-secs",
    "2",
    "--request-timeout-secs",
    "60",
]


@dataclass(slots=True)
class Outcome:
    """One request through the router, as its client saw it (time.monotonic seconds)."""

    kind: str  # stream | plain
    start_s: float
    end_s: float
    ok: bool
    finish: str | None = None
    text: str = ""
    error: str = ""


@dataclass
class FleetRun:
    outcomes: list[Outcome] = field(default_factory=list)
    kill_s: float = 0.0
    restart_ready_s: float = 0.0  # the restarted replica's /health answered 200
    rejoin_s: float | None = None  # ... to its first chat request routed by the router
    term_s: float = 0.0
    exit_s: float = 0.0  # the drained replica's exit
    drain_exit_code: int | None = None
    drain_s: float = 0.0  # SIGTERM to exit
    drained_replica_log: str = ""
    router_retries: float = 0.0
    router_metrics: str = ""
    hung_clients: int = 0

    def numbers(self) -> dict:
        plain = [o for o in self.outcomes if o.kind == "plain"]
        streams = [o for o in self.outcomes if o.kind == "stream"]
        return {
            "requests": len(self.outcomes),
            "plain_requests": len(plain),
            "plain_failures": sum(not o.ok for o in plain),
            "stream_requests": len(streams),
            "stream_errors": sum(not o.ok for o in streams),
            "streams_cut_by_the_kill": sum(
                not o.ok and o.start_s < self.kill_s <= o.end_s for o in streams
            ),
            "router_retries": self.router_retries,
            "rejoin_s": None if self.rejoin_s is None else round(self.rejoin_s, 3),
            "drain_s": round(self.drain_s, 3),
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "drain_exit_code": self.drain_exit_code,
            "hung_clients": self.hung_clients,
        }

    def timeline(self) -> str:
        """The steps' times, in seconds after the kill (to place a failed request)."""
        steps = {
            "restarted replica ready": self.restart_ready_s,
            "SIGTERM to the drained replica": self.term_s,
            "drained replica exited": self.exit_s,
        }
        return ", ".join(f"{name} at {t - self.kill_s:+.2f} s" for name, t in steps.items() if t)


def _replica(tmp: Path, index: int, port: int | None = None) -> Server:
    return Server(
        [
            "--engine",
            "scripted",
            "--script",
            str(tmp / "script.json"),
            "--model",
            str(tmp / "checkpoint"),
            "--max-batch",
            "4",
            "--drain-timeout",
            str(DRAIN_TIMEOUT_S),
            "--drain-grace",
            str(DRAIN_GRACE_S),
        ],
        log_path=tmp / f"replica{index}.log",
        port=port,
    )


def _chat_requests(url: str) -> int:
    """POST /v1/chat/completions answered by one replica, from its /stats."""
    stats = httpx.get(url + "/stats", timeout=5).json()
    return stats["requests_by_route"].get("/v1/chat/completions", 0)


def _is_busy(url: str, twice_in_s: float) -> bool:
    """The replica runs a request now and again `twice_in_s` seconds later."""

    def running() -> int:
        return httpx.get(url + "/stats", timeout=5).json()["queue"]["num_running"]

    if not running():
        return False
    time.sleep(twice_in_s)
    return running() > 0


def _client_loop(base_url: str, who: int, stop: threading.Event, out: list[Outcome]) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    n = 0
    while not stop.is_set():
        n += 1
        is_stream = n % 2 == 0
        content = f"client {who} request {n}" + (" stream me" if is_stream else "")
        messages = [{"role": "user", "content": content}]
        start = time.monotonic()
        outcome = Outcome("stream" if is_stream else "plain", start, start, ok=False)
        try:
            if is_stream:
                parts = []
                for chunk in client.chat.completions.create(
                    model="glm-5.3-flash", messages=messages, stream=True
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        parts.append(chunk.choices[0].delta.content)
                    if chunk.choices and chunk.choices[0].finish_reason:
                        outcome.finish = chunk.choices[0].finish_reason
                outcome.text = "".join(parts)
            else:
                answer = client.chat.completions.create(model="glm-5.3-flash", messages=messages)
                outcome.text = answer.choices[0].message.content or ""
                outcome.finish = answer.choices[0].finish_reason
            outcome.ok = True
        except openai.APIError as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.end_s = time.monotonic()
        out.append(outcome)


def _wait(predicate, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _healthy_workers(metrics: str) -> int:
    """Replicas the router counts as healthy, from its `smg_worker_health{worker=..} 1` gauges."""
    return sum(
        line.startswith("smg_worker_health{") and line.endswith(" 1")
        for line in metrics.splitlines()
    )


def _router_retries(metrics: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if not line.startswith("#") and "retr" in name and name.endswith("_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_fleet(tmp: Path, *, load_s: float = 1.5) -> FleetRun:
    """The whole scenario, bounded in time; every process it starts is stopped before it
    returns. `load_s`: seconds of load before the kill, and between the later steps."""
    write_tokenizer_checkpoint(tmp / "checkpoint")
    write_script(tmp / "script.json", SCRIPT)
    run = FleetRun()
    replicas = [_replica(tmp, i) for i in range(3)]
    router = None
    stop = threading.Event()
    clients: list[threading.Thread] = []
    try:
        for replica in replicas:
            replica.wait_ready()
        router_port, metrics_port = free_port(), free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(router_port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(metrics_port),
                "--worker-urls",
                *(r.url for r in replicas),
                *ROUTER_FLAGS,
            ],
            stdout=open(tmp / "router.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        time.sleep(0.5)
        if router.poll() is not None:
            raise RuntimeError(
                f"sglang-router exited with {router.returncode} (it is in glm53's test extra: "
                f"pip install -e '.[test]'):\n{(tmp / 'router.log').read_text(errors='replace')}"
            )
        _wait(
            lambda: _healthy_workers(httpx.get(metrics_url, timeout=2).text) == 3,
            60,
            "the router to see 3 healthy replicas",
        )
        for who in range(NUM_CLIENTS):
            thread = threading.Thread(
                target=_client_loop, args=(router_url, who, stop, run.outcomes), daemon=True
            )
            thread.start()
            clients.append(thread)
        time.sleep(load_s)

        killed = replicas[0]
        # Kill it while it runs a stream (likely when it is busy twice in 0.3 s: a plain answer
        # takes about 0.2 s here, a stream 1 to 2 s), so that the run shows what its client sees.
        _wait(lambda: _is_busy(killed.url, twice_in_s=0.3), 20, "a stream on the replica to kill")
        run.kill_s = time.monotonic()
        killed.kill_group()
        time.sleep(load_s)
        replicas[0] = _replica(tmp, 0, port=killed.port)
        replicas[0].wait_ready()
        run.restart_ready_s = time.monotonic()
        served = _wait(
            lambda: _chat_requests(replicas[0].url) > 0, 60, "traffic to the restarted replica"
        )
        run.rejoin_s = served - run.restart_ready_s
        time.sleep(load_s)

        drained = replicas[1]
        run.term_s = time.monotonic()
        drained.proc.send_signal(signal.SIGTERM)
        run.drain_exit_code = drained.proc.wait(timeout=60)
        run.exit_s = time.monotonic()
        run.drain_s = run.exit_s - run.term_s
        run.drained_replica_log = drained.log()
        time.sleep(load_s)
    finally:
        stop.set()
        for thread in clients:
            thread.join(45)
        run.hung_clients = sum(t.is_alive() for t in clients)
        if router is not None and router.poll() is None:
            try:
                run.router_metrics = httpx.get(metrics_url, timeout=5).text
            except httpx.HTTPError:
                pass
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(timeout=20)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for replica in replicas:
            replica.stop()
    run.router_retries = _router_retries(run.router_metrics)
    return run
