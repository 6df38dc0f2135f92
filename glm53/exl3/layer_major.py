"""Layer-major prefill on the GPU engine (issue 28; docs/layer-major.md). On an H200 on
2026-12-05 (at 75ddce3) tests/gpu/test_layer_major_gpu.py passed 6 of 6: identity (logits and
every decoded token torch.equal to stock exllamav3's Generator prefilling chunk-major, at 2,049,
8,192 and 32,768 tokens), the short prompt keeping the Generator's path, each MoE layer a
prefill runs staged once per pass (5 layers x 7 chunks), checkpoint reuse, cancel mid-prefill
and a decoding stream going on during a long prefill. In the store modes (the RAM tier read
once per layer per prompt) tests/gpu/test_nvme_exact_gpu.py's layer-major case passed on an
H100 on 2026-12-05 (nvme-exact, RAM 40 %, torch.equal to stock exllamav3's chunk-major
prefill). `glm53 serve --prefill layer-major` (exact, nvme-exact or nvme mode, one GPU) needs no
--allow-unrun-modes.

How a prompt longer than one chunk is prefilled, over stock exllamav3 1.6.5 (unedited):

1. Record. The first time the Generator asks the job to prefill, its own `Job.prefill` runs
   once per chunk, as chunk-major prefill would run it one chunk per iteration, with
   `model.prefill` shadowed (an instance attribute, for this loop only) by a recorder: the
   recorder does what `Model.prefill` does before and after the forward (`prepare_inputs` on
   the chunk's params, the prefetch layers, `advance_recurrent_states`) and keeps the
   (input, params) pair instead of running the modules. So every chunk's params dict (block
   table, cache_seqlens, positions, recurrent slots) is the one the chunk-major forward would
   get, and the job's host bookkeeping (kv_position, pages, page hashes) is exllamav3's own.
   The recurrent checkpoints the job would stash (`maybe_stash_recurrent`, after each chunk as
   `Generator.recurrent_checkpoint` calls it, and inside `Job.prefill` at the last page) are
   recorded as (page hash, position) too.
2. Run. Then `prefill_ls`'s loop with its two loops swapped: for each module up to the last
   KV module, every chunk in order (`prepare_for_device`, `forward`, the same `layer_instance`
   and `prefill` flags). Chunk c of layer L reads the KV pages and the KDA conv/recurrent rows
   that chunk c - 1 of layer L wrote, as in chunk-major order: nothing else writes them in
   between (other jobs' decode steps use their own pages and slots). One module per engine
   iteration, so other streams decode between layers and a cancel lands within one layer.
   A recorded checkpoint at position p is taken per KDA layer right after the chunk ending at
   p has run through that layer (`GDNLayerState.stash`), and handed to the recurrent cache
   when every layer has written its part.
3. Finish. The job is prefill-done again (it was hidden from decode during the pass), and the
   Generator decodes its last prompt token as it would after the last chunk.

Between layers a chunk keeps its mHC streams (the module output) and its params dict (the
DSA top-k selection rides there); glm53.plan.layer_major accounts for both. The streams live
in VRAM (free VRAM, then lent expert-cache slots) when they fit, else in pinned host RAM,
copied through two chunk buffers. Staging (PrefillStager) holds: a layer is copied once per
pass, not once per chunk.

Where exllamav3's structure could break the identity, the pass refuses rather than guess:
a deferred residual (`hc_pending`, `resid_pending`: HyperConnection's fold, on CUDA only with
EXL3_HC_FOLD=1) left in a chunk's params after a module would point into workspaces the next
chunk's same module reuses, so the pass raises when it sees one; tensor-parallel loads,
draft models and CPU-offloaded experts are refused at start.
"""

from __future__ import annotations

import logging
import time

from glm53.exl3.layer_major_pass import LayerMajorPass, _Checkpoint, _Chunk
from glm53.exl3.patches import shadow, unshadow
from glm53.plan.layer_major import StreamGeometry

log = logging.getLogger("glm53.engine.layer_major")


class _StashRecorder:
    """Stands in for the RecurrentCache while the job's prefill is recorded: `put` notes where
    the job would have stashed."""

    def __init__(self):
        self.points: list[_Checkpoint] = []

    def put(self, key, state) -> None:
        self.points.append(_Checkpoint(key, int(state.position)))


