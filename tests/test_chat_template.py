import random
import sys
from pathlib import Path

import pytest
from transformers.utils import chat_template_utils

from glm53.chat import TemplateError, default_template, render

TEMPLATE = default_template()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n</tools>\n\n'
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
TWO_CALLS = [
    {
        "id": "a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    },
    {
        "id": "b",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
    },
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need two calls.",
        "tool_calls": TWO_CALLS,
    },
    {"role": "tool", "tool_call_id": "a", "content": '{"t":20}'},
    {"role": "tool", "tool_call_id": "b", "content": '{"t":25}'},
]
TOOL_GOLDEN = (
    "[gMASK]<sop><|system|>Reasoning Effort: Max"
    + TOOLS_BLOCK
    + "<|system|>You are helpful.<|user|>Weather in Paris and Rome?<|assistant|><think>Need two calls.</think>"
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
    "<arg_value>2</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
    '</tool_call><|observation|><tool_response>{"t":20}</tool_response><tool_response>{"t":25}</tool_response>'
    "<|assistant|><think>"
)


def test_renders_the_official_simple_chat_golden():
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there"},
    ]
    assert render(TEMPLATE, messages) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>You are a helpful assistant.<|user|>Hi there<|assistant|><think>"
    )


def test_renders_multi_turn_reasoning_split_out_of_content():
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>Trivial addition.</think>2+2 equals 4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert render(TEMPLATE, messages) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>What is 2+2?<|assistant|><think>Trivial addition.</think>"
        "2+2 equals 4.<|user|>And 3+3?<|assistant|><think>"
    )


def test_renders_tools_calls_and_results_like_the_reference_example():
    assert render(TEMPLATE, TOOL_CONVERSATION, tools=[WEATHER_TOOL]) == TOOL_GOLDEN


def test_tool_results_follow_the_order_of_the_calls_they_answer():
    swapped = TOOL_CONVERSATION[:3] + [TOOL_CONVERSATION[4], TOOL_CONVERSATION[3]]
    assert render(TEMPLATE, swapped, tools=[WEATHER_TOOL]) == TOOL_GOLDEN


def test_tool_results_keep_their_order_when_ids_do_not_match_the_calls():
    unmatched = TOOL_CONVERSATION[:3] + [
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "zzz", "content": "Z"},
    ]
    out = render(TEMPLATE, unmatched, tools=[WEATHER_TOOL])
    assert out.endswith(
        "<|observation|><tool_response>B</tool_response><tool_response>Z</tool_response><|assistant|><think>"
    )


def test_reasoning_effort_and_disabled_thinking():
    user = [{"role": "user", "content": "x"}]
    assert (
        render(TEMPLATE, user, reasoning_effort="low")
        == "[gMASK]<sop><|system|>Reasoning Effort: Low<|user|>x<|assistant|><think>"
    )
    assert render(TEMPLATE, user, reasoning_effort="medium").startswith(
        "[gMASK]<sop><|system|>Reasoning Effort: Max"
    )
    assert (
        render(TEMPLATE, user, enable_thinking=False)
        == "[gMASK]<sop><|user|>x<|assistant|><think></think>"
    )


def test_clear_thinking_drops_reasoning_before_the_last_user_turn():
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    kept = render(TEMPLATE, messages, add_generation_prompt=False)
    cleared = render(TEMPLATE, messages, add_generation_prompt=False, clear_thinking=True)
    assert "<think>r1</think>a1" in kept and "<think>r2</think>a2" in kept
    assert "<|assistant|><think></think>a1" in cleared and "<think>r2</think>a2" in cleared


def test_required_and_named_tool_choice_add_an_instruction():
    user = [{"role": "user", "content": "x"}]
    required = render(TEMPLATE, user, tools=[WEATHER_TOOL], tool_choice="required")
    named = render(
        TEMPLATE,
        user,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert "...</tool_call>\n\nYou must call at least one of these functions.<|user|>x" in required
    assert "...</tool_call>\n\nYou must call the function get_weather.<|user|>x" in named


def test_text_parts_are_joined_and_non_ascii_kept():
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "wörld"}],
        }
    ]
    assert render(TEMPLATE, messages).endswith("<|user|>héllo wörld<|assistant|><think>")


def test_template_errors_are_reported_as_template_errors():
    with pytest.raises(TemplateError, match="the chat template failed: no"):
        render("{{ raise_exception('no') }}", [])
    with pytest.raises(TemplateError, match="does not parse"):
        render("{% if %}", [])


