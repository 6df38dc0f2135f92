"""Chat: prompt rendering with the checkpoint's jinja template, and the incremental output parser
(reasoning, content, GLM tool calls -> OpenAI tool_calls)."""

from glm53.chat.parse import CompletionParser, Delta, parse_completion
from glm53.chat.render import TemplateError, default_template, render

__all__ = [
    "CompletionParser",
    "Delta",
    "TemplateError",
    "default_template",
    "parse_completion",
    "render",
]
