"""The server byte by byte with raw httpx: SSE framing, error bodies, the SGLang-shaped and the
operational endpoints. A real `glm53 serve` with the scripted engine, no API key."""

import json

import httpx
import pytest
from serving_kit import VOCAB_SIZE, scripted_server

SCRIPT = {
    "default": "Because.</think>Yes, certainly.",
    "replies": [{"when": "@raw", "text": "alpha beta gamma"}],
}
MODEL = "glm-5.3-flash"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = scripted_server(
        tmp_path_factory.mktemp("http"), SCRIPT, "--reasoning-field", "--max-body-bytes", "65536"
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def chat(http, **body):
    return http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
    )


def sse_events(response: httpx.Response) -> list[str]:
    raw = response.read().decode()
    assert raw.endswith("\n\n")
    return raw[:-2].split("\n\n")


def test_sse_framing(http):
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["cache-control"] == "no-cache"
        events = sse_events(r)
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0] == {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "finish_reason": None,
        "logprobs": None,
    }
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "finish_reason": "stop",
        "logprobs": None,
    }
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Yes, certainly."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Because."
    assert "".join(d.get("reasoning", "") for d in deltas) == "Because."


def test_reasoning_field_flag_copies_reasoning(http):
    message = chat(http).json()["choices"][0]["message"]
    assert message == {
        "content": "Yes, certainly.",
        "role": "assistant",
        "reasoning_content": "Because.",
        "reasoning": "Because.",
    }


@pytest.mark.parametrize(
    "body, status, error",
    [
        (
            b"{not json",
            400,
            {"type": "invalid_request_error", "param": None, "code": "invalid_json"},
        ),
        (
            b'{"model": "glm-5.3-flash"}',
            400,
            {
                "message": "Object missing required field `messages`",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "invalid_value",
            },
        ),
        (
            b'{"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "x"}], "top_p": 0}',
            400,
            {
                "message": "Expected `float` > 0.0 - at `$.top_p`",
                "type": "invalid_request_error",
                "param": "top_p",
                "code": "invalid_value",
            },
        ),
    ],
)
def test_bad_bodies_get_openai_shaped_400s(http, body, status, error):
    response = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == status
    got = response.json()["error"]
    assert {k: got[k] for k in error} == error


def test_body_over_the_limit_is_413(http):
    response = chat(http, padding="x" * 70000)
    assert response.status_code == 413
    assert response.json()["error"]["message"].startswith("the body has")


def test_unknown_route_is_404_and_wrong_method_405(http):
    missing = http.get("/v2/nothing")
    assert (missing.status_code, missing.json()["error"]["message"]) == (
        404,
        "no route for GET /v2/nothing",
    )
    wrong = http.get("/v1/chat/completions")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method_not_allowed")
    assert http.get("/v1/models/other").status_code == 404
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_health_and_server_info_are_honest_about_the_scripted_engine(http, server):
    assert http.get("/health").json() == {"status": "ok"}
    info = http.get("/server_info").json()
    assert (info["engine"], info["is_model"], info["status"]) == ("scripted", False, "ready")
    assert "not a model" in info["engine_description"]
    settings = info["settings"]
    assert settings["port"] == {
        "value": server.port,
        "source": "flag",
        "flag": "--port",
        "env": "GLM53_PORT",
    }
    assert settings["host"] == {
        "value": "127.0.0.1",
        "source": "default",
        "flag": "--host",
        "env": "GLM53_HOST",
    }
    assert (
        settings["reasoning_field"]["value"] is True and settings["cpus"]["env"] == "GLM53_CT_CPUS"
    )


def test_stats_and_metrics_count_requests_and_tokens(http):
    chat(http)
    stats = http.get("/stats").json()
    assert stats["status"] == "ready" and stats["completion_tokens"] > 0
    assert stats["queue"]["num_slots"] == 4 and stats["engine"]["engine"] == "scripted"
    metrics = http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'glm53_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert (
        "glm53_time_to_first_token_seconds_count" in text
        and "glm53_scheduler_num_running 0" in text
    )


def test_generate_and_tokenize(http):
    ids = http.post("/tokenize", json={"prompt": "@raw please"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    answer = http.post(
        "/generate", json={"input_ids": ids["tokens"], "sampling_params": {"max_new_tokens": 50}}
    ).json()
    assert answer["text"] == "alpha beta gamma"
    assert answer["meta_info"]["prompt_tokens"] == ids["count"]
    assert answer["meta_info"]["finish_reason"]["type"] == "stop"
    assert answer["meta_info"]["completion_tokens"] == len(answer["output_ids"])
    with http.stream("POST", "/generate", json={"text": "@raw please", "stream": True}) as r:
        events = sse_events(r)
    texts = [json.loads(e[6:])["text"] for e in events[:-1]]
    assert texts[-1] == "alpha beta gamma" and all(texts[-1].startswith(t) for t in texts)
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input_ids": [1, VOCAB_SIZE]}, "input_ids[1]"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({}, "text"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ],
)
def test_generate_rejects_bad_input(http, body, param):
    response = http.post("/generate", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_completion_prompt_forms(http):
    def complete(prompt):
        return http.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 30}
        )

    text = complete("@raw").json()["choices"][0]["text"]
    assert text == complete(["@raw"]).json()["choices"][0]["text"] == "alpha beta gamma"
    ids = http.post("/tokenize", json={"prompt": "@raw"}).json()["tokens"]
    assert complete(ids).json()["choices"][0]["text"] == "alpha beta gamma"
    echo = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "@raw", "echo": True}
    ).json()
    assert echo["choices"][0]["text"] == "@rawalpha beta gamma"
    assert complete(["a", "b"]).json()["error"]["param"] == "prompt"


def test_openapi_document_describes_every_route(http):
    doc = http.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/stats",
        "/server_info",
        "/metrics",
        "/dashboard",
        "/generate",
        "/tokenize",
        "/openapi.json",
        "/admin/save_heat",
        "/admin/verify",
    }
    chat_schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    assert chat_schema == {"$ref": "#/components/schemas/ChatRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatRequest"]["required"]


def test_verify_without_expert_tiers_is_a_409_and_a_bad_n_a_400(http):
    r = http.get("/admin/verify", params={"n": 8})
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "no_expert_tiers"
    assert error["message"] == (
        "the scripted engine has no tier check: it checks the expert tiers of the engines that "
        "keep them (the CPU engine's RAM tier; the GPU engine's in nvme-exact)"
    )
    for bad in ("0", "-3", "many", "4097"):
        r = http.get("/admin/verify", params={"n": bad})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "n"
        assert r.json()["error"]["message"] == (
            f"n={bad!r}: the number of records to check must be an integer in 1..4096"
        )
    assert http.post("/admin/verify").status_code == 405


def test_save_heat_without_an_expert_cache_is_a_409_that_names_the_engine(http):
    r = http.post("/admin/save_heat")
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "no_expert_cache"
    assert "scripted engine" in error["message"] and "--engine gpu" in error["message"]
    assert http.get("/health").status_code == 200
