"""Malformed requests answer an OpenAI-shaped 400 that names the parameter at fault, never a
500, and the server keeps serving (issue 24). A real `glm53 serve --engine scripted`; each
case is a raw body, so that what reaches the server is exactly what is listed."""

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI
from serving_kit import scripted_server

from glm53.api.body import MAX_DEPTH, path_at, too_deep_at

SCRIPT = {"default": "Fine.</think>Answer."}
MODEL = "glm-5.3-flash"
USER = [{"role": "user", "content": "hi"}]
P = "tools[0].function.parameters"
X = f"{P}.properties.x"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = scripted_server(tmp_path_factory.mktemp("bad-input"), SCRIPT)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def chat(**fields) -> str:
    return json.dumps({"model": MODEL, "messages": USER, "max_tokens": 4, **fields})


def with_raw(body: str, **raw: str) -> str:
    """`body` (a JSON object) with more fields whose values are raw JSON text."""
    return body[:-1] + "".join(f', "{k}": {v}' for k, v in raw.items()) + "}"


def tool_call(parameters, choice="required") -> str:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    return chat(tools=tools, tool_choice=choice)


def prop(schema) -> dict:
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}


def response_schema(schema) -> str:
    return chat(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )


def assistant_arguments(arguments: str) -> str:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    return chat(messages=messages)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


DEEP_PARAMS = f'{{"name": "f", "parameters": {nested_schema(1000)}}}'
DEEP_TOOLS = f'[{{"type": "function", "function": {DEEP_PARAMS}}}]'
RS = "response_format.json_schema.schema"

