"""The Engine protocol: what the scheduler needs from a model backend (CPU, GPU, scripted).

Threading: the scheduler calls `load`, `step`, `release` and `close` from its own engine thread,
one call at a time; `stats` may be called from any thread and returns a snapshot. Nothing here is
async and nothing here touches the event loop.

A step runs up to `num_slots` streams. Each stream owns one slot (its KV and recurrent KDA state)
from its first prefill chunk until `release`. A `StreamWork` with `start_pos == 0` starts a new
stream in that slot: the engine resets the slot's state first. Prefill arrives in chunks; the last
chunk of a prompt and every decode step ask for logits (`want_logits`: the row of the item's last
position). A chunk whose prompt is scored (prompt logprobs) asks for `all_logits`: one row per
position of the item, the last of which is the `want_logits` row when both are set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch


class EngineError(RuntimeError):
    """An engine failed a step. `slots` names the streams it concerns; empty means the whole step."""

    def __init__(self, message: str, slots: Sequence[int] = ()):
        super().__init__(message)
        self.slots = tuple(slots)


class EngineUnavailable(RuntimeError):
    """The chosen engine cannot run in this install or on this host; the message says why and what to do."""


class StreamWork(msgspec.Struct):
    """Tokens to run for one stream in one step: `token_ids` at positions `start_pos ..`.

    A msgspec Struct rather than a dataclass: the scheduler makes one per stream and step on the
    engine thread between two steps, where a dataclass's Python __init__ costs a few us more."""

    slot: int
    token_ids: list[int]
    start_pos: int
    want_logits: bool
    all_logits: bool = False


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one checkpoint; special tokens written in text are encoded as their
    ids. `chat_template` is "" for a checkpoint without one."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def new_decoder(self) -> IncrementalDecoder: ...


class IncrementalDecoder(Protocol):
    """Decodes a growing token sequence; `step` returns the text that became final (maybe '')."""

    def step(self, token_id: int) -> str: ...


@runtime_checkable
class Engine(Protocol):
    """A model backend driven by the scheduler.

    `name` is the engine's kind (cpu, gpu, scripted); `description` is one line for the log and
    /server_info that says what runs (and, for the scripted engine, that it is not a model).
    After `load`: `tokenizer`, `context_length` (tokens per stream, prompt + answer),
    `num_slots` (most streams per step) and `generation_defaults` (the checkpoint's sampling
    defaults, see glm53.engine.tokenizer.read_generation_defaults) are valid.
    """

    name: str
    description: str
    is_model: bool
    tokenizer: Tokenizer
    context_length: int
    num_slots: int
    generation_defaults: dict[str, float]

    def load(self) -> None: ...

    def step(self, work: Sequence[StreamWork]) -> torch.Tensor | np.ndarray:
        """Run one step; return logits [rows, vocab_size], in the order of `work`: an item
        with `all_logits` has len(token_ids) rows (position by position), else one row if it
        has `want_logits`, else none. A torch tensor (any device) or a float32 numpy array.
        Raise EngineError naming the slots that failed."""
        ...

    def release(self, slot: int) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters as JSON-ready values; tier counters go under "tiers"."""
        ...

    def close(self) -> None: ...
