"""Checks on a request body's JSON that msgspec cannot make: nesting depth (checked before any
decoder recurses, so a deep body can never raise RecursionError), the path of the value at a
byte offset (to name the parameter of a malformed body), and lone UTF-16 surrogates.

Paths are written as the error `param`s are: `tools[0].function.parameters.properties.x`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

from glm53.api.errors import ApiError, from_decode_error

# JSON nested deeper than this (objects and arrays, the body's own object counted) is refused
# as malformed: decoders, the chat template and llguidance all recurse over it.
MAX_DEPTH = 100

_TOKENS = re.compile(rb'"[^"]*"\s*:|"[^"]*"|[\[\]{},]')
_STRUCTURE = np.zeros(256, dtype=bool)
_STRUCTURE[[ord(c) for c in '"[]{}']] = True


def _unescaped(data: bytes) -> bytes:
    """`data` with every escape pair that could hide a quote (`\\\\` and `\\"`) blanked, same
    length, so that each `"` left delimits a string."""
    return data.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def too_deep_at(data: bytes, limit: int = MAX_DEPTH) -> int | None:
    """The byte offset of the first `[` or `{` that opens level `limit + 1` of `data` (JSON
    text), or None when it nests no deeper than `limit`."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    plain = np.frombuffer(_unescaped(data), dtype=np.uint8)
    where = np.flatnonzero(_STRUCTURE[plain])
    chars = plain[where]
    in_string = np.cumsum(chars == ord('"')) % 2 == 1
    step = np.zeros(chars.size, dtype=np.int32)
    step[(chars == ord("[")) | (chars == ord("{"))] = 1
    step[(chars == ord("]")) | (chars == ord("}"))] = -1
    step[in_string] = 0
    over = np.cumsum(step, dtype=np.int64) > limit
    return int(where[np.argmax(over)]) if over.any() else None


def _key(raw: bytes) -> str:
    try:
        return json.loads(raw)
    except ValueError:
        return raw[1:-1].decode("utf-8", "replace")


def path_at(data: bytes, offset: int) -> str:
    """The path of the innermost value of `data` (JSON text) that holds byte `offset`."""
    plain = _unescaped(data[:offset])
    stack: list[list] = []  # [container char, key or index]
    for match in _TOKENS.finditer(plain):
        token = match.group()
        if token.endswith(b":"):
            if stack and stack[-1][0] == "{":
                end = token.rindex(b'"') + 1
                stack[-1][1] = _key(data[match.start() : match.start() + end])
        elif token in (b"[", b"{"):
            stack.append([token.decode(), 0 if token == b"[" else None])
        elif token in (b"]", b"}"):
            if stack:
                stack.pop()
        elif token == b"," and stack and stack[-1][0] == "[":
            stack[-1][1] += 1
    return join_path("", *(label for kind, label in stack if label is not None))


def join_path(base: str, *labels: str | int) -> str:
    out = base
    for label in labels:
        out = f"{out}[{label}]" if isinstance(label, int) else f"{out}.{label}".lstrip(".")
    return out


def check_depth(data: bytes, param: str = "") -> None:
    """ApiError 400 naming where `data` (JSON text; its path in the request is `param`) nests
    deeper than MAX_DEPTH."""
    at = too_deep_at(data)
    if at is None:
        return
    where = join_path(param, path_at(data, at)) if param else path_at(data, at)
    raise ApiError(
        400,
        f"the JSON at {where or 'the top level'} nests more than {MAX_DEPTH} levels deep "
        f"(objects and arrays); send JSON nested at most {MAX_DEPTH} levels",
        param=where or None,
        code="too_deep",
    )


def _is_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(path, string) of the first string or object key in `value` (decoded JSON, nested no
    deeper than MAX_DEPTH) that holds a lone UTF-16 surrogate, which no UTF-8 text can hold."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if _is_lone_surrogate(item):
                return path, item
        elif isinstance(item, dict):
            for key, sub in item.items():
                if _is_lone_surrogate(key):
                    return join_path(path, key.encode("utf-8", "backslashreplace").decode()), key
                todo.append((join_path(path, key), sub))
        elif isinstance(item, list):
            todo.extend((join_path(path, i), sub) for i, sub in enumerate(item))
    return None


def surrogate_error(path: str, text: str) -> ApiError:
    bad = next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    return ApiError(
        400,
        f"the string at {path} holds a lone UTF-16 surrogate (\\u{ord(bad):04x}), which is not a "
        "character: send a high surrogate followed by a low one (\\ud83d\\ude00), or the "
        "character itself",
        param=path,
        code="invalid_unicode",
    )


_BYTE = re.compile(r"\(byte (?P<offset>\d+)\)")


def malformed(message: str, body: bytes) -> ApiError:
    """The 400 for a body msgspec found malformed (`message`, its error), naming the parameter
    at fault where it can be found: the string with a lone surrogate, or the value at the byte
    msgspec names."""
    if "surrogate" in message or "truncated" in message:
        try:
            decoded = json.loads(body)  # Python's json takes lone surrogates
        except ValueError:
            decoded = None
        found = lone_surrogate(decoded) if decoded is not None else None
        if found is not None:
            return surrogate_error(*found)
    at = _BYTE.search(message)
    param = path_at(body, int(at.group("offset"))) if at else ""
    return ApiError(
        400,
        f"the body is not valid JSON: {message}"
        + (f" (in {param}; JSON has no NaN or Infinity, and strings are UTF-8)" if param else ""),
        param=param or None,
        code="invalid_json",
    )


def decode_request(decoder: msgspec.json.Decoder, body: bytes):
    """`body` decoded by `decoder`, or the 400 that names what is wrong with it: too deep
    (checked first), malformed JSON, or a value of the wrong type."""
    check_depth(body)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_decode_error(exc) from None
    except msgspec.DecodeError as exc:
        raise malformed(str(exc), body) from None