class LayerMajorPrefill:
    """The GPU engine's layer-major prefill: watches its jobs, records a long prompt's chunks
    when the Generator first asks for them, and runs one pass at a time, one module per
    engine iteration (`step`). Other prompts wait their turn; short prompts and decode keep
    the Generator's path."""

    def __init__(self, loaded, generator, chunk_size: int, text_config: dict,
                 reserve_bytes: int, device):  # fmt: skip
        self.loaded, self.generator, self.chunk = loaded, generator, int(chunk_size)
        self.model, self.cache = loaded.model, loaded.cache
        self.ec, self.stager = loaded.ec, loaded.stager
        # the store modes' RAM tier (glm53.exl3.nvme_device): each chunk of a layer resolves
        # its picks there (the stager is held, so unstaged). The VRAM cache lends slots to the
        # streams as in exact mode: a key it evicts from them points at its home in the host's
        # table (a RAM slot, or absent), as after any VRAM eviction in these modes
        self.nvme = getattr(loaded, "nvme", None)
        self.geo = StreamGeometry.from_text_config(text_config)
        self.reserve, self.device = int(reserve_bytes), device
        if getattr(self.model, "loaded_tp", False):
            raise RuntimeError(
                "internal error: layer-major prefill runs the layer-split model, not a TP load"
            )
        if generator.draft_model is not None:
            raise RuntimeError("internal error: layer-major prefill does not drive a draft model")
        if getattr(self.model.config, "moe_cpu_hosts", None):
            raise RuntimeError(
                "internal error: layer-major prefill does not drive CPU-offloaded experts"
            )
        self.active: LayerMajorPass | None = None
        self.counters = {"passes": 0, "passes_cancelled": 0, "layers_run": 0, "tokens": 0}
        self.last: dict | None = None
        self.longest_pause_s = 0.0
        self._last_decode_t: float | None = None
        self._stepped_since_decode = False

    def free_bytes(self) -> int:
        """VRAM a pass may take beyond the expert cache: the plan's free bytes under a
        --vram-budget, else what the device has free less the reserve."""
        import torch

        plan = self.loaded.vram_plan
        if plan is not None:
            return int(plan.free_bytes)
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, int(free) - self.reserve)

    # --- the job's hooks (instance attributes; exllamav3's classes are untouched) -------------
    def watch(self, job) -> None:
        prefill, stash, done = job.prefill, job.maybe_stash_recurrent, job.is_prefill_done
        state = {"recorder": None, "pass": False}

        def maybe_stash_recurrent(cache, interval=None):
            if state["pass"]:
                return  # the pass stashes per layer; its positions are recorded already
            return stash(state["recorder"] or cache, interval)

        def is_prefill_done():
            return False if state["pass"] else done()

        def layer_major_prefill(results, chunk_size=None):
            if state["pass"]:
                return
            seq = job.sequences[0]
            if len(seq.sequence_ids) - 1 - seq.kv_position <= self.chunk:
                return prefill(results, chunk_size)  # short: the Generator's own path
            if self.active is not None:
                return  # one pass at a time: this prompt waits, others decode
            self._record(job, prefill, maybe_stash_recurrent, state, results)

        shadow(job, "Job.maybe_stash_recurrent", maybe_stash_recurrent)
        shadow(job, "Job.is_prefill_done", is_prefill_done)
        shadow(job, "Job.prefill", layer_major_prefill)
        shadow(job, "Job._g53_layer_major", state)

    def _record(self, job, prefill, stash, state, results) -> None:
        import torch
        from exllamav3.cache.recurrent_util import advance_recurrent_states

        model, chunks = self.model, []
        recorder = _StashRecorder()

        def record(input_ids, params=None):
            params = {} if params is None else params
            x = model.prepare_inputs(input_ids, params)
            for m in model._get_prefetch_layers:
                m.prefetch(x, params)
            advance_recurrent_states(input_ids, params, model)
            start = int(params["cache_seqlens"][0])
            n = int(input_ids.shape[-1])
            chunks.append(_Chunk(input_ids, params, n, start + n, x))

        seq = job.sequences[0]
        state["recorder"] = recorder
        shadow(model, "Model.prefill", record)
        try:
            with torch.inference_mode():
                while seq.kv_position < len(seq.sequence_ids) - 1:
                    before = seq.kv_position
                    prefill(results, None)
                    stash(recorder)  # as Generator.recurrent_checkpoint does after each chunk
                    if seq.kv_position == before:
                        raise RuntimeError(
                            "internal error: layer-major prefill: the job's prefill made no "
                            f"progress at {before}"
                        )
        finally:
            unshadow(model, "Model.prefill")
            state["recorder"] = None
        state["pass"] = True
        self.active = LayerMajorPass(self, job, chunks, recorder.points)
        self.counters["passes"] += 1
        self.counters["tokens"] += self.active.tokens
        log.info("layer-major prefill: %d tokens in %d chunks, %d checkpoints",
                 self.active.tokens, len(chunks), len(recorder.points))  # fmt: skip

    # --- the engine's calls ------------------------------------------------------------------
    def step(self) -> None:
        """Run the active pass's next module (nothing when none is active)."""
        p = self.active
        if p is None:
            return
        self._stepped_since_decode = True
        if p.step():
            p.job._g53_layer_major["pass"] = False
            self.active = None

    def after_iterate(self, decoded: bool) -> None:
        """After the Generator's iteration: `decoded` when some stream got tokens. The pause a
        decoding stream saw is the time since the previous iteration that gave tokens, counted
        when a pass step ran in between (a decoding stream gets a token every iteration)."""
        now = time.perf_counter()
        if decoded:
            if self._stepped_since_decode and self._last_decode_t is not None:
                self.longest_pause_s = max(self.longest_pause_s, now - self._last_decode_t)
            self._last_decode_t = now
            self._stepped_since_decode = False
        else:  # an iteration without tokens had no stream decoding: nothing was paused
            self._last_decode_t = None

    def cancel(self, job) -> bool:
        """Drop `job`'s pass (before the Generator cancels the job); True when it had one."""
        p = self.active
        if p is None or p.job is not job:
            return False
        p.abort()
        self.active = None
        job._g53_layer_major["pass"] = False
        self.counters["passes_cancelled"] += 1
        return True

    def store_counters(self) -> tuple[int, int]:
        """(records, bytes) the store modes' RAM tier has read from the store so far; (0, 0)
        in exact mode."""
        if self.nvme is None:
            return 0, 0
        c = self.nvme.home.counters
        return int(c["ram_reads"]), int(c["bytes_read"])

    def stats(self) -> dict:
        out = dict(self.counters)
        out["longest_decode_pause_s"] = round(self.longest_pause_s, 6)
        out["last_pass"] = self.last
        if self.active is not None:
            out["active"] = {"step": self.active.step_i, "steps": len(self.active.steps),
                             "tokens": self.active.tokens}  # fmt: skip
        if self.stager is not None:
            out["staging_skips"] = self.stager.skips
        return out
