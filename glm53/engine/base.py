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
chunk of a prompt and every decode step ask for logits (`want_logits`: the row of the item's last
position). A chunk whose prompt is scored (prompt logprobs) asks for `all_logits`: one row per
position of the item, the last of which is the `want_logits` row when both are set.
An engine may also implement `PrefixSnapshots` (the CPU engine does): the scheduler then copies
a slot's state out after prefill chunks that end at a chunk boundary and restores it into a new
stream's slot whose prompt starts with the same tokens; that stream's first `StreamWork` has
`start_pos` equal to the restored length (see glm53.engine.prefix_cache). Engines that reuse
prefixes on their own (the GPU engine, inside exllamav3's Generator) leave it out.

Optional capabilities are declared members that every engine sets, never probed with getattr:
`drives_jobs` (False: a step engine; True: a job engine), `verify_tiers` (None: the engine keeps
no expert tiers to check, so /admin/verify answers 409), `save_heat()` (returns None: no heat
list to write, so /admin/save_heat answers 409), `fast` (None: no fast-mode lane, so the server
pins no thread; glm53.tiers.thread_pins) and, for step engines, `stream_usage(slot)` (None: the
engine does not count tiers per stream).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from glm53.errors import Glm53Error

if TYPE_CHECKING:  # only annotations name torch: glm53.engine imports without it (the doctor)
    import torch


class FinishReason(enum.StrEnum):
    """Why a stream ended (JobOutput.finish, TokenEvent.finish_reason, the API's finish_reason).
    A StrEnum: each member is its own string, so JSON, counters and the API's bytes read as
    plain strings."""

    STOP = "stop"  # a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the end of the context; a scored prompt ends so too
    ERROR = "error"  # the engine failed the stream (the error says how)
    CANCELLED = "cancelled"  # the consumer cancelled it (a client disconnect); no event says it
    TOOL_CALLS = "tool_calls"  # the chat API's alone: an answer that ended in tool calls


class PromptTooLong(ValueError, Glm53Error):
    """A prompt of as many tokens as the context holds, or more (the scheduler's and the
    tokenizer's refusal; the API answers 400 context_length_exceeded)."""

    def __init__(self, num_prompt_tokens: int, context_length: int):
        super().__init__(
            f"the prompt has {num_prompt_tokens} tokens but the context holds {context_length} "
            "(prompt and answer together); shorten the prompt or raise --context"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.context_length = context_length


class EngineError(RuntimeError, Glm53Error):
    """An engine failed a step. `slots` names the streams it concerns; empty means the whole step."""

    def __init__(self, message: str, slots: Sequence[int] = ()):
        super().__init__(message)
        self.slots = tuple(slots)


class EngineUnavailable(RuntimeError, Glm53Error):
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


class StreamUsage(msgspec.Struct):
    """What one stream cost in each tier, counted by the engine while the stream runs.

    Expert counts are per distinct expert per MoE layer call (a prefill chunk of 100 tokens that
    routes 30 distinct experts in a layer makes 30 lookups there), except `cpu_lane_picks`,
    which counts (token, expert) picks computed on the CPU lane. `vram_hits` and
    `zero_copy_misses` belong to the GPU engine (VRAM expert slots, and experts read over PCIe
    from pinned RAM); the CPU engine has no VRAM and leaves them 0. `store_read_bytes` is what
    the RAM tier read from the expert source (the NVMe store with --store, else the
    checkpoint's shards) on this stream's misses. `prefix_cached_tokens` are prompt tokens
    taken from a prefix cache instead of being computed. The scheduler fills
    `prefill_seconds` (the stream's first step to its first token) and `decode_seconds` (its
    first token to its last)."""

    vram_hits: int = 0
    zero_copy_misses: int = 0
    cpu_lane_picks: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    store_read_bytes: int = 0
    prefix_cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one checkpoint; special tokens written in text are encoded as their
    ids. `chat_template` is "" for a checkpoint without one."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str

    def encode(self, text: str, context_length: int | None = None) -> list[int]:
        """The text's token ids; with `context_length`, PromptTooLong (above) when
        they are that many or more, found before they are listed."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def new_decoder(self) -> IncrementalDecoder: ...


class IncrementalDecoder(Protocol):
    """Decodes a growing token sequence; `step` returns the text that became final (maybe '')."""

    def step(self, token_id: int) -> str: ...

    def finish(self) -> str:
        """At the end of the sequence: the text still held back (the bytes of an unfinished
        character, as `Tokenizer.decode` renders them), '' when there is none."""
        ...


class JobOutput(msgspec.Struct):
    """What one `JobEngine.iterate` produced for one job: its new tokens in order (a stop token
    included, last), the logits they were sampled from [len(token_ids), vocab] when the job asked
    for them, and `finish` (STOP: a stop token; LENGTH: max_new_tokens; ERROR, with `error`) when
    the job ended. `cached_tokens` is set once, when the job started: prompt tokens reused from the
    prefix cache. `logprobs`, when the request asked for them, is aligned with token_ids
    (glm53.engine.logprobs.TokenLogprob entries). `prompt_logits` [len(prompt), vocab] comes
    once, for a request that asked for prompt logprobs: row i predicts prompt token i + 1. A
    job that only scores its prompt (max_new_tokens 0) ends with finish LENGTH and no tokens."""

    key: Any
    token_ids: list[int]
    logits: Any = None
    logprobs: list[Any] | None = None
    prompt_logits: Any = None
    finish: FinishReason | None = None
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
    drives_jobs: bool  # False: a step engine
    # verify_tiers(num_samples): check that many sampled records of the expert tiers against
    # their source and return the glm53.tiers.check.TierCheck (called from a worker thread, by
    # /admin/verify; the engine locks its tiers). None: the engine keeps no tiers to check.
    verify_tiers: Callable[[int], Any] | None
    # the GPU engine's glm53.tiers.fast_lane.FastLane in fast mode, built on the engine thread
    # during `load`; None for every other engine and mode
    fast: Any | None
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

    def stream_usage(self, slot: int) -> StreamUsage | None:
        """The live counters of the stream now in `slot`: the engine adds to this object while
        the stream runs, and a new stream in the slot (`start_pos == 0`) gets a new one, so the
        scheduler can keep the object past `release`. Called on the engine thread after the
        stream's first step; readers on other threads may see counts one step old. None: the
        engine does not count per stream (the stream's usage then reports zeros)."""
        ...

    def save_heat(self) -> str | None:
        """Write the engine's heat list (its expert cache's keys, hottest first) for a warm
        start and return its path; None when the engine keeps no cache or has nothing to write."""
        ...

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

    `start(key, request, max_new_tokens, sampler)` enqueues a GenerationRequest under a hashable
    key (the engine admits it when it has room, up to `num_slots` at once); `sampler` is the
    scheduler's glm53.engine.sampling.StreamSampler for it (its penalties, logit bias, grammar
    and logprobs; an engine that samples otherwise must give the same result); `cancel(key)`
    drops it wherever it is; `iterate()` runs one step of everything admitted and returns a
    JobOutput per job that produced something. A job that finished or failed is forgotten by the
    engine; an exception out of `iterate` fails every job."""

    name: str
    description: str
    is_model: bool
    drives_jobs: bool  # True: a job engine
    verify_tiers: Callable[[int], Any] | None  # as for Engine
    fast: Any | None  # as for Engine
    tokenizer: Tokenizer
    context_length: int
    num_slots: int
    generation_defaults: dict[str, float]

    def load(self) -> None: ...

    def start(self, key: Any, request: Any, max_new_tokens: int, sampler: Any) -> None: ...

    def cancel(self, key: Any) -> None: ...

    def iterate(self) -> list[JobOutput]: ...

    def save_heat(self) -> str | None: ...  # as for Engine

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
