"""End to end: `glm53 serve --demo` on the CPU engine (the synthetic demo checkpoint, generated
into a fresh cache directory), driven by the official openai client. Its text is gibberish
(random weights); the checks are about the product around it."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def _layer_totals(server) -> dict[str, int]:
    layers = httpx.get(server.url + "/stats").json()["engine"]["tiers"]["layers"]
    return {
        key: sum(c[key] for c in layers.values())
        for key in ("hits", "misses", "bytes_read", "tokens")
    } | {"num_moe_layers": len(layers)}


def test_usage_counts_each_streams_tiers_while_two_run_together(server, client):
    """usage.glm53 against the engine's own per-layer counters: two concurrent requests' counts
    add up to what the layers counted meanwhile, and each request's lane picks are exactly its
    forwarded tokens x top-k x MoE layers (the CPU engine computes every pick on the lane)."""
    checkpoint = Path(httpx.get(server.url + "/server_info").json()["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())
    top_k = config.get("text_config", config)["num_experts_per_tok"]
    before = _layer_totals(server)

    def ask(content: str):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
        )

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, ["first conversation", "a second, longer conversation here"]))
    after = _layer_totals(server)
    usages = [a.usage.model_extra["glm53"] for a in answers]
    for answer, usage in zip(answers, usages, strict=True):
        forwarded = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1
        assert usage["cpu_lane_picks"] == forwarded * top_k * before["num_moe_layers"]
        assert usage["vram_hits"] == usage["zero_copy_misses"] == 0  # no VRAM on the CPU
        assert usage["tiers_counted"] is True
        assert usage["prefill_seconds"] > 0 and usage["decode_seconds"] > 0
    assert sum(u["ram_hits"] for u in usages) == after["hits"] - before["hits"]
    assert sum(u["ram_misses"] for u in usages) == after["misses"] - before["misses"]
    assert sum(u["store_read_bytes"] for u in usages) == after["bytes_read"] - before["bytes_read"]
    assert usages[0]["ram_hits"] != usages[1]["ram_hits"]  # counted per stream, not copied


def test_metrics_carry_the_tier_totals_by_mode(server, client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    usage = answer.usage.model_extra["glm53"]
    text = httpx.get(server.url + "/metrics").text
    stats = httpx.get(server.url + "/stats").json()["tiers_by_mode"]["auto"]
    for name in ("cpu_lane_picks", "ram_hits", "ram_misses", "store_read_bytes"):
        assert f'glm53_tier_{name}_total{{mode="auto"}} {stats[name]}' in text
        assert stats[name] >= usage[name]
    assert f'glm53_request_decode_seconds_count{{mode="auto"}} {stats["requests"]}' in text
    assert 'glm53_tier_vram_hits_total{mode="auto"} 0' in text
