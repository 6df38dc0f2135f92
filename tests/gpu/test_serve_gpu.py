"""`glm53 serve --engine gpu --mode exact` on the demo checkpoint: the real server (granian on
127.0.0.1) and the real openai client, with the VRAM expert cache capped well below the
experts so that decode admits and evicts."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

pytest.importorskip("exllamav3")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serving_kit import Server  # noqa: E402

DEMO = os.environ.get("GLM53_TEST_DEMO")
pytestmark = pytest.mark.skipif(not DEMO, reason="GLM53_TEST_DEMO names no demo checkpoint")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-gpu")
    cfg = json.loads((Path(DEMO) / "config.json").read_text())["text_config"]
    experts = cfg["n_routed_experts"] * sum(t == "sparse" for t in cfg["mlp_layer_types"])
    slots = max(8, experts // 9)  # about 11 % of the routed experts
    env = {"XDG_CACHE_HOME": str(tmp / "cache")}
    args = ["--engine", "gpu", "--mode", "exact", "--model", DEMO, "--ec-max-slots", str(slots)]
    srv = Server(args, env=env, log_path=tmp / "server.log")
    srv.wait_ready(timeout_s=600)
    srv.slots = slots
    srv.cache_dir = tmp / "cache"
    yield srv
    assert srv.stop() == 0, srv.log()
    heat = list((tmp / "cache" / "glm53" / "heat").glob("*.json"))
    assert heat, "no heat list written at shutdown"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


MESSAGES = [{"role": "user", "content": "Count from one to twenty in words."}]


def test_chat_completion_greedy_stream_and_plain_agree(client):
    plain = client.chat.completions.create(
        model="glm-5.3-flash", messages=MESSAGES, max_tokens=32, temperature=0
    )
    choice = plain.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert plain.usage.completion_tokens > 0 and plain.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="glm-5.3-flash", messages=MESSAGES, max_tokens=32, temperature=0, stream=True
    )
    parts, reasoning = [], []
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
    assert "".join(parts) == (choice.message.content or "")
    got_reasoning = getattr(choice.message, "reasoning_content", None) or ""
    assert "".join(reasoning) == got_reasoning


def test_concurrent_streams_all_finish(client):
    results, errors = {}, []

    def one(i):
        try:
            r = client.completions.create(
                model="glm-5.3-flash", prompt=f"Request {i}: the", max_tokens=24, temperature=0
            )
            results[i] = r.choices[0]
        except Exception as exc:  # collected and asserted below
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert len(results) == 4
    assert all(c.finish_reason in ("length", "stop") for c in results.values())


def test_stats_show_the_vram_cache_working(server, client):
    client.completions.create(model="glm-5.3-flash", prompt="warm", max_tokens=16, temperature=0)
    stats = httpx.get(server.url + "/stats", timeout=30).json()
    cache = stats["engine"]["tiers"]["vram_cache"]
    assert cache["slots"] == server.slots
    assert cache["admits"] > 0 and cache["hits"] > 0
    assert len(cache["layer_hit_rate"]) > 0


def test_save_heat_on_demand(server, client):
    client.completions.create(model="glm-5.3-flash", prompt="heat", max_tokens=8, temperature=0)
    r = httpx.post(server.url + "/admin/save_heat", timeout=60)
    assert r.status_code == 200, r.text
    path = Path(r.json()["heat_file"])
    assert path.is_file() and server.cache_dir in path.parents
    keys = json.loads(path.read_text())["keys"]
    assert 0 < len(keys) <= server.slots
