"""One prompt's layer-major prefill pass over its recorded chunks (glm53.exl3.layer_major has the
whole story): each step runs one of exllamav3's modules over every chunk in order, the streams
kept between layers where glm53.plan.layer_major lays them out, and the recorded recurrent
checkpoints stashed layer by layer and handed to exllamav3's RecurrentCache at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from glm53.exl3.errors import Exl3Refused, UnsupportedCheckpoint
from glm53.plan.layer_major import PassLayout, StatePlacement, layout_pass, uses_layer_major

# params keys a module may leave for the next module: state that is not the streams
DEFERRED_KEYS = ("hc_pending", "resid_pending", "gr_weighted")
# a DSA "full" indexer layer's top-k selection, read by the "shared" layers after it
SELECTION_KEY = "dsa_topk_indices"


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


class _Prestashed:
    """A checkpoint assembled layer by layer, handed to RecurrentCache.put as a state."""

    def __init__(self, stashed: dict):
        self.stashed, self.checkpoint_size = stashed, stashed["checkpoint_size"]

    def stash(self) -> dict:
        return self.stashed


class LayerMajorPass:
    """One prompt's layer-major prefill over its recorded chunks; `ctl` is the
    glm53.exl3.layer_major.LayerMajorPrefill that runs it (its model, cache, tiers, counters)."""

    def __init__(self, ctl, job, chunks: list[_Chunk], points):
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
        self.store0 = ctl.store_counters()  # the store modes: what the pass reads from it

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
            raise RuntimeError(
                f"internal error: layer-major prefill: streams of shape {tuple(out.shape)}"
            )
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
            if self.ctl.stager is not None:  # decode steps may run before the next step
                self.ctl.stager.order_unstage()
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
            selection = c.params.get(SELECTION_KEY)
            x = module.prepare_for_device(x, c.params)
            y = module.forward(x, c.params)
            _own_selection(c.params, selection)
            if y is not x and self.layout is not None and self.step_i > 0:
                # the streams live in their home: a module that returns a new tensor has its
                # result copied there, only where that changes nothing the next module sees
                if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
                    raise RuntimeError(
                        f"internal error: layer-major prefill: {module.key} returned "
                        f"{tuple(y.shape)} {y.dtype} for streams {tuple(x.shape)} {x.dtype}"
                    )
                x.copy_(y)
            else:
                x = y
            left = [k for k in DEFERRED_KEYS if k in c.params]
            if left:
                raise Exl3Refused(
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
                    f"internal error: layer-major prefill: the checkpoint at {point.position} "
                    f"lacks recurrent layers {sorted(missing)[:4]}"
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
        if ctl.nvme is not None:  # the store's records and bytes this pass read (and waves)
            records, nbytes = ctl.store_counters()
            ctl.last["store_reads"] = records - self.store0[0]
            ctl.last["store_bytes"] = nbytes - self.store0[1]
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
        self._unhash_unwritten_pages()
        self._release()
        self.done = True

    def _unhash_unwritten_pages(self) -> None:
        """A pass ended before its last step (a cancel, a failure) leaves pages that the
        recording hashed as complete (exllamav3's `Job.prefill` hashes a page once its chunk is
        recorded) while their K/V were written by the first steps' layers only. The job's
        deallocation would keep them as prompt-cache hits under those hashes; a later prompt
        with the same tokens would then skip prefilling them. Each such page the job alone
        holds gets a placeholder hash instead (exllamav3's own `random_hash`, which no content
        hash equals), so it is reused only as a free page. On GLM's hybrid cache a page is
        resumed only below a recurrent checkpoint, which the pass publishes at its end only; this
        holds the prompt cache right without leaning on that."""
        from exllamav3.constants import PAGE_SIZE
        from exllamav3.generator.pagetable import is_content_hash, random_hash

        if not self.chunks:
            return
        first = self.chunks[0]
        start = (first.end - first.tokens) // PAGE_SIZE
        for seq in self.job.sequences:
            for page in (seq.allocated_pages or [])[start:]:
                if page.ref_count == 1 and is_content_hash(page.phash):
                    page.update_hash(random_hash())


def _own_selection(params: dict, before) -> None:
    """Give a chunk its own copy of the DSA top-k selection a module just published in its
    params. On exllamav3 1.6.5's graph-captured decode-class attention (a chunk of at most 16
    tokens, MAX_DECODE_QLEN: a prompt's tail) the selection is a workspace that every such
    forward writes ("bcm_dsa_idx" in modules/attention_fn/bc_mla.py, shared between layers and
    bucketed by size), so another stream's decode step between two layers of the pass would
    overwrite it before this chunk's "shared" indexer layers read it. Chunk-major order never
    sees this: a chunk runs every layer before anything else runs."""
    selection = params.get(SELECTION_KEY)
    if selection is not None and selection is not before:
        params[SELECTION_KEY] = selection.clone()


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
            raise UnsupportedCheckpoint(
                f"layer-major prefill stashes KDA/GDN layer states only; {key} is a "
                f"{type(layer).__name__}: serve this checkpoint with --prefill chunk"
            )
        out[id(layer.module)] = (key, layer)
    return out
