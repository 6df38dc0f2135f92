"""Structured outputs: llguidance grammars over the checkpoint's tokenizer, applied to a
stream's logits before each draw (the CPU and scripted engines' step path; the GPU engine
hands the same grammar to exllamav3's filter).

A request carries a `GrammarSpec`, which is engine-neutral: an llguidance grammar (the JSON
text LLMatcher.grammar_from_* returns) and the token after which it applies. Reasoning stays
free: with thinking on, the grammar starts after the `</think>` token; with thinking off, at
the first generated token. `Constraint` is one stream's matcher: `mask` rules out, in a row of
logits, every token the grammar does not allow next; `accept` advances it by the drawn token.
A token the grammar refuses (possible only when every allowed token had a -inf logit) puts
the matcher in its error state; from there only the end-of-sequence tokens are allowed, so the
stream ends, and the error is logged.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
import numpy as np
from llguidance import LLMatcher, LLTokenizer, regex_to_lark
from llguidance.numpy import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)

from glm53.engine.base import Tokenizer
from glm53.errors import Glm53Error

log = logging.getLogger("glm53.grammar")

# JSON is written as Python's json.dumps writes it ("a, b" and "k: v", no other whitespace), the
# way models usually write it; llguidance's default (any whitespace anywhere) let the random demo
# model fill its whole budget with blanks. A schema's own "x-guidance" options still win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# GLM-5.3-Flash's tool-call markup (glm53/chat/chat_template.jinja, glm53/chat/parse.py).
_MARKUP = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


class GrammarError(ValueError, Glm53Error):
    """A grammar llguidance cannot compile; `path` names the part of the request at fault."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class GrammarSpec(msgspec.Struct, frozen=True):
    """`grammar`: an llguidance grammar (JSON text); `start_after`: the token id after which
    it applies (None: from the first generated token)."""

    grammar: str
    start_after: int | None = None


_LL_TOKENIZERS: dict[int, tuple[Tokenizer, LLTokenizer]] = {}


def ll_tokenizer(tokenizer: Tokenizer) -> LLTokenizer:
    """llguidance's view of a checkpoint tokenizer (built from its tokenizer.json once, kept)."""
    hit = _LL_TOKENIZERS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        ll = LLTokenizer(
            tokenizer.hf_tokenizer.to_str(),
            n_vocab=tokenizer.vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
        hit = _LL_TOKENIZERS[id(tokenizer)] = (tokenizer, ll)
    return hit[1]


def _compile_error(grammar: str, tokenizer: Tokenizer) -> str | None:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer(tokenizer))
    return messages[0] if is_error else None


def _children(schema: Any, path: str):
    """(subschema, path) for the parts of a JSON schema that are schemas themselves."""
    if not isinstance(schema, dict):
        return
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, f"{path}.{key}.{name}"
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield sub, f"{path}.{key}[{i}]"
    for key in ("items", "additionalProperties", "not", "contains"):
        if isinstance(schema.get(key), dict):
            yield schema[key], f"{path}.{key}"


