"""Graceful drain: on SIGTERM a real `glm53 serve` process answers /health and new requests with
503 and Retry-After, lets its running streams finish (bounded by --drain-timeout), then exits 0."""

import asyncio
import signal
import threading
import time

import httpx
import openai
from serving_kit import scripted_server, write_tokenizer_checkpoint
from test_api_serve import GatedEngine

from glm53.api.app import App
from glm53.config import resolve

# 40 tokens at 50 ms a step: a stream runs for about 2 s, long enough to SIGTERM it mid-way.
ANSWER = " ".join(["word"] * 40)
SCRIPT = {"replies": [{"when": "long", "text": "</think>" + ANSWER, "step_ms": 50}]}
MESSAGES = [{"role": "user", "content": "a long answer please"}]


def _stream_in_thread(url: str, out: dict, first_token: threading.Event) -> threading.Thread:
    def run():
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        text, finish = [], None
        try:
            for chunk in client.chat.completions.create(
                model="glm-5.3-flash", messages=MESSAGES, stream=True
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    first_token.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        except openai.APIError as exc:
            out["error"] = exc
        out["text"], out["finish"] = "".join(text), finish
        first_token.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_for_health(url: str, status: int, timeout_s: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = httpx.get(url + "/health", timeout=5)
        if response.status_code == status:
            return response
        time.sleep(0.02)
    raise AssertionError(f"/health never answered {status}")


def test_sigterm_drains_running_streams_then_exits_0(tmp_path):
    server = scripted_server(tmp_path, SCRIPT)
    try:
        out: dict = {}
        first = threading.Event()
        thread = _stream_in_thread(server.url, out, first)
        assert first.wait(30)
        server.proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
        health = _wait_for_health(server.url, 503)
        assert health.headers["retry-after"] == "1"
        assert health.json()["error"]["code"] == "draining"
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        thread.join(60)
        assert "error" not in out, out
        assert out["finish"] == "stop"
        assert out["text"] == ANSWER
        assert server.proc.wait(timeout=60) == 0, server.log()
        assert "draining: 1 requests running or queued" in server.log()
        assert "drained in" in server.log()
    finally:
        server.stop()


def test_drain_timeout_ends_a_stream_that_runs_past_it_with_an_error(tmp_path):
    server = scripted_server(tmp_path, SCRIPT, "--drain-timeout", "0.3")
    try:
        out: dict = {}
        first = threading.Event()
        thread = _stream_in_thread(server.url, out, first)
        assert first.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        thread.join(60)
        assert not thread.is_alive()
        assert isinstance(out.get("error"), openai.APIError), out
        assert "the server is shutting down" in str(out["error"])
        assert len(out["text"]) < len(ANSWER)
        assert server.proc.wait(timeout=60) == 0, server.log()
        assert "drain timeout: 1 requests still running after 0.3 s" in server.log()
    finally:
        server.stop()


def test_idle_server_stops_at_once_on_sigterm(tmp_path):
    server = scripted_server(tmp_path, SCRIPT)
    try:
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.log()
        assert "draining: 0 requests running or queued" in server.log()
    finally:
        server.stop()


def test_drain_grace_keeps_answering_503_after_an_idle_drain(tmp_path):
    # behind a router: the port stays open, answering 503, until the router's check has seen it
    server = scripted_server(tmp_path, SCRIPT, "--drain-grace", "4")
    try:
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "(--drain-grace)" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "drained in" in server.log() and "answering 503 for" in server.log(), server.log()
        health = httpx.get(server.url + "/health", timeout=5)
        assert (health.status_code, health.json()["error"]["code"]) == (503, "draining")
        refused = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
        assert server.proc.poll() is None
        assert server.proc.wait(timeout=60) == 0, server.log()
        assert "after the SIGTERM" in server.log()
    finally:
        server.stop()


async def _drain_while_loading(checkpoint):
    gate, drained = threading.Event(), []
    settings, sources = resolve({}, {})
    app = App(
        settings,
        sources,
        engine_factory=lambda s: GatedEngine(checkpoint, gate),
        on_drained=lambda: drained.append(True),
    )
    loading = asyncio.create_task(app.load())
    app.begin_drain()
    app.begin_drain()  # a second SIGTERM changes nothing
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://glm53"
    ) as client:
        await asyncio.sleep(0.2)
        gate.set()
        await loading
        health = await client.get("/health")
    await app.close()
    return drained, health


def test_a_sigterm_during_the_load_keeps_the_server_out_of_service(tmp_path):
    drained, health = asyncio.run(_drain_while_loading(write_tokenizer_checkpoint(tmp_path)))
    assert drained == [True]
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "draining"
