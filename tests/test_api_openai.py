"""The server as the official openai client sees it: a real `glm53 serve` (granian) on 127.0.0.1
with the scripted engine, whose replies are chosen by a trigger word in the prompt."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from serving_kit import scripted_server

KEY = "test-key"
WEATHER_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>{}</arg_value>{}</tool_call>"
)
SCRIPT = {
    "default": "Thinking about it.\n</think>\nHello! How can I help?",
    "replies": [
        {
            "when": "@weather",
            "text": "The user wants weather.</think>"
            + WEATHER_CALL.format("Paris", "<arg_key>days</arg_key><arg_value>3</arg_value>"),
        },
        {
            "when": "@two",
            "text": "Two calls.</think>Checking both.\n"
            + WEATHER_CALL.format("Paris", "")
            + WEATHER_CALL.format("Rome", "")
            + "\n",
            "step_ms": 25,
        },
        {"when": "@slow", "text": "word ", "repeat": 400, "step_ms": 20},
        {"when": "@explode", "text": "doomed text here and more", "fail_after": 2},
        {"when": "@count", "text": "</think>one two three STOP four five"},
        {"when": "@plain", "text": "Just content."},
        {"when": "@answer", "text": "</think>Done."},
    ],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
MODEL = "glm-5.3-flash"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = scripted_server(
        tmp_path_factory.mktemp("openai"),
        SCRIPT,
        "--api-key",
        KEY,
        "--max-batch",
        "2",
        "--queue-limit",
        "2",
        "-cs",
        "8192",
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def user(text):
    return [{"role": "user", "content": text}]


def stats(server):
    return httpx.get(server.url + "/stats", headers={"authorization": f"Bearer {KEY}"}).json()


def wait_idle(server, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        queue = stats(server)["queue"]
        if queue["num_running"] == queue["num_waiting"] == queue["num_active"] == 0:
            return queue
        assert time.monotonic() < deadline, queue
        time.sleep(0.02)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 8192
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_answer_with_reasoning_and_usage(client, server):
    answer = client.chat.completions.create(model=MODEL, messages=user("hi"))
    choice = answer.choices[0]
    assert (choice.message.content, choice.message.model_extra["reasoning_content"]) == (
        "Hello! How can I help?",
        "Thinking about it.",
    )
    assert (choice.finish_reason, choice.message.role, choice.message.tool_calls) == (
        "stop",
        "assistant",
        None,
    )
    usage = answer.usage
    prompt = httpx.post(
        server.url + "/tokenize",
        json={
            "prompt": "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>hi<|assistant|><think>"
        },
        headers={"authorization": f"Bearer {KEY}"},
    ).json()
    assert usage.prompt_tokens == prompt["count"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert answer.id.startswith("chatcmpl-") and answer.model == MODEL


def test_streamed_chat_matches_the_answer_and_sends_usage_last(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello! How can I help?"
    assert (
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        == "Thinking about it."
    )
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert all(c.usage is None for c in chunks[:-1])
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.total_tokens
        == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    )


def test_stream_without_include_usage_has_no_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"


def test_tool_call_answer(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=user("@weather in Paris?"), tools=[WEATHER_TOOL]
    )
    choice = answer.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather."
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == (
        "function",
        "get_weather",
        '{"city": "Paris", "days": 3}',
    )
    assert call.id.startswith("call_")


def test_streamed_tool_calls_arrive_one_by_one_as_they_complete(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=user("@two cities"), tools=[WEATHER_TOOL], stream=True
    )
    chunks = list(stream)
    call_chunks = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [[t.index for t in c.choices[0].delta.tool_calls] for c in call_chunks] == [[0], [1]]
    calls = [c.choices[0].delta.tool_calls[0] for c in call_chunks]
    assert [json.loads(t.function.arguments) for t in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert all(t.id.startswith("call_") and t.type == "function" for t in calls)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking both."
    assert chunks.index(call_chunks[0]) < chunks.index(call_chunks[1]) < len(chunks) - 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_with_string_arguments_and_reasoning_is_accepted(client):
    messages = [
        {"role": "user", "content": "@answer weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "old thoughts",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert answer.choices[0].message.content == "Done."


def test_required_tool_choice_is_checked_against_the_answer(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), tools=[WEATHER_TOOL], tool_choice="required"
        )
    assert info.value.code == "tool_choice_not_satisfied"
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=MODEL, messages=user("@weather"), tools=[WEATHER_TOOL], tool_choice=named
    )
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_stop_strings_and_max_tokens(client):
    stopped = client.chat.completions.create(model=MODEL, messages=user("@count"), stop=["STOP"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (
        "one two three",
        "stop",
    )
    capped = client.chat.completions.create(model=MODEL, messages=user("@slow"), max_tokens=5)
    assert (capped.choices[0].finish_reason, capped.usage.completion_tokens) == ("length", 5)
    assert capped.choices[0].message.model_extra["reasoning_content"].startswith("word word")


def test_thinking_off_puts_everything_in_content(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=user("@plain"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert (
        answer.choices[0].message.content,
        answer.choices[0].message.model_extra["reasoning_content"],
    ) == ("Just content.", None)


def test_text_completions_stream_and_not(client):
    answer = client.completions.create(model=MODEL, prompt="@plain go", max_tokens=20)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("Just content.", "stop")
    assert answer.usage.completion_tokens > 0
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="@plain go", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Just content."
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": user("x"), "temperature": 5}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": user("x"), "n": 3}, "n"),
        ({"messages": user("x"), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": user("x"), "top_logprobs": 2}, "top_logprobs"),
        ({"messages": user("x"), "logit_bias": {"abc": 5}}, "logit_bias.abc"),
        ({"messages": user("x"), "stream_options": {"include_usage": True}}, "stream_options"),
        (
            {
                "messages": user("x"),
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"messages": user("x"), "presence_penalty": 3}, "presence_penalty"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_requests_name_the_parameter(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert info.value.param == param
    assert info.value.type == "invalid_request_error"


def test_prompt_longer_than_the_context_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("word " * 9000))
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    assert (
        "but the context holds 8192" in info.value.message
        and "the prompt has" in info.value.message
    )


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=user("x"))
    assert (info.value.code, info.value.param) == ("model_not_found", "model")


def test_api_key_is_required_everywhere_but_health(server):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.code == "invalid_api_key"
    assert httpx.get(server.url + "/stats").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


def test_engine_error_fails_that_request_only(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=user("@explode"))
    assert info.value.code == "engine_error"
    with pytest.raises(openai.APIError, match="generation failed: engine error: scripted failure"):
        list(client.chat.completions.create(model=MODEL, messages=user("@explode"), stream=True))
    assert (
        client.chat.completions.create(model=MODEL, messages=user("hi")).choices[0].message.content
        == "Hello! How can I help?"
    )


def test_full_queue_answers_429_with_retry_after(server):
    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30
        )
        streams = [
            await aclient.chat.completions.create(model=MODEL, messages=user("@slow"), stream=True)
            for _ in range(4)
        ]
        with pytest.raises(openai.RateLimitError) as info:
            await aclient.chat.completions.create(model=MODEL, messages=user("@slow"))
        for stream in streams:
            await stream.close()
        await aclient.close()
        return info.value

    error = asyncio.run(main())
    assert error.code == "queue_full" and int(error.response.headers["retry-after"]) >= 1
    wait_idle(server)


def test_client_disconnect_cancels_the_job_and_frees_its_slot(server, client):
    before = stats(server)["queue"].get("requests_cancelled", 0)
    stream = client.chat.completions.create(model=MODEL, messages=user("@slow"), stream=True)
    pieces = [next(stream) for _ in range(3)]
    stream.close()
    assert pieces[0].choices[0].delta.role == "assistant"
    queue = wait_idle(server)
    assert queue["requests_cancelled"] == before + 1
