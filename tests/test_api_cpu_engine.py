"""End to end: `glm53 serve --demo` on the CPU engine (the synthetic demo checkpoint, generated
into a fresh cache directory), driven by the official openai client. Its text is gibberish
(random weights); the checks are about the product around it."""

import httpx
import openai
import pytest

MODEL = "glm-5.3-flash"


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_server_says_it_runs_the_demo_on_the_cpu_engine(server):
    info = httpx.get(server.url + "/server_info").json()
    assert (info["engine"], info["is_model"], info["status"]) == ("cpu", True, "ready")
    assert info["checkpoint"].endswith("demo-checkpoint")
    assert "serving the synthetic demo checkpoint" in server.log()


def test_greedy_chat_streamed_and_not_gives_the_same_tokens(client):
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    answer = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    message = answer.choices[0].message
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    assert (streamed_content, streamed_reasoning) == (
        message.content or "",
        message.model_extra["reasoning_content"] or "",
    )
    assert answer.usage.completion_tokens == chunks[-1].usage.completion_tokens <= 12
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_same_seed_same_completion(client):
    request = {"model": MODEL, "prompt": "The", "max_tokens": 10, "temperature": 1.0, "seed": 1234}
    first = client.completions.create(**request).choices[0].text
    assert client.completions.create(**request).choices[0].text == first


def test_stats_report_the_engine_counters_and_an_empty_queue(server):
    stats = httpx.get(server.url + "/stats").json()
    assert stats["completion_tokens"] > 0 and stats["engine"]
    assert stats["queue"]["num_running"] == stats["queue"]["num_waiting"] == 0
