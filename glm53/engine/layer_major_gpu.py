"""Layer-major prefill on the GPU engine (issue 28; docs/layer-major.md). Written, not yet run
on a GPU: `glm53 serve --prefill layer-major` needs --allow-unrun-modes until
tests/gpu/test_layer_major_gpu.py has passed.

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
from dataclasses import dataclass, field
from typing import Any

from glm53.plan.layer_major import (
    PassLayout,
    StatePlacement,
    StreamGeometry,
    layout_pass,
    uses_layer_major,
)

log = logging.getLogger("glm53.engine.layer_major")

# params keys a module may leave for the next module: state that is not the streams
DEFERRED_KEYS = ("hc_pending", "resid_pending", "gr_weighted")


@dataclass
class _Chunk:
    ids: Any  # the chunk's input ids [1, tokens]
    params: dict
    tokens: int
    end: int  # sequence position after the chunk
    x: Any = None  # the module input: ids, then the streams (device or pinned host)


@dataclass
class _Checkpoint:
    key: Any  # the page hash the job stashes under
    position: int
    layers: dict = field(default_factory=dict)  # recurrent layer key -> its stash


class _StashRecorder:
    """Stands in for the RecurrentCache while the job's prefill is recorded: `put` notes where
    the job would have stashed."""

    def __init__(self):
        self.points: list[_Checkpoint] = []

    def put(self, key, state) -> None:
        self.points.append(_Checkpoint(key, int(state.position)))


class _Prestashed:
    """A checkpoint assembled layer by layer, handed to RecurrentCache.put as a state."""

    def __init__(self, stashed: dict):
        self.stashed, self.checkpoint_size = stashed, stashed["checkpoint_size"]

    def stash(self) -> dict:
        return self.stashed


class LayerMajorPass:
    """One prompt's layer-major prefill over its recorded chunks."""

    def __init__(self, ctl: LayerMajorPrefill, job, chunks: list[_Chunk], points):
        import torch

        self.ctl, self.job, self.chunks = ctl, job, chunks
        self.points = {p.position: p for p in points}
        model = ctl.model
        self.steps = _module_steps(model)
        self.step_i = 0
        self.t0 = time.perf_counter()
        self.tokens = sum(c.tokens for c in chunks)
        self.layout: PassLayout | None = None
        self.lent = None  # the lent slots' bytes
        self.pieces: list = []  # device stream tensors (VRAM: per chunk; pinned: two buffers)
        self.host: list = []  # pinned: per chunk
        self.copy = None  # pinned: the copy stream
        rs = job.recurrent_state
        self.slot = rs.target.slot if rs is not None else None
        self.parity = getattr(rs.target, "parity", 0) if rs is not None else 0
        self.recurrent = _recurrent_layers(ctl.cache) if self.points else {}
        self.device = torch.device(ctl.device)
        self.done = False

    # --- placement ---------------------------------------------------------------------------
    def _place(self) -> None:
        """Before the first step: lay the streams out (glm53.plan.layer_major.layout_pass),
        lend the cache slots that takes and make the device pieces and the pinned buffers."""
        import torch

        ctl = self.ctl
        lengths = [c.tokens for c in self.chunks]
        if not uses_layer_major(self.tokens, max(lengths)):
            return  # one chunk's tokens: the streams stay where exllamav3 allocates them
        ec = ctl.ec
        slots = ec.n_slots if ec is not None else 0
        record = ec.geo.record_bytes if ec is not None else 1
        self.layout = layout = layout_pass(ctl.geo, lengths, ctl.free_bytes(), slots, record)
        if layout.lent_slots:
            self.lent = ec.lend(layout.lent_slots)
        if ctl.stager is not None:
            ctl.stager.begin_hold(tables_reset=layout.lent_slots > 0)
        shape = (ctl.geo.hc_mult, ctl.geo.hidden_size)

        def piece(i: int, tokens: int):
            off = layout.piece_offsets[i]
            if off is None:
                return torch.empty((1, tokens, *shape), dtype=torch.float, device=self.device)
            raw = self.lent[off : off + layout.piece_bytes[i]]
            return raw.view(torch.float).view(1, tokens, *shape)

        if layout.plan.placement == StatePlacement.VRAM:
            self.pieces = [piece(i, n) for i, n in enumerate(lengths)]
            return
        biggest = max(lengths)
        self.pieces = [piece(0, biggest), piece(1, biggest)]
        self.host = [torch.empty((1, n, *shape), dtype=torch.float, pin_memory=True)
                     for n in lengths]  # fmt: skip
        self.copy = torch.cuda.Stream(self.device)

    def _home(self, i: int, out):
        """Chunk i's streams after the first step, moved to where they live between layers."""
        if self.layout is None:
            return out
        if tuple(out.shape) != (1, self.chunks[i].tokens, self.ctl.geo.hc_mult,
                                self.ctl.geo.hidden_size):  # fmt: skip
            raise RuntimeError(f"layer-major prefill: streams of shape {tuple(out.shape)}")
        if self.copy is None:
            self.pieces[i].copy_(out)
            return self.pieces[i]
        self.host[i].copy_(out, non_blocking=True)  # on the main stream, after the step
        return self.host[i]

    # --- one step: one module (the first step: everything up to the first block) ---------------
    def step(self) -> bool:
        import torch

        mods = self.steps[self.step_i]
        with torch.inference_mode():
            if self.step_i == 0:
                self._place()
                for i, c in enumerate(self.chunks):
                    c.x = self._home(i, self._run(c, c.x, mods))
            elif self.copy is not None:
                self._step_pinned(mods)
            else:
                for c in self.chunks:
                    c.x = self._run(c, c.x, mods)
        self.step_i += 1
        self.ctl.counters["layers_run"] += 1
        if self.step_i == len(self.steps):
            self._finish()
            return True
        return False

    def _run(self, c: _Chunk, x, mods):
        model = self.ctl.model
        for module, instance, idx in mods:
            c.params["layer_instance"] = instance
            pf = (idx, instance) == model.last_kv_module_idx_instance
            c.params["prefill"] = pf
            x = module.prepare_for_device(x, c.params)
            y = module.forward(x, c.params)
            if y is not x and self.layout is not None and self.step_i > 0:
                # the streams live in their home: a module that returns a new tensor has its
                # result copied there, only where that changes nothing the next module sees
                if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
                    raise RuntimeError(
                        f"layer-major prefill: {module.key} returned {tuple(y.shape)} "
                        f"{y.dtype} for streams {tuple(x.shape)} {x.dtype}"
                    )
                x.copy_(y)
            else:
                x = y
            left = [k for k in DEFERRED_KEYS if k in c.params]
            if left:
                raise RuntimeError(
                    f"layer-major prefill: {module.key} left {left} in the chunk's params (a "
                    "residual deferred to the next module, in workspaces the next chunk reuses); "
                    "unset EXL3_HC_FOLD or serve with --prefill chunk"
                )
            self._stash_after(c, module)
        return x

    def _step_pinned(self, mods) -> None:
        """Streams in pinned RAM: chunk c is read into buffer c % 2 on the copy stream while
        chunk c - 1 computes, and written back once it has computed."""
        import torch

        main, copy = torch.cuda.current_stream(self.device), self.copy
        last = self.step_i == len(self.steps) - 1
        copy.wait_stream(main)  # the buffers' last users (the previous step) are done
        loaded: dict = {}

        def load(i: int):
            c, buf = self.chunks[i], self.pieces[i % 2][:, : self.chunks[i].tokens]
            with torch.cuda.stream(copy):
                buf.copy_(c.x, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(copy)
            loaded[i] = (buf, ev)

        for i in range(min(2, len(self.chunks))):
            load(i)
        for i, c in enumerate(self.chunks):
            buf, ev = loaded.pop(i)
            main.wait_event(ev)
            out = self._run(c, buf, mods)
            computed = torch.cuda.Event()
            computed.record(main)
            with torch.cuda.stream(copy):
                copy.wait_event(computed)  # the buffer is free for chunk i + 2 after this
                if not last:  # the last KV module's output is not used (prefill_ls drops it)
                    c.x.copy_(out, non_blocking=True)
            if i + 2 < len(self.chunks):
                load(i + 2)  # the same buffer: queued after the write-back above
        main.wait_stream(copy)

    def _stash_after(self, c: _Chunk, module) -> None:
        point = self.points.get(c.end)
        if point is None:
            return
        attn = getattr(module, "attn", None)
        entry = self.recurrent.get(id(attn))
        if entry is None:
            return
        key, layer = entry
        point.layers[key] = layer.stash(self.slot, point.position, self.parity)

    # --- end ---------------------------------------------------------------------------------
    def _finish(self) -> None:
        import torch

        ctl = self.ctl
        for c in self.chunks:
            c.params.pop("prefill", None)
        rs = self.job.recurrent_state
        for point in sorted(self.points.values(), key=lambda p: p.position):
            missing = set(self.recurrent_keys()) - set(point.layers)
            if missing:
                raise RuntimeError(
                    f"layer-major prefill: the checkpoint at {point.position} lacks recurrent "
                    f"layers {sorted(missing)[:4]}"
                )
            target = {"position": point.position, "checkpoint_size": rs.target.checkpoint_size}
            target.update(point.layers)
            stashed = {"position": point.position, "checkpoint_size": rs.checkpoint_size,
                       "target": target}  # fmt: skip
            ctl.generator.recurrent_cache.put(point.key, _Prestashed(stashed))
        torch.cuda.current_stream(self.device).synchronize()  # stashes' host copies landed
        seconds = time.perf_counter() - self.t0
        ctl.last = {"tokens": self.tokens, "chunks": len(self.chunks), "seconds": seconds,
                    "tok_s": self.tokens / seconds if seconds else None} | self.describe()  # fmt: skip
        self._release()
        self.done = True

    def recurrent_keys(self):
        return [key for key, _ in self.recurrent.values()]

    def describe(self) -> dict:
        if self.layout is None:
            return {"placement": "as allocated (one chunk's tokens)", "lent_slots": 0}
        p = self.layout.plan
        return {"placement": str(p.placement), "state_bytes": p.state_bytes,
                "lent_slots": self.layout.lent_slots, "pinned_bytes": p.pinned_bytes}  # fmt: skip

    def _release(self) -> None:
        """Drop the chunks and their streams, give back the lent slots, end the stager's hold."""
        ctl = self.ctl
        self.chunks, self.pieces, self.host = [], [], []
        if self.lent is not None:
            self.lent = None
            ctl.ec.unlend()
        if ctl.stager is not None:
            ctl.stager.end_hold()

    def abort(self) -> None:
        self._release()
        self.done = True


def _module_steps(model) -> list[list]:
    """The prefill's modules (prefill_ls: up to and including the last KV module), one step
    each, the modules before the first decoder block joined to it."""
    mods = []
    for module, instance, idx in model.fwd_modules:
        mods.append((module, instance, idx))
        if (idx, instance) == model.last_kv_module_idx_instance:
            break
    first = model.first_block_idx if model.first_block_idx is not None else 0
    head = [m for m in mods if m[2] <= first]
    return [head] + [[m] for m in mods if m[2] > first]


def _recurrent_layers(cache) -> dict:
    """id(recurrent module) -> (its key in the cache's stash, its GDNLayerState)."""
    from exllamav3.modules.gated_delta_net import GDNLayerState

    out = {}
    for key, layer in cache.get_all_recurrent_layers().items():
        if not isinstance(layer, GDNLayerState):
            raise RuntimeError(
                f"layer-major prefill stashes KDA/GDN layer states only; {key} is a "
                f"{type(layer).__name__}"
            )
        out[id(layer.module)] = (key, layer)
    return out


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
        self.geo = StreamGeometry.from_text_config(text_config)
        self.reserve, self.device = int(reserve_bytes), device
        if getattr(self.model, "loaded_tp", False):
            raise RuntimeError("layer-major prefill runs the layer-split model, not a TP load")
        if generator.draft_model is not None:
            raise RuntimeError("layer-major prefill does not drive a draft model")
        if getattr(self.model.config, "moe_cpu_hosts", None):
            raise RuntimeError("layer-major prefill does not drive CPU-offloaded experts")
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

        job.maybe_stash_recurrent = maybe_stash_recurrent
        job.is_prefill_done = is_prefill_done
        job.prefill = layer_major_prefill
        job._g53_layer_major = state

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
        model.prefill = record
        try:
            with torch.inference_mode():
                while seq.kv_position < len(seq.sequence_ids) - 1:
                    before = seq.kv_position
                    prefill(results, None)
                    stash(recorder)  # as Generator.recurrent_checkpoint does after each chunk
                    if seq.kv_position == before:
                        raise RuntimeError(
                            f"layer-major prefill: the job's prefill made no progress at {before}"
                        )
        finally:
            del model.prefill
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