def json_schema_grammar(schema: dict[str, Any], tokenizer: Tokenizer, path: str) -> str:
    """The grammar of JSON text valid under `schema`; GrammarError naming the deepest part of
    the schema that fails to compile with the same message (`path` is the schema's own)."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"the schema is not valid: {exc}", path) from None
    message = _compile_error(grammar, tokenizer)
    if message is None:
        return grammar
    # $refs point into the root's definitions: a part is compiled alone with them beside it
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}
    where = path
    node = schema
    while True:
        for sub, sub_path in _children(node, where):
            if isinstance(sub, dict) and _schema_error({**defs, **sub}, tokenizer) == message:
                node, where = sub, sub_path
                break
        else:
            break
    # the keyword at fault: the one whose removal changes the error
    for key in node:
        rest = {k: v for k, v in node.items() if k != key}
        if (
            key not in ("$defs", "definitions")
            and _schema_error({**defs, **rest}, tokenizer) != message
        ):
            where = f"{where}.{key}"
            break
    raise GrammarError(f"llguidance cannot compile the schema at {where}: {message}", where)


def _schema_error(schema: dict[str, Any], tokenizer: Tokenizer) -> str | None:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        return str(exc)
    return _compile_error(grammar, tokenizer)


def _lark_string(text: str) -> str:
    return json.dumps(text)


# What a raw string tool argument may hold for each JSON Schema `format` (whole value, RFC 3339
# dates and times, RFC 4122 UUIDs, dotted-quad IPv4, and the usual shapes of e-mail addresses,
# host names and URIs); other formats are refused rather than left unenforced.
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[Tt]" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "email": r"[A-Za-z0-9._%+-]+@" + _LABEL + rf"(\.{_LABEL})+",
    "hostname": _LABEL + rf"(\.{_LABEL})*",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[^\s<>]+",
}


def _outside_classes(pattern: str):
    """(index, char, group depth) of each character of an ECMA-262 regex that is neither
    escaped nor inside a character class."""
    depth, in_class, i = 0, False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            if c == ")":
                depth -= 1
            yield i, c, depth
            if c == "(":
                depth += 1
        i += 1


def _top_level_branches(pattern: str) -> list[str]:
    """`pattern` split at its top-level `|` (outside groups and classes, unescaped)."""
    cuts = [i for i, c, depth in _outside_classes(pattern) if c == "|" and depth == 0]
    return [pattern[a + 1 : b] for a, b in zip([-1, *cuts], [*cuts, len(pattern)], strict=True)]


def _has_anchor(branch: str) -> bool:
    """Whether an unescaped ^ or $ is left in `branch` outside character classes."""
    return any(c in "^$" for _, c, _ in _outside_classes(branch))


def _search_regex(pattern: str, path: str) -> str:
    """A whole-value lark regex for the strings that contain a match of `pattern` (JSON Schema
    semantics: an unanchored ECMA-262 search; ^ and $ anchor a top-level branch). An anchor
    anywhere else is a GrammarError naming `path`."""
    full = []
    for branch in _top_level_branches(pattern):
        head = branch.startswith("^")
        body = branch[1:] if head else branch
        tail = body.endswith("$") and not body.endswith("\\$")
        body = body[:-1] if tail else body
        if _has_anchor(body):
            raise GrammarError(
                f"the pattern {pattern!r} has ^ or $ inside a group: a raw string tool argument "
                "takes anchors only at the start or end of a top-level alternative",
                path,
            )
        any_text = r"[\s\S]*"
        full.append(f"{'' if head else any_text}(?:{body}){'' if tail else any_text}")
    return regex_to_lark("|".join(full), "dw")


# The longest minLength or maxLength a raw string argument may ask for (llguidance's regexes
# take bounded repetition counts).
MAX_RAW_LENGTH = 100_000


def _length(schema: dict[str, Any], key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RAW_LENGTH:
        raise GrammarError(
            f"{key} must be an integer from 0 to {MAX_RAW_LENGTH}, not {value!r}", f"{path}.{key}"
        )
    return value


def _string_choices(schema: dict[str, Any], path: str) -> list[str] | None:
    """The strings a string parameter's `enum` and `const` allow (None: no such keyword)."""
    choices = None
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not any(isinstance(v, str) for v in enum):
            raise GrammarError(
                f"enum of a string parameter must be an array holding at least one string, "
                f"not {enum!r}",
                f"{path}.enum",
            )
        choices = [v for v in enum if isinstance(v, str)]
    if "const" in schema:
        const = schema["const"]
        if not isinstance(const, str) or (choices is not None and const not in choices):
            raise GrammarError(
                f"const of a string parameter must be a string (and one of its enum), "
                f"not {const!r}",
                f"{path}.const",
            )
        choices = [const]
    return choices


