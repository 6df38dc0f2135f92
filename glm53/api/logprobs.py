"""Logprob entries (glm53.engine.logprobs.TokenLogprob) in the API's three shapes: OpenAI chat
(`choices[].logprobs.content[]`), OpenAI completions (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`) and SGLang's `meta_info` lists ([logprob, token id, text]).

A -inf logprob (a token the logits rule out) is written as -9999.0, as OpenAI does: JSON has
no infinity. With `as_token_ids` (vLLM's `return_tokens_as_token_ids`) a token is written as
"token_id:N", which stays unambiguous where several tokens decode to the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

from glm53.api.schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from glm53.engine.base import Tokenizer
from glm53.engine.logprobs import TokenLogprob

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR  # also maps NaN (an all -inf row) to the floor


class TokenNames:
    """Token id -> (text, bytes) for one response, memoized (a response repeats tokens)."""

    def __init__(self, tokenizer: Tokenizer, as_token_ids: bool = False):
        self._tokenizer = tokenizer
        self._as_ids = as_token_ids
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._tokenizer.token_bytes(token_id)
            text = f"token_id:{token_id}" if self._as_ids else raw.decode("utf-8", errors="replace")
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def chat_logprobs(entries: Sequence[TokenLogprob], names: TokenNames) -> ChatLogprobs:
    content = []
    for e in entries:
        text, raw = names.get(e.token_id)
        top = [
            TopLogprob(*names.get(i), _value(v))
            for i, v in zip(e.top_ids, e.top_logprobs, strict=True)
        ]
        content.append(ChatTokenLogprob(text, _value(e.logprob), raw, top))
    return ChatLogprobs(content)


class CompletionLogprobBuilder:
    """Builds completions `logprobs` objects over a response, keeping `text_offset` running
    (each token's offset is the length of the text before it, token texts concatenated)."""

    def __init__(self, names: TokenNames, offset: int = 0):
        self._names = names
        self._offset = offset

    def build(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]
    ) -> CompletionLogprobs:
        out = CompletionLogprobs([], [], [], [])
        for token_id, e in zip(token_ids, entries, strict=True):
            text = self._names.text(token_id)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(e.logprob))
            top: dict[str, float] = {}
            for i, v in zip(e.top_ids, e.top_logprobs, strict=True):
                top.setdefault(self._names.text(i), _value(v))
            out.top_logprobs.append(top)
        return out


def sglang_lists(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    names: TokenNames | None,
    with_top: bool,
) -> tuple[list[list], list[list[list] | None]]:
    """(token logprobs [[logprob, id, text]], top logprobs [[[logprob, id, text], ...]]) in
    SGLang's meta_info shape; text is None unless `names` (return_text_in_logprobs)."""

    def triple(logprob: float | None, token_id: int) -> list:
        text = names.text(token_id) if names is not None else None
        return [None if logprob is None else _value(logprob), token_id, text]

    tokens, tops = [], []
    for token_id, e in zip(token_ids, entries, strict=True):
        tokens.append(triple(None if e is None else e.logprob, token_id))
        if with_top:
            tops.append(
                None
                if e is None
                else [triple(v, i) for i, v in zip(e.top_ids, e.top_logprobs, strict=True)]
            )
    return tokens, tops