@pytest.mark.parametrize(
    "messages, tools, kwargs",
    [
        (TOOL_CONVERSATION, [WEATHER_TOOL], {}),
        (
            [{"role": "user", "content": "x"}],
            None,
            {"enable_thinking": False, "reasoning_effort": "high"},
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning": "r"},
                {"role": "user", "content": "q2"},
            ],
            None,
            {"clear_thinking": True},
        ),
    ],
)
def test_render_matches_transformers_apply_chat_template(messages, tools, kwargs):
    # transformers drops None-valued message keys itself (apply_chat_template's normalisation)
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[clean],
        tools=tools,
        chat_template=TEMPLATE,
        add_generation_prompt=True,
        **kwargs,
    )
    assert render(TEMPLATE, messages, tools=tools, **kwargs) == rendered[0]


# The template before its loops were made linear (each run of tool messages rescanned every
# message); kept only to check that the linear one renders every conversation byte for byte alike.
QUADRATIC_TEMPLATE = (
    Path(__file__).parent / "fixtures" / "chat_template_quadratic.jinja"
).read_text(encoding="utf-8")


class Rand(random.Random):
    """A seeded generator that shows its seed, so that a failing case can be replayed."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.seed_value = seed

    def __repr__(self) -> str:
        return f"Rand({self.seed_value})"


def _call(rng: Rand, ids: list) -> dict:
    call_id = rng.choice([*ids, None, "dup", "x", "é\n", 'q"'])
    call = {"type": "function", "function": {"name": rng.choice(["f", "g"]), "arguments": {}}}
    if rng.random() < 0.3:
        call["function"]["arguments"] = {"a": rng.choice([1, "s", [1, 2], {"k": None}])}
    if rng.random() < 0.9:
        call["id"] = call_id
    return call


def _conversation(rng: Rand) -> list[dict]:
    ids = [f"c{i}" for i in range(4)]
    messages = []
    for _ in range(rng.randint(0, 14)):
        role = rng.choice(["user", "assistant", "assistant", "tool", "tool", "tool", "system"])
        if role == "assistant":
            message = {"role": role, "content": rng.choice(["", "a", "<think>r</think>a", None])}
            if rng.random() < 0.3:
                message["reasoning_content"] = rng.choice(["why", " pad "])
            if rng.random() < 0.7:
                message["tool_calls"] = [_call(rng, ids) for _ in range(rng.randint(0, 4))]
        elif role == "tool":
            message = {"role": role, "content": rng.choice(["r", "", "<x>"])}
            if rng.random() < 0.9:
                message["tool_call_id"] = rng.choice([*ids, *ids, "dup", "zzz", 'q"', "é\n"])
        else:
            message = {"role": role, "content": rng.choice(["hi", [{"type": "text", "text": "p"}]])}
        messages.append(message)
    return messages


@pytest.mark.parametrize("seed", range(40))
def test_linear_template_renders_like_the_quadratic_one(seed):
    rng = Rand(seed)
    for _ in range(25):
        messages = _conversation(rng)
        kwargs = {
            "tools": [WEATHER_TOOL] if rng.random() < 0.3 else None,
            "clear_thinking": rng.choice([None, True, False]),
            "enable_thinking": rng.choice([None, True, False]),
            "reasoning_effort": rng.choice([None, "low", "high"]),
            "add_generation_prompt": rng.random() < 0.8,
        }
        expected = render(QUADRATIC_TEMPLATE, messages, **kwargs)
        assert render(TEMPLATE, messages, **kwargs) == expected, (rng, messages, kwargs)


def _tool_pairs(num_pairs: int, *, reversed_results: bool = False) -> list[dict]:
    messages = [{"role": "user", "content": "go"}]
    for i in range(num_pairs):
        calls = [
            {"id": f"c{i}-{j}", "type": "function", "function": {"name": "f", "arguments": {}}}
            for j in range(2)
        ]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        results = [{"role": "tool", "tool_call_id": c["id"], "content": c["id"]} for c in calls]
        messages += results[::-1] if reversed_results else results
    return messages


def _render_work(template: str, messages: list[dict]) -> int:
    """Python and C function calls made while rendering: a deterministic count of the work."""
    render(template, messages[:3])  # compiles the template: a one-off cost left uncounted
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        render(template, messages)
    finally:
        sys.setprofile(None)
    return calls


def test_render_work_grows_linearly_with_tool_call_pairs():
    small = _render_work(TEMPLATE, _tool_pairs(500, reversed_results=True))
    large = _render_work(TEMPLATE, _tool_pairs(1000, reversed_results=True))
    assert large < 2.2 * small  # the quadratic template: over 3x


def test_renders_20000_tool_call_pairs_in_call_order():
    out = render(TEMPLATE, _tool_pairs(20000, reversed_results=True))
    assert out.count("<|observation|>") == 20000
    assert "<tool_response>c19999-0</tool_response><tool_response>c19999-1</tool_response>" in out