def _raw_string(schema: dict[str, Any], path: str) -> str:
    """The lark for a string parameter's raw (unquoted) value: one of its `enum`, or text
    without '<' (it would open `</arg_value>`) within minLength..maxLength that also matches its
    `pattern` (a search, as JSON Schema means it) and its `format` (the whole value, FORMATS).
    `path` names the parameter in errors."""
    choices = _string_choices(schema, path)
    if choices is not None:
        return "(" + " | ".join(_lark_string(v) for v in choices) + ")"
    low, high = _length(schema, "minLength", path) or 0, _length(schema, "maxLength", path)
    if high is not None and high < low:
        raise GrammarError(
            f"maxLength {high} is less than minLength {low}: no string fits; send "
            f"maxLength >= minLength",
            f"{path}.maxLength",
        )
    parts = [f"/[^<]{{{low},{'' if high is None else high}}}/"]
    pattern, fmt = schema.get("pattern"), schema.get("format")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise GrammarError(
                f"pattern must be a string (a regular expression), not {pattern!r}",
                f"{path}.pattern",
            )
        parts.append(f"/{_search_regex(pattern, f'{path}.pattern')}/")
    if fmt is not None:
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise GrammarError(
                f"format {fmt!r} is not enforced for string tool arguments; the formats that are: "
                f"{', '.join(sorted(FORMATS))} (or leave format out, or give a pattern)",
                f"{path}.format",
            )
        parts.append(f"/{regex_to_lark(FORMATS[fmt], 'dw')}/")
    return " & ".join(parts)


def _parameters(params: Any, path: str) -> tuple[dict[str, Any], set[str]]:
    """A tool's `parameters` schema as (properties, required names), checked: an object schema
    whose `properties` maps names to schemas and whose `required` lists some of those names."""
    params = params or {}
    kind = params.get("type", "object")
    if kind != "object":
        raise GrammarError(
            f"parameters must be a schema of type 'object' (a tool takes named arguments), "
            f"not of type {kind!r}",
            f"{path}.type",
        )
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise GrammarError(
            f"properties must be a JSON object mapping each argument's name to its schema, "
            f"not {props!r}",
            f"{path}.properties",
        )
    required = params.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise GrammarError(
            f"required must be an array of argument names (strings), not {required!r}",
            f"{path}.required",
        )
    for name in required:
        if name not in props:
            raise GrammarError(
                f"required names {name!r}, which is not in properties: a tool call holds "
                f"only the arguments properties declares ({', '.join(props) or 'none'})",
                f"{path}.required",
            )
    return props, set(required)


def _check_raw(schema: dict[str, Any], lexeme: str, path: str, tokenizer: Tokenizer) -> None:
    """GrammarError naming a string parameter's `pattern`, else the parameter, when its raw
    value's regexes (see _raw_string) do not compile."""
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and "enum" not in schema and "const" not in schema:
        regex = _search_regex(pattern, f"{path}.pattern")
        message = _compile_error(LLMatcher.grammar_from_lark(f"start: V\nV: /{regex}/"), tokenizer)
        if message is not None:
            raise GrammarError(
                f"the pattern {pattern!r} is not a regular expression llguidance takes: {message}",
                f"{path}.pattern",
            )
    message = _compile_error(LLMatcher.grammar_from_lark(f"start: V\nV: {lexeme}"), tokenizer)
    if message is not None:
        raise GrammarError(f"llguidance cannot compile the parameter's value: {message}", path)


