"""Structured outputs (llguidance grammars) as the official openai client sees them.

On the CPU demo engine (random weights: left alone it writes gibberish), the grammar is all
that makes the output valid, so valid JSON under the schema and well-formed tool calls show
the mask is applied at every token. The scripted engine (exact, known output) shows that
reasoning stays free (the grammar starts after </think>) and the error cases."""

import json
import re

import openai
import pytest
from serving_kit import scripted_server

MODEL = "glm-5.3-flash"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PICK = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


def check_pick(text):
    value = json.loads(text)
    assert set(value) == {"color", "n"}
    assert value["color"] in ("red", "green", "blue") and 0 <= value["n"] <= 99


@pytest.fixture(scope="module")
def cpu(demo_server):
    return openai.OpenAI(
        base_url=demo_server.url + "/v1", api_key="none", max_retries=0, timeout=300
    )


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_makes_the_random_model_write_valid_json(cpu, seed):
    answer = cpu.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick one"}],
        max_tokens=40,
        temperature=1.0,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": PICK, "strict": True},
        },
        extra_body=NO_THINKING,
    )
    assert answer.choices[0].finish_reason == "stop"
    check_pick(answer.choices[0].message.content)


def test_streamed_json_schema_is_valid_json_too(cpu):
    chunks = cpu.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick one"}],
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}},
        extra_body=NO_THINKING,
    )
    check_pick("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_tool_choice_required_is_enforced_by_the_grammar(cpu):
    answer = cpu.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=40,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=NO_THINKING,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    args = json.loads(call.arguments)
    if call.name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 9
    else:
        assert (call.name, args["zone"] in ("UTC", "CET")) == ("get_time", True)


def test_a_named_tool_choice_calls_that_function(cpu):
    answer = cpu.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time?"}],
        max_tokens=40,
        temperature=0.7,
        seed=5,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body=NO_THINKING,
    )
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


BOOK = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                "day": {"type": "string", "format": "date"},
            },
            "required": ["code", "day"],
        },
    },
}


@pytest.mark.parametrize("seed", [1, 2])
def test_pattern_and_format_of_string_arguments_are_enforced(cpu, seed):
    answer = cpu.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Book it."}],
        max_tokens=60,
        temperature=1.0,
        seed=seed,
        tools=[BOOK],
        tool_choice={"type": "function", "function": {"name": "book"}},
        extra_body=NO_THINKING,
    )
    call = answer.choices[0].message.tool_calls[0].function
    args = json.loads(call.arguments)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", args["code"]), args
    assert re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", args["day"]), args


WEATHER_CALL = (
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)
SCRIPT = {
    "default": 'free <text> {not json</think>{"color": "red", "n": 7}',
    "replies": [
        {"when": "@object", "text": '</think>{"ok": [1, 2]}'},
        {"when": "@ponder", "text": "hmm ", "repeat": 50},
        {"when": "@quit", "text": "not my business"},
        {"when": "@weather", "text": "Paris it is.</think>" + WEATHER_CALL},
    ],
}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    server = scripted_server(tmp_path_factory.mktemp("structured"), SCRIPT)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    assert server.stop() == 0, server.log()


def test_reasoning_stays_free_and_the_grammar_starts_after_think(scripted):
    answer = scripted.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}},
    )
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "free <text> {not json"
    assert json.loads(message.content) == {"color": "red", "n": 7}


def test_json_object_passes_a_json_object(scripted):
    answer = scripted.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "@object"}],
        response_format={"type": "json_object"},
    )
    assert json.loads(answer.choices[0].message.content) == {"ok": [1, 2]}


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema.properties.a.pattern",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"q": {"type": "frobnicate"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters.properties.q.type",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"q": {"type": "string", "format": "iban"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters.properties.q.format",
        ),
    ],
)
def test_a_schema_llguidance_cannot_compile_is_a_400_naming_the_keyword(scripted, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        scripted.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], **kwargs
        )
    assert info.value.param == param


WANTS_STRUCTURE = [
    {"tools": [WEATHER], "tool_choice": "required"},
    {
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    {"response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}}},
]


@pytest.mark.parametrize("kwargs", WANTS_STRUCTURE)
def test_reasoning_that_uses_up_max_tokens_is_a_200_with_finish_reason_length(scripted, kwargs):
    answer = scripted.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "@ponder"}], max_tokens=6, n=2, **kwargs
    )
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]
    for choice in answer.choices:
        assert (choice.message.content, choice.message.tool_calls) == ("", None)
        assert choice.message.model_extra["reasoning_content"] == "hmm hm"
    assert answer.usage.completion_tokens == 12


@pytest.mark.parametrize("kwargs", WANTS_STRUCTURE)
def test_streamed_reasoning_that_uses_up_max_tokens_ends_each_choice_with_length(scripted, kwargs):
    chunks = list(
        scripted.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "@ponder"}],
            max_tokens=6,
            n=2,
            stream=True,
            **kwargs,
        )
    )
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks]
    assert sorted(f for f in finishes if f[1] is not None) == [(0, "length"), (1, "length")]
    assert finishes[-1][1] == "length"


def ask_weather(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "@weather"}],
        tools=[WEATHER],
        tool_choice="required",
        **kwargs,
    ).choices[0]


def test_a_stop_string_that_cuts_a_required_tool_call_is_a_200_with_finish_reason_stop(
    scripted,
):
    in_reasoning = ask_weather(scripted, stop=["it is"])
    assert (in_reasoning.finish_reason, in_reasoning.message.tool_calls) == ("stop", None)
    assert in_reasoning.message.model_extra["reasoning_content"] == "Paris"
    in_call = ask_weather(scripted, stop=["days"])
    assert (in_call.finish_reason, in_call.message.tool_calls[0].function.arguments) == (
        "stop",
        '{"city": "Paris"}',
    )
    uncut = ask_weather(scripted)
    assert uncut.finish_reason == "tool_calls"
    call = uncut.message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})


def test_a_model_that_ends_inside_its_reasoning_does_not_satisfy_required_tool_choice(scripted):
    with pytest.raises(openai.InternalServerError) as info:
        scripted.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "@quit"}],
            tools=[WEATHER],
            tool_choice="required",
        )
    assert (info.value.code, info.value.body["message"]) == (
        "tool_choice_not_satisfied",
        "tool_choice is 'required' but the model answered without a tool call",
    )
