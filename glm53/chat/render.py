"""Render a conversation with a checkpoint's jinja chat template, the way Hugging Face's
`apply_chat_template` does: a sandboxed environment with `trim_blocks` and `lstrip_blocks`, the
loop-controls extension, a `tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`,
and keys whose value is None dropped from every message."""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glm53.errors import Glm53Error

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


class TemplateError(ValueError, Glm53Error):
    """The chat template failed to render these messages (raised by the template or by jinja2)."""


def default_template() -> str:
    """glm53's own GLM-5.3-Flash chat template (the one synthetic checkpoints ship)."""
    return TEMPLATE_PATH.read_text(encoding="utf-8")


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# Names a caller's template variables may not take: render()'s own arguments, jinja's `self`,
# and the environment's globals (range, namespace, raise_exception...), which a variable of the
# same name would hide from the template.
RESERVED_VARIABLES = frozenset(
    {"source", "messages", "tools", "add_generation_prompt", "self", *_environment().globals}
)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = _environment()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the chat template does not parse: {exc} (line {exc.lineno})") from exc


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # As in HF: keys whose value is None are left out (templates test `is defined`), and reasoning
    # sent under another name is copied to `reasoning_content` (and `thinking`).
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render `messages` (OpenAI-shaped dicts; assistant tool-call arguments already parsed to
    dicts) with the template `source`. Extra keyword arguments become template variables
    (`enable_thinking`, `reasoning_effort`, any `chat_template_kwargs`)."""
    template = compile_template(source)
    reserved = sorted(RESERVED_VARIABLES.intersection(kwargs))
    if reserved:
        raise TemplateError(f"template variables may not be named {', '.join(reserved)}")
    variables = {k: v for k, v in kwargs.items() if v is not None}
    try:
        return template.render(
            messages=[_template_message(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template failed: {exc}") from exc
    except (TypeError, ValueError) as exc:  # the template's own operations on request values
        raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