def tool_call_grammar(
    tools: list[tuple[int, dict[str, Any]]], tokenizer: Tokenizer, *, many: bool
) -> str:
    """The grammar of one (or, with `many`, one or more) GLM tool calls to one of `tools`
    ((index in the request, OpenAI tool dict) pairs): `<tool_call>NAME` then each parameter in the schema's order as
    `<arg_key>K</arg_key><arg_value>V</arg_value>` (required ones always, the others optional),
    then `</tool_call>`. A string parameter's value is raw text (see _raw_string); any other is
    JSON valid under its schema. Raises GrammarError naming the tool whose schema fails."""
    ids = {}
    for markup in _MARKUP:
        token = tokenizer.token_to_id(markup)
        if token is None:
            raise GrammarError(f"the tokenizer has no {markup} token for tool calls", "tools")
        ids[markup] = f"<[{token}]>"
    rules, alternatives = [], []
    for t, tool in tools:
        function = tool["function"]
        props, required = _parameters(function.get("parameters"), f"tools[{t}].function.parameters")
        parts = []
        for p, (name, schema) in enumerate(props.items()):
            value_rule = f"v{t}_{p}"
            path = f"tools[{t}].function.parameters.properties.{name}"
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError(
                    f"the schema of parameter {name!r} must be a JSON object (or true: any "
                    f"value), not {schema!r}",
                    path,
                )
            if schema.get("type") == "string":
                # a lexeme (upper case), so that & intersects its regexes
                lexeme = _raw_string(schema, path)
                _check_raw(schema, lexeme, path, tokenizer)
                rules.append(f"V{t}_{p}: {lexeme}")
                rules.append(f"{value_rule}: V{t}_{p}")
            else:
                # compiled alone to name a failing part; the lark below inlines the schema
                json_schema_grammar(schema, tokenizer, path)
                inline = {"x-guidance": JSON_OPTIONS, **schema}
                rules.append(f"{value_rule}: %json {json.dumps(inline)}")
            arg = (
                f"{ids['<arg_key>']} {_lark_string(name)} {ids['</arg_key>']} "
                f"{ids['<arg_value>']} {value_rule} {ids['</arg_value>']}"
            )
            parts.append(arg if name in required else f"({arg})?")
        rules.append(
            f"call{t}: {ids['<tool_call>']} {_lark_string(function['name'])} "
            f"{' '.join(parts)} {ids['</tool_call>']}"
        )
        alternatives.append(f"call{t}")
    start = f"start: ({' | '.join(alternatives)})" + ("+" if many else "")
    grammar = LLMatcher.grammar_from_lark("\n".join([start, *rules]))
    message = _compile_error(grammar, tokenizer)
    if message is not None:
        raise GrammarError(f"llguidance cannot compile the tool-call grammar: {message}", "tools")
    return grammar


def build_constraints(spec: GrammarSpec, tokenizer: Tokenizer, n: int) -> list[Constraint]:
    """`n` fresh Constraints of one grammar: its matcher is built once and copied (building
    one for a 10,000-property schema took 0.95 s; run this off the event loop)."""
    first = Constraint(spec, tokenizer)
    return [first, *(first.copy() for _ in range(n - 1))]


class Constraint:
    """One stream's grammar state (engine thread only, after the scheduler made it)."""

    def __init__(self, spec: GrammarSpec, tokenizer: Tokenizer, matcher: LLMatcher | None = None):
        ll = ll_tokenizer(tokenizer)
        self._matcher = LLMatcher(ll, spec.grammar) if matcher is None else matcher
        self._spec = spec
        self._tokenizer = tokenizer
        self._start_after = spec.start_after
        self.is_active = spec.start_after is None
        self._bitmask = allocate_token_bitmask(1, ll.vocab_size)
        self._eos = list(tokenizer.eos_token_ids)

    def copy(self) -> Constraint:
        """A fresh Constraint of the same grammar (a copy of this one's matcher, not rebuilt);
        call it before the stream starts."""
        return Constraint(self._spec, self._tokenizer, self._matcher.deep_copy())

    def mask(self, row: np.ndarray) -> None:
        """Set to -inf, in a row of logits [vocab] (float32, in place), every token not allowed."""
        if not self.is_active:
            return
        if self._matcher.is_error():
            keep = row[self._eos].copy()
            row[:] = -np.inf
            row[self._eos] = keep
            return
        fill_next_token_bitmask(self._matcher, self._bitmask)
        apply_token_bitmask_inplace(row[None, :], self._bitmask)

    def accept(self, token: int) -> None:
        if not self.is_active:
            self.is_active = token == self._start_after
            return
        if not self._matcher.is_error() and not self._matcher.consume_token(token):
            log.warning("the grammar refused token %d: %s", token, self._matcher.get_error())
