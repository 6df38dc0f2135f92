"""A checkpoint's tokenizer (tokenizer.json through the `tokenizers` library), its chat template,
its stop token ids and its default sampling settings, read from the checkpoint's JSON files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from glm53.engine.base import PromptTooLong


def missing_template(directory: str | Path) -> str:
    """Why a checkpoint without a chat template cannot serve chat, and what to add."""
    return (
        f"{directory} has no chat template (no chat_template.jinja, and no chat_template "
        "string in tokenizer_config.json), so /v1/chat/completions cannot render messages; "
        "add chat_template.jinja there, or use /v1/completions or /generate with a raw prompt"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class _StreamDecoder:
    """tokenizers' DecodeStream, which holds back the bytes of a character not yet complete,
    plus `finish`: at the end those bytes are text too, rendered as `decode` renders them (a
    U+FFFD each), so that the streamed text of a finished sequence equals `decode` of its ids.
    It keeps only the ids since the last text it returned, and those that gave that text (the
    context `decode` needs for the held-back ones, as DecodeStream itself keeps)."""

    __slots__ = ("_held", "_last", "_stream", "_tokenizer")

    def __init__(self, tokenizer: _HFTokenizer):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._last: list[int] = []  # the ids that gave the last text returned
        self._held: list[int] = []  # the ids since, whose text is held back

    def step(self, token_id: int) -> str:
        self._held.append(token_id)
        text = self._stream.step(self._tokenizer, token_id) or ""
        if text:
            self._last, self._held = self._held, []
        return text

    def finish(self) -> str:
        """The held-back tail ('' when nothing is held back)."""
        if not self._held:
            return ""
        held = self._held
        head, whole, alone = self._tokenizer.decode_batch(
            [self._last, self._last + held, held], skip_special_tokens=False
        )
        self._last, self._held = self._last + held, []
        # with its context when the context's text is a prefix (byte-level BPE: always)
        return whole[len(head) :] if whole.startswith(head) else alone


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class CheckpointTokenizer:
    """The Tokenizer of a checkpoint directory (implements glm53.engine.base.Tokenizer).
    `chat_template` is "" when the checkpoint has none (chat is refused, completions work)."""

    def __init__(self, tokenizer: _HFTokenizer, chat_template: str, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self._byte_level = _byte_level_table() if decoder.get("type") == "ByteLevel" else None
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}

    @property
    def hf_tokenizer(self) -> _HFTokenizer:
        return self._tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character for some byte-level
        tokens); for a tokenizer that is not byte-level, the UTF-8 of its decoded text."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @classmethod
    def from_dir(cls, directory: str | Path) -> CheckpointTokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: a checkpoint needs its tokenizer.json")
        tokenizer = _HFTokenizer.from_file(str(path))
        tok_config = _read_json(directory / "tokenizer_config.json")
        template_file = directory / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(tok_config.get("chat_template"), str):
            template = tok_config["chat_template"]
        else:
            template = ""  # /v1/chat/completions says what is missing (missing_template)
        config = _read_json(directory / "config.json")
        eos = _ids(_read_json(directory / "generation_config.json").get("eos_token_id"))
        eos += _ids(config.get("eos_token_id")) + _ids(
            config.get("text_config", {}).get("eos_token_id")
        )
        if isinstance(tok_config.get("eos_token"), str):
            eos += _ids(tokenizer.token_to_id(tok_config["eos_token"]))
        if not eos:
            raise ValueError(
                f"{directory} names no eos token id (generation_config.json or config.json)"
            )
        return cls(tokenizer, template, eos)

    # The `_batch` calls release the GIL while they work (`encode` and `decode` hold it: a
    # 2M-character prompt froze every thread of the server for 1.2 s; encode_batch of the same
    # text let them run), and give the same ids and text. encode_batch_fast gives the same ids
    # without offsets or token strings: freeing encode_batch's Encoding of a 3M-character
    # prompt (1.8M token strings) held the GIL for 175 ms, this one's for 2 ms
    # (bench/health_under_load.py found the stall; tokenizers >= 0.21 has it).
    # A prompt of `context_length` tokens or more is refused from the encoding's length, before
    # its ids become a Python list: for 1.8M tokens that list alone held the GIL for 40-55 ms.
    def encode(self, text: str, context_length: int | None = None) -> list[int]:
        encoding = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0]
        if context_length is not None and len(encoding) >= context_length:
            raise PromptTooLong(len(encoding), context_length)
        return encoding.ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode_batch([list(token_ids)], skip_special_tokens=False)[0]

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def new_decoder(self) -> _StreamDecoder:
        return _StreamDecoder(self._tokenizer)


_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def read_generation_defaults(directory: str | Path) -> dict[str, float]:
    """The checkpoint's sampling defaults from generation_config.json (do_sample false means
    greedy), used for fields a request leaves out."""
    config = _read_json(Path(directory) / "generation_config.json")
    out = {k: float(config[k]) for k in _SAMPLING_KEYS if isinstance(config.get(k), int | float)}
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
