"""The size limits a request meets before any CPU-heavy work starts (rendering, tokenizing,
compiling a grammar): each refusal is a 400 naming the limit and the setting that raises it."""

from __future__ import annotations

from typing import Any

from glm53.api.errors import ApiError
from glm53.config import Settings, setting_info


def _refuse(what: str, limit: int, setting: str, param: str) -> ApiError:
    info = setting_info(setting)
    flag, env = info.flags[0], info.env
    return ApiError(
        400,
        f"{what}; the limit is {limit} ({flag} / {env} raises it)",
        param=param,
        code="limit_exceeded",
    )


def check_prompt_chars(settings: Settings, num_chars: int, param: str) -> None:
    if num_chars > settings.max_prompt_chars:
        raise _refuse(
            f"the prompt has {num_chars} characters",
            settings.max_prompt_chars,
            "max_prompt_chars",
            param,
        )


def check_messages(settings: Settings, num_messages: int) -> None:
    if num_messages > settings.max_messages:
        raise _refuse(
            f"the request has {num_messages} messages",
            settings.max_messages,
            "max_messages",
            "messages",
        )


def check_schema(settings: Settings, schema: Any, param: str) -> None:
    """Refuse a JSON schema nested deeper than --max-schema-depth or holding more than
    --max-schema-nodes values (walked without recursion, so any depth is measured safely)."""
    max_depth, max_nodes = settings.max_schema_depth, settings.max_schema_nodes
    num_nodes = 0
    todo = [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        num_nodes += 1
        if num_nodes > max_nodes:
            raise _refuse(
                f"the JSON schema has more than {max_nodes} values",
                max_nodes,
                "max_schema_nodes",
                param,
            )
        if isinstance(value, dict | list):
            if depth > max_depth:
                raise _refuse(
                    f"the JSON schema nests objects and arrays more than {max_depth} deep",
                    max_depth,
                    "max_schema_depth",
                    param,
                )
            children = value.values() if isinstance(value, dict) else value
            todo.extend((child, depth + 1) for child in children)
