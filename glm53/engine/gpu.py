"""The GPU engine: exllamav3 1.6.5 (unedited) runs the model; in exact mode its routed
experts live in pinned host memory behind the device-side VRAM expert cache
(glm53/tiers/exl3_hooks.py). Implements glm53.engine.base.Engine.

Each slot owns a fixed run of KV pages and one recurrent (KDA) state; a step runs every
prefill item on its own and all single-token decode items as one batch.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from glm53.engine.base import EngineError, StreamWork

PAGE = 256  # exllamav3's KV page size


class GpuEngine:
    name = "gpu"
    is_model = True

    def __init__(
        self,
        model_dir: str,
        mode: str = "exact",
        context: int = 8192,
        max_batch: int = 4,
        chunk_size: int = 2048,
        ec_max_slots: int | None = None,
        ec_reserve_gb: float = 1.0,
        ec_stage_gb: float | None = None,
        ec_freq_window: int | None = None,
        device: str = "cuda:0",
        allow_unsupported: bool = False,
        heat_file: str | None = None,
    ):
        if mode not in ("exact", "stock", "zerocopy"):
            raise ValueError(
                f"the GPU engine runs mode 'exact' (or the reference modes 'stock' and "
                f"'zerocopy'); mode {mode!r} needs the CPU lane or the NVMe store, which the GPU "
                "engine does not drive yet"
            )
        self.model_dir, self.mode, self.device = model_dir, mode, device
        self.context_length, self.num_slots, self.chunk_size = context, max_batch, chunk_size
        self.ec_max_slots, self.ec_reserve_gb = ec_max_slots, ec_reserve_gb
        self.ec_stage_gb, self.ec_freq_window = ec_stage_gb, ec_freq_window
        self.allow_unsupported = allow_unsupported
        self.heat_file = heat_file
        self.description = f"GPU engine (exllamav3 1.6.5, mode {mode}) on {model_dir}"
        self.generation_defaults: dict[str, float] = {}
        self.loaded = None
        self._lock = threading.Lock()
        self._stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "step_s": 0.0}

    def load(self) -> None:
        import torch

        from glm53.engine import exl3_load
        from glm53.engine.tokenizer import CheckpointTokenizer, read_generation_defaults

        pages = -(-self.context_length // PAGE)
        self.tokenizer = CheckpointTokenizer.from_dir(self.model_dir)
        self.generation_defaults = read_generation_defaults(self.model_dir)
        self.loaded = exl3_load.load(
            self.model_dir,
            self.mode,
            device=self.device,
            cache_tokens=self.num_slots * pages * PAGE,
            max_batch=self.num_slots,
            max_chunk=self.chunk_size,
            ec_max_slots=self.ec_max_slots,
            ec_reserve_gb=self.ec_reserve_gb,
            ec_stage_gb=self.ec_stage_gb,
            ec_freq_window=self.ec_freq_window,
            allow_unsupported=self.allow_unsupported,
        )
        self.block_table = torch.arange(self.num_slots * pages, dtype=torch.int32).view(
            self.num_slots, pages
        )
        self.states: list = [None] * self.num_slots
        self._arenas: dict = {}
        self.heat_file = self.heat_file or exl3_load.heat_path(self.model_dir)
        if self.loaded.ec is not None and os.path.isfile(self.heat_file):
            with open(self.heat_file) as f:
                self.loaded.ec.seed(json.load(f)["keys"])

    def _state(self, slot: int, fresh: bool):
        if fresh and self.states[slot] is not None:
            self.states[slot].free()
            self.states[slot] = None
        if self.states[slot] is None:
            self.states[slot] = self.loaded.cache.get_new_state()
        return self.states[slot]

    def _params(self, slots, starts, states):
        """Forward params whose block table and seqlens live in a pinned host arena and a
        device arena that keep their identity for a given row count, seeded into exllamav3's
        per-forward device cache: its captured CUDA graphs bake those device addresses, so
        they must not move from step to step (exllamav3's Generator does the same)."""
        import torch

        rows, width = len(slots), self.block_table.shape[1]
        arena = self._arenas.get(rows)
        if arena is None:
            host = torch.zeros(rows * width + rows, dtype=torch.int32, pin_memory=True)
            dev = torch.empty_like(host, device=self.device)
            views = (host[: rows * width].view(rows, width), host[rows * width :])
            dviews = (dev[: rows * width].view(rows, width), dev[rows * width :])
            arena = self._arenas[rows] = (host, dev, views, dviews)
        host, dev, (bt, sl), (dbt, dsl) = arena
        bt.copy_(self.block_table[list(slots)])
        sl.copy_(torch.tensor(starts, dtype=torch.int32))
        dev.copy_(host, non_blocking=True)
        device = torch.device(self.device)
        return {
            "attn_mode": "flash_attn",
            "block_table": bt,
            "cache": self.loaded.cache,
            "cache_seqlens": sl,
            "recurrent_states": states,
            "dev_cache": {(id(bt), device): (bt, dbt), (id(sl), device): (sl, dsl)},
        }

    def step(self, work: Sequence[StreamWork]):
        import torch

        t0 = time.perf_counter()
        out: dict[int, torch.Tensor] = {}
        decode = [(i, w) for i, w in enumerate(work) if len(w.token_ids) == 1 and w.start_pos > 0]
        decode_idx = {i for i, _ in decode}
        with torch.inference_mode():
            for i, w in enumerate(work):
                if i in decode_idx:
                    continue
                self._check(w)
                if w.all_logits:
                    raise EngineError(
                        "prompt logprobs (echo with logprobs, logprob_start_len) are not in "
                        "the GPU engine's step path; they come with its Generator loop",
                        [w.slot],
                    )
                try:
                    state = self._state(w.slot, w.start_pos == 0)
                    # like exllamav3's Generator: a prompt's last token runs as a one-row
                    # decode forward, so its K/V and state come from the decode kernels
                    body = w.token_ids[:-1] if w.want_logits else w.token_ids
                    if body:
                        ids = torch.tensor([body], dtype=torch.long)
                        self.loaded.model.prefill(
                            ids, self._params([w.slot], [w.start_pos], [state])
                        )
                    if w.want_logits:
                        ids = torch.tensor([w.token_ids[-1:]], dtype=torch.long)
                        pos = w.start_pos + len(body)
                        params = self._params([w.slot], [pos], [state])
                        out[i] = self.loaded.model.forward(ids, params)[0, -1].float()
                except Exception as exc:
                    raise EngineError(f"prefill of slot {w.slot} failed: {exc}", [w.slot]) from exc
                self._stats["prefill_tokens"] += len(w.token_ids)
            if decode:
                for _, w in decode:
                    self._check(w)
                slots = [w.slot for _, w in decode]
                try:
                    states = [self._state(s, False) for s in slots]
                    ids = torch.tensor([w.token_ids for _, w in decode], dtype=torch.long)
                    params = self._params(slots, [w.start_pos for _, w in decode], states)
                    logits = self.loaded.model.forward(ids, params)[:, -1].float()
                except Exception as exc:
                    raise EngineError(f"decode of slots {slots} failed: {exc}", slots) from exc
                for row, (i, _) in enumerate(decode):
                    out[i] = logits[row]
                self._stats["decode_tokens"] += len(decode)
        wanted = [out[i] for i, w in enumerate(work) if w.want_logits]
        self._stats["steps"] += 1
        self._stats["step_s"] += time.perf_counter() - t0
        if not wanted:
            return torch.empty((0, self.tokenizer.vocab_size), dtype=torch.float32)
        return torch.stack(wanted).cpu()

    def _check(self, w: StreamWork) -> None:
        if not 0 <= w.slot < self.num_slots:
            raise EngineError(f"slot {w.slot} is outside [0, {self.num_slots})", [w.slot])
        if w.start_pos + len(w.token_ids) > self.context_length:
            raise EngineError(
                f"slot {w.slot}: position {w.start_pos + len(w.token_ids)} exceeds the context "
                f"of {self.context_length} tokens (--context)",
                [w.slot],
            )

    def release(self, slot: int) -> None:
        if self.states[slot] is not None:
            self.states[slot].free()
            self.states[slot] = None

    def stats(self) -> dict[str, Any]:
        out = dict(self._stats)
        if self.loaded is not None and self.loaded.ec is not None:
            with self._lock:
                out["tiers"] = {"vram_cache": self.loaded.ec.state()}
        return out

    def save_heat(self) -> str | None:
        """Write the cache's keys, hottest first, as the warm-start heat list."""
        if self.loaded is None or self.loaded.ec is None:
            return None
        keys = self.loaded.ec.heat_list()
        os.makedirs(os.path.dirname(self.heat_file), exist_ok=True)
        tmp = self.heat_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": os.path.realpath(self.model_dir), "keys": keys}, f)
        os.replace(tmp, self.heat_file)
        return self.heat_file

    def close(self) -> None:
        if self.loaded is None:
            return
        self.save_heat()
        for slot in range(self.num_slots):
            self.release(slot)
        self.loaded.close()
        self.loaded = None


def create(settings, checkpoint_dir) -> GpuEngine:
    """The GPU engine for these Settings (not loaded)."""
    from glm53.config import ConfigurationError

    mode = "exact" if settings.mode in ("auto", "exact") else settings.mode
    if mode != "exact":
        raise ConfigurationError(
            f"--mode {settings.mode}: this build's GPU engine serves exact mode only (VRAM cache + "
            "pinned RAM, bit-identical to stock exllamav3); fast and nvme modes need the CPU lane "
            "and the store wired into the GPU engine, which has not landed. Use --mode exact."
        )
    if settings.store:
        raise ConfigurationError(
            f"--store {settings.store}: exact mode keeps every routed expert in pinned RAM and "
            "does not read a store; leave --store out"
        )
    return GpuEngine(
        str(checkpoint_dir),
        mode,
        context=settings.context,
        max_batch=settings.max_batch,
        chunk_size=settings.chunk_size,
        ec_max_slots=settings.ec_max_slots,
        ec_reserve_gb=settings.ec_reserve_gb,
        ec_stage_gb=settings.ec_stage_gb,
        ec_freq_window=settings.ec_freq_window,
    )
