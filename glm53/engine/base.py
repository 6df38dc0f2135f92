"""The engine protocols: what the scheduler needs from a model backend (CPU, GPU, scripted).

Two kinds. A step engine (`Engine`: the CPU and scripted engines) runs steps that the scheduler
plans, and the scheduler samples. A job engine (`JobEngine`: the GPU engine, over exllamav3's
own Generator) takes whole requests: the scheduler starts and cancels them and calls `iterate`,
and the engine plans, samples and returns tokens. The scheduler keeps admission, limits,
cancellation, stop strings and stats for both.

Threading: the scheduler calls `load`, `step`, `release` and `close` from its own engine thread,
one call at a time; `stats` may be called from any thread and returns a snapshot. Nothing here is
async and nothing here touches the event loop.

A step runs up to `num_slots` streams. Each stream owns one slot (its KV and recurrent KDA state)
from its first prefill chunk until `release`. A `StreamWork` with `start_pos == 0` starts a new
stream in that slot: the engine resets the slot's state first. Prefill arrives in chunks; the last
chunk of a prompt and every decode step ask for logits (`want_logits`).

An engine may also implement `PrefixSnapshots` (the CPU engine does): the scheduler then copies
a slot's state out after prefill chunks that end at a chunk boundary and restores it into a new
stream's slot whose prompt starts with the same tokens; that stream's first `StreamWork` has
`start_pos` equal to the restored length (see glm53.engine.prefix_cache). Engines that reuse
prefixes on their own (the GPU engine, inside exllamav3's Generator) leave it out.
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


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one checkpoint; special tokens written in text are encoded as their ids."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def new_decoder(self) -> IncrementalDecoder: ...


class IncrementalDecoder(Protocol):
    """Decodes a growing token sequence; `step` returns the text that became final (maybe '')."""

    def step(self, token_id: int) -> str: ...


class JobOutput(msgspec.Struct):
    """What one `JobEngine.iterate` produced for one job: its new tokens in order (a stop token
    included, last), the logits they were sampled from [len(token_ids), vocab] when the job asked
    for them, and `finish` ("stop": a stop token; "length": max_new_tokens; "error") when the
    job ended. `cached_tokens` is set once, when the job started: prompt tokens reused from the
    prefix cache."""

    key: Any
    token_ids: list[int]
    logits: Any = None
    finish: str | None = None
    error: str | None = None
    cached_tokens: int | None = None


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
        """Run one step; return logits [number of items with want_logits, vocab_size], in the
        order of `work`, as a torch tensor (any device) or a float32 numpy array. Raise
        EngineError naming the slots that failed."""
        ...

    def release(self, slot: int) -> None: ...

    def stats(self) -> dict[str, Any]:
        """Counters as JSON-ready values; tier counters go under "tiers"."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PrefixSnapshots(Protocol):
    """Optional engine surface for the scheduler's prefix cache (called on the engine thread)."""

    def snapshot(self, slot: int) -> tuple[Any, int]:
        """A copy of the slot's whole stream state that later steps of the slot do not change,
        and its size in bytes."""
        ...

    def restore(self, slot: int, state: Any) -> None:
        """Make the slot's state a copy of `state` (from `snapshot`; `state` itself stays
        unchanged, as it may be restored again)."""
        ...


@runtime_checkable
class JobEngine(Protocol):
    """A backend that runs whole requests (`drives_jobs` is True). Threading as for Engine: the
    scheduler's engine thread makes every call but `stats`.

    `start(key, request, max_new_tokens, want_logits)` enqueues a GenerationRequest under a
    hashable key (the engine admits it when it has room, up to `num_slots` at once); `cancel(key)`
    drops it wherever it is; `iterate()` runs one step of everything admitted and returns a
    JobOutput per job that produced something. A job that finished or failed is forgotten by the
    engine; an exception out of `iterate` fails every job."""

    name: str
    description: str
    is_model: bool
    drives_jobs: bool
    tokenizer: Tokenizer
    context_length: int
    num_slots: int
    generation_defaults: dict[str, float]

    def load(self) -> None: ...

    def start(self, key: Any, request: Any, max_new_tokens: int, want_logits: bool) -> None: ...

    def cancel(self, key: Any) -> None: ...

    def iterate(self) -> list[JobOutput]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
