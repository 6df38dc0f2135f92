"""The prefix cache through the real server: `glm53 serve --engine cpu --chunk-size 64` on a
demo-preset checkpoint with the prefix cache on gives a conversation the same answers as a
server with it off (--prefix-cache-gb 0), and reports the reused prompt tokens in usage,
meta_info, /stats and /metrics. The checkpoint is written once with the stand-in routing (as in
tests/test_cpu_engine.py), which is quicker to write than --demo's."""

import httpx
import openai
import pytest
from serving_kit import Server

from glm53.synth.shapes import preset
from glm53.synth.writer import write_checkpoint

MODEL = "glm-5.3-flash"
C = 64
SYSTEM = "You are a careful assistant. " * 24  # about 2.5 chunks of the demo's tokenizer
TURNS = ("What is the tallest mountain?", "And the second tallest?", "How were they measured?")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("api-prefix") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


def start(tmp, checkpoint, *extra):
    server = Server(
        ["--model", str(checkpoint), "--engine", "cpu", "-cs", "2048",
         "--chunk-size", str(C), "--max-batch", "2", *extra],
        log_path=tmp / "log",
    )  # fmt: skip
    server.wait_ready(timeout_s=900)
    return server


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def conversation(server) -> list[tuple[str, str, int]]:
    """Three chat turns, each sent with the history so far: (content, reasoning, cached tokens)."""
    api, messages, out = client(server), [{"role": "system", "content": SYSTEM}], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        answer = api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        message = answer.choices[0].message
        out.append(
            (
                message.content or "",
                message.model_extra["reasoning_content"] or "",
                answer.usage.prompt_tokens_details.cached_tokens,
            )
        )
        messages.append({"role": "assistant", "content": message.content or ""})
    return out


def generate(server, ids):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    answer = httpx.post(server.url + "/generate", json=body, timeout=300).json()
    return answer["output_ids"], answer["meta_info"]["cached_tokens"]


IDS = [(7 * i + 3) % 1900 + 20 for i in range(2 * C + 1)]  # shares 2C + 1 tokens with IDS_2
IDS_2 = IDS + [11, 12, 13]


@pytest.fixture(scope="module")
def cold(tmp_path_factory, demo):
    """What a server without the prefix cache answers (the reference)."""
    server = start(tmp_path_factory.mktemp("cold"), demo, "--prefix-cache-gb", "0")
    try:
        return {
            "chat": conversation(server),
            "generate": [generate(server, IDS), generate(server, IDS_2)],
            "stats": httpx.get(server.url + "/stats").json(),
        }
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def warm(tmp_path_factory, demo):
    server = start(tmp_path_factory.mktemp("warm"), demo)
    yield server
    assert server.stop() == 0, server.log()


def test_without_the_cache_nothing_is_reported_cached(cold):
    assert [cached for _, _, cached in cold["chat"]] == [0, 0, 0]
    assert [cached for _, cached in cold["generate"]] == [0, 0]
    assert cold["stats"]["queue"]["prefix_cache"] is None


def test_a_conversation_gets_the_same_answers_from_cached_prefixes(cold, warm):
    turns = conversation(warm)
    assert [t[:2] for t in turns] == [t[:2] for t in cold["chat"]]
    cached = [c for _, _, c in turns]
    assert cached[0] == 0 and 0 < cached[1] < cached[2] and all(c % C == 0 for c in cached)


def test_generate_reports_meta_info_cached_tokens_with_the_same_output(cold, warm):
    assert generate(warm, IDS) == (cold["generate"][0][0], 0)
    assert generate(warm, IDS_2) == (cold["generate"][1][0], 2 * C)
    assert generate(warm, IDS) == (cold["generate"][0][0], 2 * C)  # its own snapshot, 2C of 2C+1


def test_completions_report_cached_tokens_streamed_and_not(warm):
    api = client(warm)
    ids = IDS + [21, 22]
    whole = api.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    chunks = list(
        api.completions.create(
            model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert whole.usage.prompt_tokens_details.cached_tokens == 2 * C
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * C
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_streamed_chat_usage_carries_cached_tokens(warm):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    chunks = list(
        client(warm).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // C * C


def test_stats_and_metrics_show_cached_tokens(warm):
    generate(warm, IDS_2)
    stats = httpx.get(warm.url + "/stats").json()
    last = stats["recent_requests"][-1]
    assert (last["prompt_tokens"], last["cached_tokens"]) == (len(IDS_2), 2 * C)
    assert stats["cached_tokens"] == sum(r["cached_tokens"] for r in stats["recent_requests"])
    queue = stats["queue"]
    assert queue["cached_prompt_tokens"] == stats["cached_tokens"]
    assert queue["prefix_cache"]["snapshots"] > 0 and queue["prefix_cache"]["hits"] > 0
    metrics = httpx.get(warm.url + "/metrics").text
    assert f"glm53_prompt_cached_tokens_total {stats['cached_tokens']}" in metrics
    assert "glm53_scheduler_prefix_cache_bytes " in metrics
