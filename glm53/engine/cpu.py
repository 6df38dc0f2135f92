"""The CPU engine (the embedded default without a GPU): transformers' glm5_next text model on the
CPU in fp32, with every non-expert EXL3 linear decoded once to a dense weight, and its MoE blocks
replaced by glm53's tiered MoE (RAM tier + O_DIRECT reads + CLOCK + CPU lane).
Implements glm53.engine.base.Engine. Its settings come in one CpuEngineOptions, validated when
it is built (glm53.engine.cpu_options).

Each slot owns one transformers cache (its DSA latents, indexer keys, KDA conv and recurrent
state, and the DSA keys/values already expanded from the latents, see glm53.models.hf_expand).
A step runs its items one after the other, so a stream's output never depends on the others.

Prefix snapshots (glm53.engine.base.PrefixSnapshots): `snapshot` deep-copies a slot's cache,
the expanded-KV memo trimmed to its filled positions; `restore` deep-copies it back, so the
stored snapshot is never written by later steps. Kept with the memo, a restored stream expands
only its new positions, exactly as the cold stream does at that point.

KDA prefill runs transformers' chunked torch path (its `chunk_size` argument) with chunks of
KDA_CHUNK tokens (glm53.engine.cpu_options) instead of its default 64: the intra-chunk decay
tensor grows with the chunk, and on the CPU 16 is about 3.5x faster for a 512-token prompt. It
is no less accurate: against the token-by-token recurrence in fp64 on the demo's 512-token bench
prompt, the fp32 logits of chunk 16 are within 2.5e-6 of the largest logit, chunk 64's within
4.4e-6.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from glm53.config import ConfigurationError
from glm53.engine.base import EngineError, EngineUnavailable, StreamUsage, StreamWork
from glm53.engine.cpu_options import CpuEngineOptions, engine_options
from glm53.plan.host_memory import host_memory
from glm53.plan.ram_cap import RamCapError, check_cap, planned_cap_bytes, working_set_records
from glm53.tiers.heat import read_heat, write_heat

# Records the tier check reads at start: 0.6 GB at the full model's 9.4 MB record (0.3 s from a
# 2 GB/s disk), a fraction of the load.
STARTUP_CHECK_SAMPLES = 64

log = logging.getLogger("glm53.engine.cpu")


class CpuEngine:
    name = "cpu"
    is_model = True
    drives_jobs = False  # a step engine: the scheduler plans its steps and samples
    fast = None  # no fast-mode lane: the CPU lane shares the host with torch, nothing is pinned

    def __init__(self, checkpoint_dir: str | Path, options: CpuEngineOptions | None = None):
        """`options` (glm53.engine.cpu_options.CpuEngineOptions) were checked when they were
        built; None: every default."""
        self.checkpoint_dir = Path(checkpoint_dir)
        self.options = options = options if options is not None else CpuEngineOptions()
        self.num_slots = options.max_batch
        self.heat_file = options.heat_file  # None after a failed tier check: keep no list
        self.warm_start: dict = {}
        self.description = (
            f"CPU engine (transformers glm5_next + tiered experts) on {checkpoint_dir}"
        )
        self.context_length = options.context
        self.generation_defaults: dict[str, float] = {}
        self.model = None
        self.count_streams = True  # per-stream tier counts (bench/cpu_engine.py turns it off)
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
        from glm53.tiers.cpu_lane import CpuLane
        from glm53.tiers.expert_source import SafetensorsSource
        from glm53.tiers.moe import TallyTarget, TieredMoE
        from glm53.tiers.ram_tier import RamTier

        ckpt = Checkpoint(self.checkpoint_dir)
        self.tokenizer = CheckpointTokenizer.from_dir(self.checkpoint_dir)
        self.generation_defaults = read_generation_defaults(self.checkpoint_dir)
        opts = self.options
        limit = int(ckpt.text_config.get("max_position_embeddings", opts.context))
        self.context_length = min(opts.context, limit)
        if opts.store is not None:
            from glm53.store.reader import ExpertStore

            source = ExpertStore(opts.store, ckpt)  # refuses a store of another checkpoint
        else:
            source = SafetensorsSource(ckpt)
        top_k = int(ckpt.text_config["num_experts_per_tok"])
        working_set = working_set_records(top_k, self.num_slots, source.num_experts)
        try:
            if opts.ram_cap is not None:  # before anything loads
                check_cap(opts.ram_cap, source.record_bytes, working_set, top_k, self.num_slots)
        except RamCapError as exc:
            source.close()
            raise ConfigurationError(str(exc)) from None
        self.lane = CpuLane(opts.lane, precision=opts.lane_precision)
        # torch gets the CPUs the lane leaves: decode-sized ops gain nothing from more threads,
        # and threads that spin on the lane's core slow both (2-core host: 1 torch thread)
        free_cpus = len(os.sched_getaffinity(0)) - self.lane.layout.threads
        torch.set_num_threads(opts.torch_threads or max(1, free_cpus))
        act_limit = float(ckpt.text_config.get("swiglu_limit", 0.0))

        self.tally_target = TallyTarget()

        def tiered(layer: int, block: torch.nn.Module) -> TieredMoE:
            return TieredMoE(layer, block, None, self.lane, act_limit, self.tally_target)

        self.model = build_text_model(ckpt, moe_factory=tiered)
        memoize_expansion(self.model)
        self.lm_head = lm_head_weight(ckpt)
        self.moe = {i: self.model.layers[i].mlp for i in ckpt.moe_layers}
        # The tier is sized after the non-expert weights are in memory (glm53.plan.ram_cap)
        cap = opts.ram_cap
        if cap is None:
            memory = host_memory()
            num_records = len(source.moe_layers) * source.num_experts
            cap = planned_cap_bytes(memory, source.record_bytes, num_records)
            log.info(
                "RAM tier cap planned from %s: %.1f MiB (%d of %d expert records)",
                memory.describe(),
                cap / 2**20,
                cap // source.record_bytes,
                num_records,
            )
            try:
                check_cap(
                    cap, source.record_bytes, working_set, top_k, self.num_slots, memory.describe()
                )
            except RamCapError as exc:
                source.close()
                raise ConfigurationError(str(exc)) from None
        self.tier = RamTier(source, cap, opts.read_timeout_s)
        for moe in self.moe.values():
            moe.tier = self.tier
        if self.heat_file is not None:
            keys = read_heat(self.heat_file, self.tier.num_keys)
            if keys:
                self.warm_start = self.tier.seed(keys)
                w = self.warm_start
                (log.info if not w["error"] else log.error)(
                    "RAM tier warm start from %s: %d of %d experts (%.1f MiB) in %.1f s%s",
                    self.heat_file, w["seeded"], w["wanted"], w["bytes_read"] / 2**20,
                    w["seconds"], f"; stopped: {w['error']}" if w["error"] else "",
                )  # fmt: skip
        self.caches: list = [None] * self.num_slots
        self.usage = [StreamUsage() for _ in range(self.num_slots)]
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
            self.heat_file = None  # a tier that failed its check leaves no heat list behind
            self.close()
            store = self.options.store
            fix = (
                f"check the store with `glm53 store verify --store {store}` and repack it"
                if store is not None
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
    def forward(
        self, token_ids: Sequence[int], cache, *, all_positions: bool = False
    ) -> torch.Tensor:
        """Run tokens through the model with `cache`; float32 logits of the last position
        [vocab], or of every position [len(token_ids), vocab] with `all_positions`."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        hidden = self.model(
            input_ids=ids, cache=cache, use_cache=True, chunk_size=self.options.kda_chunk
        ).last_hidden_state
        if all_positions:
            return hidden[0].float() @ self.lm_head.T
        return hidden[0, -1].float() @ self.lm_head.T

    @torch.inference_mode()
    def forward_all(self, token_ids: Sequence[int], cache=None) -> torch.Tensor:
        """float32 logits of every position [len(token_ids), vocab] (for tests and calibration)."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        hidden = self.model(
            input_ids=ids,
            cache=cache,
            use_cache=cache is not None,
            chunk_size=self.options.kda_chunk,
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
            if w.all_logits:
                rows.extend(row)
            elif w.want_logits:
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
        """One item's logits row (every position's rows with `all_logits`). Work that a failed
        step already ran for this slot (the same start and the same tokens, or a prefix of them)
        is answered from what that step kept and only the rest is run."""
        if not 0 <= w.slot < self.num_slots:
            raise EngineError(f"slot {w.slot} is outside 0..{self.num_slots - 1}", [w.slot])
        tokens, start_pos = list(w.token_ids), w.start_pos
        kept = self._kept.pop(w.slot, None)
        done_rows = None
        if kept is not None and kept[0] == start_pos and tokens[: len(kept[1])] == kept[1]:
            if len(kept[1]) == len(tokens):
                return kept[2]
            done_rows = kept[2]
            tokens, start_pos = tokens[len(kept[1]) :], start_pos + len(kept[1])
        elif start_pos == 0:
            self.caches[w.slot] = self.new_cache()
            self.usage[w.slot] = StreamUsage()
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
        self.tally_target.tally = self.usage[w.slot] if self.count_streams else None
        try:
            row = self.forward(tokens, cache, all_positions=w.all_logits)
        except Exception as exc:
            raise EngineError(f"slot {w.slot}: forward failed: {exc}", [w.slot]) from exc
        finally:
            self.tally_target.tally = None
        if w.all_logits and done_rows is not None:
            row = torch.cat((done_rows, row))
        key = "decode_tokens" if start_pos > 0 and len(tokens) == 1 else "prefill_tokens"
        self._stats[key] += len(tokens)
        return row

    def release(self, slot: int) -> None:
        self.caches[slot] = None
        self._kept.pop(slot, None)

    @torch.inference_mode()
    def snapshot(self, slot: int) -> tuple[Any, int]:
        cache = self.caches[slot]
        if cache is None:
            raise EngineError(f"slot {slot} holds no stream to snapshot", [slot])
        # deepcopy takes these trimmed copies in place of the memo's grown buffers
        substitutes: dict[int, Any] = {}
        for layer in cache.layers:
            memo = getattr(layer, "_glm53_expanded", None)
            if memo is not None and memo.keys is not None:
                substitutes[id(memo.keys)] = memo.keys[:, :, : memo.length].clone()
                substitutes[id(memo.values)] = memo.values[:, :, : memo.length].clone()
        state = copy.deepcopy(cache, substitutes)
        return state, tensor_bytes(state)

    @torch.inference_mode()
    def restore(self, slot: int, state: Any) -> None:
        if not 0 <= slot < self.num_slots:
            raise EngineError(f"slot {slot} is outside 0..{self.num_slots - 1}", [slot])
        self.caches[slot] = copy.deepcopy(state)

    def stream_usage(self, slot: int) -> StreamUsage:
        return self.usage[slot]

    def stats(self) -> dict[str, Any]:
        if self.model is None:
            return dict(self._stats)
        layers = {str(i): m.counters.as_dict() for i, m in self.moe.items()}
        hits = sum(c["hits"] for c in layers.values())
        misses = sum(c["misses"] for c in layers.values())
        clock = self.tier.counters()
        return {
            **self._stats,
            "tiers": {
                "ram": {
                    "slots": self.tier.num_slots,
                    "cap_bytes": self.tier.ram_cap_bytes,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    "resident": self.tier.clock.n_used,  # records in the arena
                    **clock,
                    **self.tier.faults,
                    "warm_start": {k: v for k, v in self.warm_start.items() if k != "error"},
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

    def save_heat(self) -> str | None:
        """Write the RAM tier's heat list (its resident experts, hottest first) for the next
        start; with no heat file set, or an empty tier, nothing."""
        if self.heat_file is None or self.tier is None or not self.tier.clock.n_used:
            return None
        write_heat(self.heat_file, str(self.checkpoint_dir), self.tier.heat_list())
        return self.heat_file

    def close(self) -> None:
        if self.tier is not None:
            try:
                self.save_heat()
            except OSError as exc:
                log.warning("could not write the RAM tier's heat list %s: %s", self.heat_file, exc)
            self.tier.close()
            self.tier = None
        self.model = None


def tensor_bytes(root: Any) -> int:
    """Bytes of every distinct tensor storage reachable from `root` through attributes (also
    __slots__), dicts, lists and tuples."""
    seen_objects: set[int] = set()
    seen_storages: set[int] = set()
    total, todo = 0, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") or hasattr(type(obj), "__slots__"):
            todo.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for name in getattr(type(obj), "__slots__", ()):
                todo.append(getattr(obj, name, None))
    return total


def create(settings, checkpoint_dir: Path) -> CpuEngine:
    """The CPU engine for these Settings (not loaded), its options checked first
    (glm53.engine.cpu_options). Routed experts come from --store when given, else straight from
    the checkpoint's safetensors shards."""
    return CpuEngine(checkpoint_dir, engine_options(settings, checkpoint_dir))
