import json

from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.chat import CompletionParser, parse_completion

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "code": {"type": ["string", "null"]},
                },
            },
        },
    }
]


def calls_without_ids(calls):
    return [c["function"] | {"type": c["type"]} for c in calls]


def test_splits_reasoning_from_content_at_think_close():
    assert parse_completion("Let me think.\n</think>\nThe answer is 4.") == (
        "Let me think.",
        "The answer is 4.",
        [],
    )


def test_unclosed_think_block_is_all_reasoning():
    assert parse_completion("still thinking <b>") == ("still thinking <b>", "", [])


def test_without_reasoning_prompt_text_is_content_unless_it_opens_a_think_block():
    assert parse_completion("plain answer", in_reasoning=False) == (None, "plain answer", [])
    assert parse_completion("  <think>hmm</think>ok", in_reasoning=False) == ("hmm", "ok", [])


def test_repeated_think_open_at_start_is_dropped():
    assert parse_completion("<think>why</think>because") == ("why", "because", [])


def test_tool_calls_become_openai_calls_with_schema_typed_arguments():
    text = (
        "Need weather.</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>code</arg_key><arg_value>75</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value></tool_call>"
    )
    reasoning, content, calls = parse_completion(text, WEATHER)
    assert (reasoning, content) == ("Need weather.", "Checking.")
    assert calls_without_ids(calls) == [
        {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 2, "code": "75"}',
            "type": "function",
        },
        {"name": "get_weather", "arguments": '{"city": "123"}', "type": "function"},
    ]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_unknown_tool_values_are_json_when_they_decode_else_strings():
    text = '</think><tool_call>other<arg_key>a</arg_key><arg_value>{"x": [1, true]}</arg_value><arg_key>b</arg_key><arg_value>hello world</arg_value></tool_call>'
    _, _, calls = parse_completion(text, WEATHER)
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "a": {"x": [1, True]},
        "b": "hello world",
    }


def test_tool_call_markup_stays_content_without_tools():
    text = "</think>a<tool_call>get_weather</tool_call>"
    assert parse_completion(text) == (None, "a<tool_call>get_weather</tool_call>", [])


def test_unclosed_tool_call_at_the_end_still_counts():
    _, content, calls = parse_completion(
        "</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome", WEATHER
    )
    assert content == ""
    assert calls_without_ids(calls) == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}', "type": "function"}
    ]


def test_tool_call_without_a_name_is_kept_as_content():
    assert parse_completion("</think>x<tool_call><arg_key>a</arg_key></tool_call>", WEATHER) == (
        None,
        "x<tool_call><arg_key>a</arg_key></tool_call>",
        [],
    )


def test_partial_tags_are_held_only_while_they_can_still_be_tags():
    parser = CompletionParser(WEATHER)
    assert [d.text for d in parser.feed("abc</th")] == ["abc"]
    assert [d.text for d in parser.feed("x")] == ["</thx"]
    assert [(d.kind, d.text) for d in parser.feed("</think>hi <tool")] == [("content", "hi")]
    assert [(d.kind, d.text) for d in parser.feed("s")] == [("content", " <tools")]


def test_tool_call_delta_is_sent_when_its_block_closes():
    parser = CompletionParser(WEATHER)
    parser.feed("r</think><tool_call>get_weather<arg_key>city</arg_key>")
    assert parser.tool_calls == []
    deltas = parser.feed("<arg_value>Oslo</arg_value></tool_call>")
    assert [d.kind for d in deltas] == ["tool_call"]
    assert deltas[0].tool_call["function"]["arguments"] == '{"city": "Oslo"}'


def test_whitespace_at_the_ends_is_trimmed_and_inner_whitespace_kept():
    parser = CompletionParser()
    out = []
    for piece in ["\n", " a ", " ", "b\n", "\n", "</think>", "\n\n", "x", " \n"]:
        out += parser.feed(piece)
    out += parser.finish()
    assert [(d.kind, d.text) for d in out] == [
        ("reasoning", "a"),
        ("reasoning", "  b"),
        ("content", "x"),
    ]
    assert (parser.reasoning, parser.content) == ("a  b", "x")


PIECES = [
    "a",
    " ",
    "\n",
    "<",
    ">",
    "/",
    "é",
    '{"k": 1}',
    "<think>",
    "</think>",
    "</th",
    "<tool_call>",
    "</tool_call>",
    "get_weather",
    "<arg_key>",
    "city",
    "days",
    "</arg_key>",
    "<arg_value>",
    "Paris",
    "12",
    "</arg_value>",
]


@settings(max_examples=400, deadline=None)
@given(
    text=st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    data=st.data(),
    in_reasoning=st.booleans(),
    with_tools=st.booleans(),
)
def test_incremental_parse_of_any_split_equals_one_shot(text, data, in_reasoning, with_tools):
    cuts = data.draw(
        st.lists(st.integers(min_value=0, max_value=len(text)), max_size=12), label="cuts"
    )
    tools = WEATHER if with_tools else None
    expected = parse_completion(text, tools, in_reasoning=in_reasoning)
    parser = CompletionParser(tools, in_reasoning=in_reasoning)
    deltas, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += parser.feed(text[start:cut])
        start = cut
    deltas += parser.finish()
    got = (parser.reasoning, parser.content, parser.tool_calls)
    assert got[:2] == expected[:2]
    assert calls_without_ids(got[2]) == calls_without_ids(expected[2])
    # the deltas add up to the totals
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == (expected[0] or "")
    assert "".join(d.text for d in deltas if d.kind == "content") == expected[1]
    assert [d.tool_call for d in deltas if d.kind == "tool_call"] == got[2]