# (case id, path, body, the param the 400 names, words its message holds)
CASES = [
    # Unicode digits and other number parsing
    (
        "logit_bias superscript",
        "/v1/chat/completions",
        chat(logit_bias={"²": 1}),
        "logit_bias.²",
        "0-9",
    ),
    (
        "logit_bias arabic digit",
        "/v1/chat/completions",
        chat(logit_bias={"٣": 1}),
        "logit_bias.٣",
        "0-9",
    ),
    (
        "logit_bias 5000 digits",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "a", "logit_bias": {"9" * 5000: 1}}),
        "logit_bias." + "9" * 5000,
        "token id",
    ),
    (
        "logit_bias value 1e400",
        "/v1/chat/completions",
        with_raw(chat(), logit_bias='{"1": 1e400}'),
        "logit_bias[...]",
        "out of range",
    ),
    (
        "temperature NaN",
        "/v1/chat/completions",
        with_raw(chat(), temperature="NaN"),
        "temperature",
        "NaN",
    ),
    (
        "top_p Infinity",
        "/v1/chat/completions",
        with_raw(chat(), top_p="Infinity"),
        "top_p",
        "Infinity",
    ),
    (
        "presence_penalty 1e400",
        "/v1/chat/completions",
        with_raw(chat(), presence_penalty="1e400"),
        "presence_penalty",
        "out of range",
    ),
    ("top_k 10**30", "/v1/chat/completions", chat(top_k=10**30), "top_k", "-1 or 0"),
    (
        "generate top_k 2**63-1",
        "/generate",
        json.dumps({"text": "a", "sampling_params": {"top_k": 2**63 - 1}}),
        "sampling_params.top_k",
        "vocabulary",
    ),
    (
        "generate stop_token_ids 10**20",
        "/generate",
        json.dumps({"text": "a", "sampling_params": {"stop_token_ids": [10**20]}}),
        "sampling_params.stop_token_ids[0]",
        "vocabulary",
    ),
    # tool parameter keywords of the wrong type (tool_choice "required" compiles a grammar)
    (
        "minLength 'abc'",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "minLength": "abc"})),
        f"{X}.minLength",
        "integer from 0",
    ),
    (
        "maxLength -1",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "maxLength": -1})),
        f"{X}.maxLength",
        "integer from 0",
    ),
    (
        "minLength 1.5",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "minLength": 1.5})),
        f"{X}.minLength",
        "integer from 0",
    ),
    (
        "minLength 10**30",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "minLength": 10**30})),
        f"{X}.minLength",
        "integer from 0",
    ),
    (
        "maxLength < minLength",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "minLength": 5, "maxLength": 2})),
        f"{X}.maxLength",
        ">= minLength",
    ),
    (
        "properties [1, 2]",
        "/v1/chat/completions",
        tool_call({"type": "object", "properties": [1, 2]}),
        f"{P}.properties",
        "JSON object",
    ),
    (
        "required 5",
        "/v1/chat/completions",
        tool_call({"type": "object", "properties": {}, "required": 5}),
        f"{P}.required",
        "array of argument names",
    ),
    (
        "required 'a'",
        "/v1/chat/completions",
        tool_call({"type": "object", "properties": {"a": {}}, "required": "a"}),
        f"{P}.required",
        "array of argument names",
    ),
    (
        "required names no property",
        "/v1/chat/completions",
        tool_call({"type": "object", "properties": {}, "required": ["b"]}),
        f"{P}.required",
        "not in properties",
    ),
    (
        "parameters of type array",
        "/v1/chat/completions",
        tool_call({"type": "array"}),
        f"{P}.type",
        "'object'",
    ),
    ("property schema 5", "/v1/chat/completions", tool_call(prop(5)), X, "JSON object"),
    (
        "enum 'abc'",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "enum": "abc"})),
        f"{X}.enum",
        "at least one string",
    ),
    (
        "enum []",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "enum": []})),
        f"{X}.enum",
        "at least one string",
    ),
    (
        "const 5",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "const": 5})),
        f"{X}.const",
        "must be a string",
    ),
    (
        "pattern '(('",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "pattern": "(("})),
        f"{X}.pattern",
        "regular expression",
    ),
    (
        "pattern 5",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "pattern": 5})),
        f"{X}.pattern",
        "must be a string",
    ),
    (
        "format ['a']",
        "/v1/chat/completions",
        tool_call(prop({"type": "string", "format": ["a"]})),
        f"{X}.format",
        "the formats that are",
    ),
    (
        "type 'strin'",
        "/v1/chat/completions",
        tool_call(prop({"type": "strin"})),
        f"{X}.type",
        "strin",
    ),
    (
        "type 5",
        "/v1/chat/completions",
        tool_call(prop({"type": 5})),
        f"{X}.type",
        "string or array of strings",
    ),
    (
        "$ref to nowhere",
        "/v1/chat/completions",
        tool_call(prop({"$ref": "#/$defs/nope"})),
        f"{X}.$ref",
        "does not exist",
    ),
    (
        "$ref 5",
        "/v1/chat/completions",
        tool_call(prop({"$ref": 5})),
        f"{X}.$ref",
        "must be a string",
    ),
    (
        "items 5",
        "/v1/chat/completions",
        tool_call(prop({"type": "array", "items": 5})),
        f"{X}.items",
        "object or boolean",
    ),
    (
        "minimum 'a'",
        "/v1/chat/completions",
        tool_call(prop({"type": "integer", "minimum": "a"})),
        f"{X}.minimum",
        "minimum",
    ),
    (
        "maximum 'a'",
        "/v1/chat/completions",
        tool_call(prop({"type": "number", "maximum": "a"})),
        f"{X}.maximum",
        "maximum",
    ),
    (
        "minItems 'a'",
        "/v1/chat/completions",
        tool_call(prop({"type": "array", "minItems": "a"})),
        f"{X}.minItems",
        "minItems",
    ),
    (
        "maxItems -1",
        "/v1/chat/completions",
        tool_call(prop({"type": "array", "maxItems": -1})),
        f"{X}.maxItems",
        "maxItems",
    ),
    ("anyOf 5", "/v1/chat/completions", tool_call(prop({"anyOf": 5})), f"{X}.anyOf", "array"),
    ("oneOf 5", "/v1/chat/completions", tool_call(prop({"oneOf": 5})), f"{X}.oneOf", "oneOf"),
    ("allOf 5", "/v1/chat/completions", tool_call(prop({"allOf": 5})), f"{X}.allOf", "allOf"),
    (
        "additionalProperties 'x'",
        "/v1/chat/completions",
        tool_call(prop({"type": "object", "additionalProperties": "x"})),
        f"{X}.additionalProperties",
        "object or boolean",
    ),
    (
        "integer pattern '(('",
        "/v1/chat/completions",
        tool_call(prop({"type": "array", "items": {"type": "string", "pattern": "(("}})),
        f"{X}.items.pattern",
        "unclosed group",
    ),
    # the same keywords in a response_format json_schema
    (
        "schema minLength 'abc'",
        "/v1/chat/completions",
        response_schema({"type": "string", "minLength": "abc"}),
        f"{RS}.minLength",
        "minLength",
    ),
    (
        "schema type 'strin'",
        "/v1/chat/completions",
        response_schema({"type": "strin"}),
        f"{RS}.type",
        "strin",
    ),
    (
        "schema $ref to nowhere",
        "/v1/chat/completions",
        response_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}),
        f"{RS}.properties.a.$ref",
        "does not exist",
    ),
    ("schema enum 5", "/v1/chat/completions", response_schema({"enum": 5}), f"{RS}.enum", "enum"),
    (
        "schema properties [1]",
        "/v1/chat/completions",
        response_schema({"type": "object", "properties": [1]}),
        f"{RS}.properties",
        "must be an object",
    ),
    (
        "schema required 5",
        "/v1/chat/completions",
        response_schema({"type": "object", "required": 5}),
        f"{RS}.required",
        "array",
    ),
    (
        "schema pattern '(('",
        "/v1/chat/completions",
        response_schema({"type": "string", "pattern": "(("}),
        f"{RS}.pattern",
        "unclosed group",
    ),
    # chat_template_kwargs: names jinja or the server keeps, and the template's own kwargs' types
    (
        "template kwarg source",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"source": "x"}),
        "chat_template_kwargs.source",
        "may not set",
    ),
    (
        "template kwarg namespace",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"namespace": 2}),
        "chat_template_kwargs.namespace",
        "may not set",
    ),
    (
        "template kwarg self",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"self": 2}),
        "chat_template_kwargs.self",
        "may not set",
    ),
    (
        "template kwarg range",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"range": 2}),
        "chat_template_kwargs.range",
        "may not set",
    ),
    (
        "template kwarg raise_exception",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"raise_exception": 1}),
        "chat_template_kwargs.raise_exception",
        "may not set",
    ),
    (
        "template kwarg messages",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"messages": []}),
        "chat_template_kwargs.messages",
        "may not set",
    ),
    (
        "enable_thinking 'no'",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"enable_thinking": "no"}),
        "chat_template_kwargs.enable_thinking",
        "true or false",
    ),
    (
        "clear_thinking 1",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"clear_thinking": 1}),
        "chat_template_kwargs.clear_thinking",
        "true or false",
    ),
    (
        "reasoning_effort [1]",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"reasoning_effort": [1]}),
        "chat_template_kwargs.reasoning_effort",
        "a string",
    ),
    (
        "template tool_choice 5",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"tool_choice": {"function": {"name": 5}}}),
        "chat_template_kwargs.tool_choice",
        "'required'",
    ),
    # lone surrogates: in tool-call arguments (JSON text the server parses) and in the body
    (
        "surrogate in arguments",
        "/v1/chat/completions",
        assistant_arguments('{"a": "\\ud800"}'),
        "messages[1].tool_calls[0].function.arguments.a",
        "surrogate",
    ),
    (
        "surrogate in an arguments key",
        "/v1/chat/completions",
        assistant_arguments('{"\\udc00": 1}'),
        "messages[1].tool_calls[0].function.arguments.\\udc00",
        "surrogate",
    ),
    (
        "surrogate in content",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a\ud800b"}]),
        "messages[0].content",
        "surrogate",
    ),
    (
        "surrogate in a content part",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
        "messages[0].content[0].text",
        "surrogate",
    ),
    (
        "surrogate in a name",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a", "name": "\ud800"}]),
        "messages[0].name",
        "surrogate",
    ),
    (
        "surrogate in stop",
        "/v1/chat/completions",
        chat(stop=["ok", "\ud800"]),
        "stop[1]",
        "surrogate",
    ),
    (
        "surrogate in a tool name",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "\ud800"}}]),
        "tools[0].function.name",
        "surrogate",
    ),
    (
        "surrogate in a generate stop",
        "/generate",
        json.dumps({"text": "a", "sampling_params": {"stop": "\ud800"}}),
        "sampling_params.stop",
        "surrogate",
    ),
    (
        "surrogate in a prompt",
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": ["\ud800"]}),
        "prompt[0]",
        "surrogate",
    ),
    ("surrogate to tokenize", "/tokenize", json.dumps({"prompt": "\ud800"}), "prompt", "surrogate"),
    # nesting deeper than MAX_DEPTH anywhere (msgspec, json, jinja and llguidance recurse)
    (
        "deep response_format schema",
        "/v1/chat/completions",
        with_raw(
            chat(),
            response_format=f'{{"type": "json_schema", "json_schema": {{"name": "s", "schema": {nested_schema(1000)}}}}}',
        ),
        "response_format.json_schema.schema" + ".properties.a" * 48 + ".properties",
        "nests more than",
    ),
    (
        "deep tool parameters",
        "/v1/chat/completions",
        with_raw(chat(), tools=DEEP_TOOLS, tool_choice='"required"'),
        "tools[0].function.parameters" + ".properties.a" * 48,
        "nests more than",
    ),
    (
        "deep tool parameters, auto",
        "/v1/chat/completions",
        with_raw(chat(), tools=DEEP_TOOLS),
        "tools[0].function.parameters" + ".properties.a" * 48,
        "nests more than",
    ),
    (
        "deep arguments text",
        "/v1/chat/completions",
        assistant_arguments('{"a": ' + nested(5000) + "}"),
        "messages[1].tool_calls[0].function.arguments.a" + "[0]" * 99,
        "nests more than",
    ),
    (
        "deep arguments object",
        "/v1/chat/completions",
        with_raw(
            chat(),
            messages=f'[{{"role": "user", "content": "a"}}, {{"role": "assistant", "tool_calls": [{{"function": {{"name": "f", "arguments": {{"a": {nested(2000)}}}}}}}]}}]',
        ),
        "messages[1].tool_calls[0].function.arguments.a" + "[0]" * 93,
        "nests more than",
    ),
    (
        "deep content",
        "/v1/chat/completions",
        with_raw(chat(), messages=f'[{{"role": "user", "content": {nested(3000)}}}]'),
        "messages[0].content" + "[0]" * 97,
        "nests more than",
    ),
    (
        "deep template kwargs",
        "/v1/chat/completions",
        with_raw(chat(), chat_template_kwargs=f'{{"x": {nested(3000)}}}'),
        "chat_template_kwargs.x" + "[0]" * 98,
        "nests more than",
    ),
    (
        "deep unknown field",
        "/v1/chat/completions",
        with_raw(chat(), extra=nested(100_000)),
        "extra" + "[0]" * 99,
        "nests more than",
    ),
    (
        "deep prompt",
        "/v1/completions",
        json.dumps({"model": MODEL})[:-1] + f', "prompt": {nested(3000)}}}',
        "prompt" + "[0]" * 99,
        "nests more than",
    ),
    (
        "deep generate",
        "/generate",
        f'{{"text": "a", "rid": {nested(3000)}}}',
        "rid" + "[0]" * 99,
        "nests more than",
    ),
]


