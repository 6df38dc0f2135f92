"""The scripted engine: replays replies from a script file as tokens. It is NOT a model: it
exists so that tests and bench/server_overhead.py can drive the whole server (scheduler, parser,
HTTP) with exact, known output. It says so in its name, its description and /server_info.

Script (JSON):
    {"step_ms": 0, "prefill_us_per_token": 0,
     "replies": [{"when": "weather", "text": "<think>..</think><tool_call>..", "repeat": 1,
                  "fail_after": null, "step_ms": null}],
     "default": "Hello."}
For each stream the first reply whose `when` occurs in the decoded prompt is chosen (else
`default`); its text, repeated `repeat` times, is emitted token by token, then an eos token.
`step_ms` is the wall time of one step (simulated compute, the largest of the step's streams);
`fail_after` N makes the stream's step fail (EngineError for that slot) after N tokens.
The logits put 0 on the scripted token and -inf on every other; a prompt position asked for
with `all_logits` gets a row of zeros (every token equally likely: logprob -log(vocab_size)).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from glm53.engine.base import EngineError, StreamUsage, StreamWork
from glm53.engine.tokenizer import CheckpointTokenizer, read_generation_defaults


class Reply(msgspec.Struct, forbid_unknown_fields=True):
    text: str
    when: str = ""
    repeat: Annotated[int, msgspec.Meta(ge=1)] = 1
    fail_after: Annotated[int, msgspec.Meta(ge=0)] | None = None
    step_ms: Annotated[float, msgspec.Meta(ge=0)] | None = None


class Script(msgspec.Struct, forbid_unknown_fields=True):
    default: str = ""
    replies: list[Reply] = []
    step_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    prefill_us_per_token: Annotated[float, msgspec.Meta(ge=0)] = 0.0


def read_script(path: str | Path) -> Script:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Script)
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"cannot use script {path}: {exc}") from exc


class _SlotState:
    __slots__ = ("fail_after", "num_emitted", "prompt_ids", "step_ms", "tokens", "usage")

    def __init__(self):
        self.usage = StreamUsage()  # no tiers here: only the scheduler's seconds get filled
        self.prompt_ids: list[int] = []
        self.tokens: list[int] | None = None
        self.num_emitted = 0
        self.fail_after: int | None = None
        self.step_ms = 0.0


class ScriptedEngine:
    """An Engine (see glm53.engine.base) that replays a Script with a checkpoint's tokenizer."""

    name = "scripted"
    is_model = False
    drives_jobs = False  # a step engine: the scheduler plans its steps and samples
    verify_tiers = None  # no expert tiers to check
    fast = None  # no CPU lane

    def __init__(
        self, checkpoint_dir: str | Path, script: Script, *, context_length: int, num_slots: int
    ):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.script = script
        self.context_length = context_length
        self.num_slots = num_slots
        self.description = (
            f"scripted engine (replays {len(script.replies)} scripted replies; not a model) "
            f"with the tokenizer of {self.checkpoint_dir}"
        )
        self.generation_defaults: dict[str, float] = {}
        self._slots: list[_SlotState] = []
        self._logits: np.ndarray | None = None
        self._targets: list[tuple[int, int]] = []
        self._counters = {"steps": 0, "tokens_emitted": 0, "prompt_tokens": 0, "busy_seconds": 0.0}

    def load(self) -> None:
        self.tokenizer = CheckpointTokenizer.from_dir(self.checkpoint_dir)
        self.generation_defaults = read_generation_defaults(self.checkpoint_dir)
        self._eos = self.tokenizer.eos_token_ids[0]
        self._slots = [_SlotState() for _ in range(self.num_slots)]
        self._replies = [(r, self.tokenizer.encode(r.text) * r.repeat) for r in self.script.replies]
        self._default = self.tokenizer.encode(self.script.default)
        self._logits = np.full(
            (self.num_slots, self.tokenizer.vocab_size), -np.inf, dtype=np.float32
        )

    def _reply_for(self, prompt_ids: list[int]) -> tuple[list[int], int | None, float]:
        prompt = self.tokenizer.decode(prompt_ids)
        for reply, tokens in self._replies:
            if reply.when in prompt:
                step_ms = self.script.step_ms if reply.step_ms is None else reply.step_ms
                return tokens, reply.fail_after, step_ms
        return self._default, None, self.script.step_ms

    def _fails(self, w: StreamWork) -> bool:
        state = self._slots[w.slot]
        if not w.want_logits:
            return False
        if w.start_pos == 0 or state.tokens is None:
            prompt = w.token_ids if w.start_pos == 0 else state.prompt_ids + w.token_ids
            _, fail_after, _ = self._reply_for(prompt)
            return fail_after == 0
        return state.fail_after is not None and state.num_emitted >= state.fail_after

    def step(self, work: Sequence[StreamWork]) -> np.ndarray:
        start = time.perf_counter()
        try:
            return self._step(work)
        finally:
            self._counters["busy_seconds"] += time.perf_counter() - start

    def _step(self, work: Sequence[StreamWork]) -> np.ndarray:
        for row, column in self._targets:  # undo the previous step's rows
            self._logits[row, column] = -np.inf
        self._targets = []
        # fail before touching any stream, so the other streams can run again unchanged
        failed = [w.slot for w in work if self._fails(w)]
        if failed:
            raise EngineError(f"scripted failure in slots {failed}", failed)
        step_ms, prefill_tokens = 0.0, 0
        for w in work:
            state = self._slots[w.slot]
            if w.start_pos == 0:
                self._slots[w.slot] = state = _SlotState()
            if state.tokens is None:
                state.prompt_ids.extend(w.token_ids)
                prefill_tokens += len(w.token_ids)
            if w.want_logits:
                if state.tokens is None:
                    state.tokens, state.fail_after, state.step_ms = self._reply_for(
                        state.prompt_ids
                    )
                column = (
                    state.tokens[state.num_emitted]
                    if state.num_emitted < len(state.tokens)
                    else self._eos
                )
                state.num_emitted += 1
                self._targets.append((len(self._targets), column))
            step_ms = max(step_ms, state.step_ms)
        for row, column in self._targets:
            self._logits[row, column] = 0.0
        if any(w.all_logits for w in work):
            logits = self._with_prompt_rows(work)
        else:
            logits = self._logits[: len(self._targets)]
        pause_s = step_ms / 1e3 + prefill_tokens * self.script.prefill_us_per_token / 1e6
        if pause_s > 0:
            time.sleep(pause_s)
        self._counters["steps"] += 1
        self._counters["tokens_emitted"] += len(self._targets)
        self._counters["prompt_tokens"] += prefill_tokens
        return logits

    def _with_prompt_rows(self, work: Sequence[StreamWork]) -> np.ndarray:
        """The step's rows when some item wants all positions: zeros for its prompt positions,
        its scripted row (if any) in its last position's place."""
        blocks, target = [], 0
        for w in work:
            if w.all_logits:
                block = np.zeros((len(w.token_ids), self.tokenizer.vocab_size), np.float32)
                if w.want_logits:
                    block[-1] = self._logits[target]
                blocks.append(block)
            elif w.want_logits:
                blocks.append(self._logits[target : target + 1])
            target += int(w.want_logits)
        return np.concatenate(blocks) if blocks else self._logits[:0]

    def release(self, slot: int) -> None:
        self._slots[slot] = _SlotState()

    def stream_usage(self, slot: int) -> StreamUsage:
        return self._slots[slot].usage

    def save_heat(self) -> None:
        """No expert cache, so no heat list."""
        return None

    def stats(self) -> dict:
        return {"engine": self.name, "is_model": False, **self._counters}

    def close(self) -> None:
        self._logits = None
