"""The CPU engine (the embedded default without a GPU): transformers' glm5_next text model on the
CPU in fp32, with every non-expert EXL3 linear decoded once to a dense weight, and its MoE blocks
replaced by glm53's tiered MoE (RAM tier + O_DIRECT reads + CLOCK + CPU lane).
Implements glm53.engine.base.Engine.

Each slot owns one transformers cache (its DSA latents, indexer keys, KDA conv and recurrent
state, and the DSA keys/values already expanded from the latents, see glm53.models.hf_expand).
A step runs its items one after the other.

KDA prefill runs transformers' chunked torch path (its `chunk_size` argument) with chunks of
KDA_CHUNK tokens instead of its default 64: the intra-chunk decay tensor grows with the chunk,
and on the CPU 16 is about 3.5x faster for a 512-token prompt. It is no less accurate: against
the token-by-token recurrence in fp64 on the demo's 512-token bench prompt, the fp32 logits of
chunk 16 are within 2.5e-6 of the largest logit, chunk 64's within 4.4e-6.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from glm53.config import ConfigurationError
from glm53.engine.base import EngineError, EngineUnavailable, StreamWork
from glm53.tiers import ram_budget

KDA_CHUNK = 16
# Records the tier check reads at start: 0.6 GB at the full model's 9.4 MB record (0.3 s from a
# 2 GB/s disk), a fraction of the load.
STARTUP_CHECK_SAMPLES = 64

log = logging.getLogger("glm53.engine.cpu")


class CpuEngine:
    name = "cpu"
    is_model = True

    def __init__(
        self,
        checkpoint_dir: str | Path,
        *,
        context: int = 131072,
        max_batch: int = 4,
        ram_cap: int | None = None,
        cpus: str | None = None,
        cpu_threads: int | None = None,
        torch_threads: int | None = None,
        store: str | Path | None = None,
        kda_chunk: int = KDA_CHUNK,
    ):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.requested_context = context
        self.num_slots = max_batch
        self.ram_cap = ram_cap
        self.cpus, self.cpu_threads, self.torch_threads = cpus, cpu_threads, torch_threads
        self.store = store
        self.kda_chunk = kda_chunk
        self.description = (
            f"CPU engine (transformers glm5_next + tiered experts) on {checkpoint_dir}"
        )
        self.context_length = context
        self.generation_defaults: dict[str, float] = {}
        self.model = None
        self.tier = None
        self.tier_check = None  # the latest glm53.tiers.check.TierCheck
        # The tiers belong to the engine thread; GET /admin/verify checks them from a worker
        # thread, between two steps, under this lock.
        self._tier_lock = threading.Lock()
        # slot -> (start_pos, token ids, logits row) of work that ran in a step that failed for
        # other slots (_step)
        self._kept: dict[int, tuple[int, list[int], torch.Tensor]] = {}
        self._stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "step_s": 0.0}

    def load(self) -> None:
        from glm53.engine.tokenizer import CheckpointTokenizer, read_generation_defaults
        from glm53.models.checkpoint import Checkpoint
        from glm53.models.hf_expand import memoize_expansion
        from glm53.models.hf_text import build_text_model, lm_head_weight
        from glm53.tiers.cpu_lane import CpuLane, lane_layout
        from glm53.tiers.expert_source import SafetensorsSource
        from glm53.tiers.moe import TieredMoE
        from glm53.tiers.ram_tier import RamTier

        ckpt = Checkpoint(self.checkpoint_dir)
        self.tokenizer = CheckpointTokenizer.from_dir(self.checkpoint_dir)
        self.generation_defaults = read_generation_defaults(self.checkpoint_dir)
        limit = int(ckpt.text_config.get("max_position_embeddings", self.requested_context))
        self.context_length = min(self.requested_context, limit)
        if self.store is not None:
            from glm53.store.reader import ExpertStore

            source = ExpertStore(self.store, ckpt)  # refuses a store of another checkpoint
        else:
            source = SafetensorsSource(ckpt)
        top_k = int(ckpt.text_config["num_experts_per_tok"])
        working_set = ram_budget.working_set_records(top_k, self.num_slots, source.num_experts)
        try:
            if self.ram_cap is not None:  # before anything loads
                ram_budget.check_cap(
                    self.ram_cap, source.record_bytes, working_set, top_k, self.num_slots
                )
        except ram_budget.RamCapError as exc:
            source.close()
            raise ConfigurationError(str(exc)) from None
        self.lane = CpuLane(lane_layout(self.cpus, self.cpu_threads))
        # torch gets the CPUs the lane leaves: decode-sized ops gain nothing from more threads,
        # and threads that spin on the lane's core slow both (2-core host: 1 torch thread)
        free_cpus = len(os.sched_getaffinity(0)) - self.lane.layout.threads
        torch.set_num_threads(self.torch_threads or max(1, free_cpus))
        act_limit = float(ckpt.text_config.get("swiglu_limit", 0.0))

        def tiered(layer: int, block: torch.nn.Module) -> TieredMoE:
            return TieredMoE(layer, block, None, self.lane, act_limit)

        self.model = build_text_model(ckpt, moe_factory=tiered)
        memoize_expansion(self.model)
        self.lm_head = lm_head_weight(ckpt)
        self.moe = {i: self.model.layers[i].mlp for i in ckpt.moe_layers}
        # The tier is sized after the non-expert weights are in memory (ram_budget)
        cap = self.ram_cap
        if cap is None:
            memory = ram_budget.host_memory()
            num_records = len(source.moe_layers) * source.num_experts
            cap = ram_budget.planned_cap_bytes(memory, source.record_bytes, num_records)
            log.info(
                "RAM tier cap planned from %s: %.1f MiB (%d of %d expert records)",
                memory.describe(),
                cap / 2**20,
                cap // source.record_bytes,
                num_records,
            )
            try:
                ram_budget.check_cap(
                    cap, source.record_bytes, working_set, top_k, self.num_slots, memory.describe()
                )
            except ram_budget.RamCapError as exc:
                source.close()
                raise ConfigurationError(str(exc)) from None
        self.tier = RamTier(source, cap)
        for moe in self.moe.values():
            moe.tier = self.tier
        self.caches: list = [None] * self.num_slots
        self._startup_check()
        self.description = (
            f"CPU engine (transformers glm5_next + tiered experts) on {self.checkpoint_dir}; "
            f"{self.tier.describe()}; {self.lane.describe()}"
        )

    def _startup_check(self) -> None:
        """Refuse to serve when the tiers do not hold what the store holds (glm53.tiers.check)."""
        result = self.verify_tiers(STARTUP_CHECK_SAMPLES)
        (log.info if result.is_ok else log.error)("tier check at start: %s", result.summary())
        if not result.is_ok:
            self.close()
            fix = (
                f"check the store with `glm53 store verify --store {self.store}` and repack it"
                if self.store is not None
                else f"check the checkpoint's files in {self.checkpoint_dir}"
            )
            raise EngineUnavailable(
                f"the tier check at start failed, so glm53 does not serve: {result.summary()}; "
                f"{fix}"
            )

    def verify_tiers(self, num_samples: int):
        """Run the tier check (glm53.tiers.check) on `num_samples` sampled records, between two
        steps; returns the TierCheck and keeps it for stats()."""
        from glm53.tiers.check import check_tiers

        with self._tier_lock:
            self.tier_check = check_tiers(self.tier, num_samples)
        return self.tier_check

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], cache) -> torch.Tensor:
        """Run tokens through the model with `cache`; float32 logits of the last position."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        hidden = self.model(
            input_ids=ids, cache=cache, use_cache=True, chunk_size=self.kda_chunk
        ).last_hidden_state
        return hidden[0, -1].float() @ self.lm_head.T

    @torch.inference_mode()
    def forward_all(self, token_ids: Sequence[int], cache=None) -> torch.Tensor:
        """float32 logits of every position [len(token_ids), vocab] (for tests and calibration)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        hidden = self.model(
            input_ids=ids, cache=cache, use_cache=cache is not None, chunk_size=self.kda_chunk
        ).last_hidden_state
        return hidden[0].float() @ self.lm_head.T

    def step(self, work: Sequence[StreamWork]) -> torch.Tensor:
        with self._tier_lock:
            return self._step(work)

    def _step(self, work: Sequence[StreamWork]) -> torch.Tensor:
        """Run the items one after the other. An item that fails (a bad position, a store read
        fault) does not stop the others: the step raises EngineError naming the failed slots
        after running the rest, and keeps the others' results, because the scheduler runs their
        work again next step and their caches already hold it (see _run)."""
        start = time.perf_counter()
        rows, failed, kept = [], {}, {}
        for w in work:
            try:
                row = self._run(w)
            except EngineError as exc:
                failed[w.slot] = str(exc)
                continue
            kept[w.slot] = (w.start_pos, list(w.token_ids), row)
            if w.want_logits:
                rows.append(row)
        self._stats["steps"] += 1
        self._stats["step_s"] += time.perf_counter() - start
        if failed:
            self._kept.update(kept)
            raise EngineError("; ".join(failed.values()), list(failed))
        if not rows:
            return torch.empty(0, self.lm_head.shape[0])
        return torch.stack(rows)

    def _run(self, w: StreamWork) -> torch.Tensor:
        """One item's logits row. Work that a failed step already ran for this slot (the same
        start and the same tokens, or a prefix of them) is answered from what that step kept
        and only the rest is run."""
        if not 0 <= w.slot < self.num_slots:
            raise EngineError(f"slot {w.slot} is outside 0..{self.num_slots - 1}", [w.slot])
        tokens, start_pos = list(w.token_ids), w.start_pos
        kept = self._kept.pop(w.slot, None)
        if kept is not None and kept[0] == start_pos and tokens[: len(kept[1])] == kept[1]:
            if len(kept[1]) == len(tokens):
                return kept[2]
            tokens, start_pos = tokens[len(kept[1]) :], start_pos + len(kept[1])
        elif start_pos == 0:
            self.caches[w.slot] = self.new_cache()
        cache = self.caches[w.slot]
        seen = cache.get_seq_length() if cache is not None else -1
        if cache is None or seen != start_pos:
            raise EngineError(
                f"slot {w.slot}: work starts at position {w.start_pos} but the slot holds "
                f"{max(seen, 0)} tokens",
                [w.slot],
            )
        if start_pos + len(tokens) > self.context_length:
            raise EngineError(
                f"slot {w.slot}: {start_pos + len(tokens)} tokens exceed the context "
                f"length {self.context_length}",
                [w.slot],
            )
        try:
            row = self.forward(tokens, cache)
        except Exception as exc:
            raise EngineError(f"slot {w.slot}: forward failed: {exc}", [w.slot]) from exc
        key = "decode_tokens" if start_pos > 0 and len(tokens) == 1 else "prefill_tokens"
        self._stats[key] += len(tokens)
        return row

    def release(self, slot: int) -> None:
        self.caches[slot] = None
        self._kept.pop(slot, None)

    def stats(self) -> dict[str, Any]:
        if self.model is None:
            return dict(self._stats)
        layers = {str(i): m.counters.as_dict() for i, m in self.moe.items()}
        hits = sum(c["hits"] for c in layers.values())
        misses = sum(c["misses"] for c in layers.values())
        return {
            **self._stats,
            "tiers": {
                "ram": {
                    "slots": self.tier.num_slots,
                    "cap_bytes": self.tier.ram_cap_bytes,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    **self.tier.counters(),
                    **self.tier.faults,
                },
                "layers": layers,
                "check": self._check_stats(),
            },
        }

    def _check_stats(self) -> dict[str, int]:
        c = self.tier_check
        if c is None:
            return {}
        return {**c.counts(), "ram_checked": c.ram_checked, "table_checked": c.table_checked}

    def reset_counters(self) -> None:
        from glm53.tiers.moe import LayerCounters

        for m in self.moe.values():
            m.counters = LayerCounters()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        self.model = None


def create(settings, checkpoint_dir: Path) -> CpuEngine:
    """The CPU engine for these Settings (not loaded). Routed experts come from --store when
    given, else straight from the checkpoint's safetensors shards."""
    return CpuEngine(
        checkpoint_dir,
        context=settings.context,
        max_batch=settings.max_batch,
        ram_cap=settings.ram_cap,
        cpus=settings.cpus,
        cpu_threads=settings.cpu_threads,
        store=settings.store,
    )