@pytest.mark.parametrize(
    "path, body, param, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_input_is_a_400_naming_the_parameter(http, path, body, param, words):
    response = http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_server_logged_no_internal_error_and_keeps_serving(http, server):
    for _, path, body, *_ in CASES:
        http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert http.get("/health").status_code == 200
    answer = http.post("/v1/chat/completions", content=chat(max_tokens=64).encode())
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "Answer."
    log = server.log()
    assert "Traceback" not in log and "failed" not in log, log


def test_the_openai_client_gets_the_400(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": prop({"type": "string", "minLength": "abc"})},
        }
    ]
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=USER, tools=tools, tool_choice="required", max_tokens=4
        )
    assert info.value.body["param"] == f"{X}.minLength"


def test_a_body_nested_just_within_the_limit_is_served(http):
    # JSON-schema nesting meets --max-schema-depth (32) long before this limit, so the deepest
    # body the limit lets through is built in chat_template_kwargs, whose values the template
    # only passes along: the body, the kwargs and the value's own levels add up to MAX_DEPTH
    def body(depth: int) -> str:
        return with_raw(chat(), chat_template_kwargs='{"x": ' + "[" * depth + "]" * depth + "}")

    depth = MAX_DEPTH - 2
    assert too_deep_at(body(depth).encode()) is None
    assert too_deep_at(body(depth + 1).encode()) is not None
    assert http.post("/v1/chat/completions", content=body(depth).encode()).status_code == 200


def test_depth_and_paths_ignore_brackets_inside_strings():
    text = (
        b'{"a": "[[[[\\"{{{{", "b": [1, {"c\\\\": [' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"]}]}"
    )
    at = too_deep_at(text)
    assert at is not None and text[at : at + 1] == b"["
    assert path_at(text, at) == "b[1].c\\" + "[0]" * (MAX_DEPTH - 3)
    assert too_deep_at(b'["' + b"[" * 1000 + b'"]') is None
