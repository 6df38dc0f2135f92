"""Parse GLM-5.3-Flash output into reasoning, content and OpenAI tool calls, incrementally.

Generated text starts inside the think block when the prompt ended with `<think>` (GLM-5.3's
generation prompt); text up to `</think>` is reasoning, the rest is content. With tools, each
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` becomes a tool call:
a value stays a string when the tool's JSON schema says the property is a string, else it is
decoded as JSON when it decodes. Tags are held back only while the text could still become one.
Reasoning and content have their leading and trailing whitespace removed (whitespace inside is
kept; trailing whitespace is sent once more text follows it).

`CompletionParser` is the incremental parser; `parse_completion` runs it over a whole text, so
streaming and non-streaming answers are parsed by the same code.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_ARG = re.compile(
    r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)(?:</arg_value>|$)", re.DOTALL
)


@dataclass(slots=True)
class Delta:
    """One piece of parsed output: reasoning text, content text, or one complete tool call."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: dict[str, Any] | None = None


def _partial_tag_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


class _Trimmer:
    """Drops leading and trailing whitespace of a streamed text without delaying anything else."""

    __slots__ = ("_held", "_started")

    def __init__(self):
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = self._held + body
        self._held = text[len(body) :]
        return out


def string_properties(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, set[str]]:
    """Tool name -> names of its parameters whose JSON-schema type is (or includes) string."""
    out: dict[str, set[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        names = set()
        for key, schema in props.items() if isinstance(props, Mapping) else ():
            kind = schema.get("type") if isinstance(schema, Mapping) else None
            if kind == "string" or (isinstance(kind, list) and "string" in kind):
                names.add(key)
        out[fn["name"]] = names
    return out


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_call(body: str, string_props: Mapping[str, set[str]]) -> dict[str, Any] | None:
    """An OpenAI tool call from the text between <tool_call> and </tool_call>; None without a name."""
    cut = body.find("<arg_key>")
    name = (body if cut < 0 else body[:cut]).strip()
    if not name or "<" in name:
        return None
    strings = string_props.get(name, set())
    arguments: dict[str, Any] = {}
    for match in _ARG.finditer(body, max(cut, 0)):
        key, raw = match.group("key").strip(), match.group("value")
        if key in strings:
            arguments[key] = raw
            continue
        try:
            arguments[key] = json.loads(raw)
        except ValueError:
            arguments[key] = raw
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class CompletionParser:
    """Incremental parser: `feed(text)` and `finish()` return Deltas; the totals are kept in
    `reasoning`, `content` and `tool_calls`. `tools` None (or tool_choice none) leaves tool-call
    markup in the content."""

    def __init__(
        self, tools: Iterable[Mapping[str, Any]] | None = None, *, in_reasoning: bool = True
    ):
        self._tools_on = tools is not None
        self._strings = string_properties(tools)
        self._state = "reasoning" if in_reasoning else "content"
        self._at_start = True  # nothing consumed yet: a leading <think> opens the reasoning
        self._buf = ""
        self._trim = {"reasoning": _Trimmer(), "content": _Trimmer()}
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) or None

    @property
    def content(self) -> str:
        return "".join(self.content_parts)

    def _text(self, kind: str, text: str, out: list[Delta]) -> None:
        text = self._trim[kind].feed(text)
        if text:
            (self.reasoning_parts if kind == "reasoning" else self.content_parts).append(text)
            out.append(Delta(kind, text))

    def _leading_think(self) -> bool:
        """At the very start, consume an opening <think>; False while the text could still be one."""
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN) :]
            self._state = "reasoning"
        elif THINK_OPEN.startswith(stripped):
            return False
        self._at_start = False
        return True

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._at_start and not self._leading_think():
                break
            if self._state == "tool_call":
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    break
                self._emit_call(self._buf[:end], out)
                self._buf = self._buf[end + len(CALL_CLOSE) :]
                self._state = "content"
                continue
            tag = THINK_CLOSE if self._state == "reasoning" else CALL_OPEN
            if self._state == "content" and not self._tools_on:
                self._text("content", self._buf, out)
                self._buf = ""
                break
            at = self._buf.find(tag)
            if at >= 0:
                self._text(self._state, self._buf[:at], out)
                self._buf = self._buf[at + len(tag) :]
                self._state = "content" if self._state == "reasoning" else "tool_call"
                continue
            keep = _partial_tag_len(self._buf, tag)
            self._text(self._state, self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def _emit_call(self, body: str, out: list[Delta]) -> None:
        call = parse_tool_call(body, self._strings)
        if call is None:  # not a tool call after all: keep the text
            self._text("content", CALL_OPEN + body + CALL_CLOSE, out)
            return
        self.tool_calls.append(call)
        out.append(Delta("tool_call", tool_call=call))

    def finish(self) -> list[Delta]:
        """End of output: release held text; an unclosed tool call with a name still counts."""
        out: list[Delta] = []
        buf, self._buf = self._buf, ""
        if self._state == "tool_call":
            call = parse_tool_call(buf, self._strings)
            if call is not None:
                self.tool_calls.append(call)
                out.append(Delta("tool_call", tool_call=call))
            else:
                self._text("content", CALL_OPEN + buf, out)
        elif buf:
            self._text(self._state, buf, out)
        return out


def parse_completion(
    text: str, tools: Iterable[Mapping[str, Any]] | None = None, *, in_reasoning: bool = True
) -> tuple[str | None, str, list[dict[str, Any]]]:
    """(reasoning, content, tool_calls) of a whole generated text. reasoning is None when there
    is no reasoning text; tool_calls are OpenAI-shaped dicts with `arguments` as JSON text."""
    parser = CompletionParser(tools, in_reasoning=in_reasoning)
    parser.feed(text)
    parser.finish()
    return parser.reasoning, parser.content, parser.tool_calls
