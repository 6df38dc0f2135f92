"""Fast mode's hooks around stock exllamav3 1.6.5's MoE decode forward (cuda/lane_cuda.h's
sequence). The GPU engine attaches them in `--mode fast` (glm53.exl3.fast.start_fast), served
without --allow-unrun-modes: on an H200 tests/gpu/test_fast_mode_gpu.py and the lane's device
tests passed 21 of 22 on 2026-12-02 (the one failure a fidelity bound), and on 2026-12-05
bench/gpu_slice.py's fast row ran and test_fast_mode_gpu.py passed 5 of 5, nvme mode's 6 of 6.

nvme mode uses the same hooks over nvme-exact's load: the publish reads the RAM tier's key -> slot
table (`key_lane`: a miss the RAM tier does not hold stays on the GPU), and the picks then go
through nvme-exact's route (glm53.exl3.nvme_device) instead of the VRAM cache's alone; the
design and the ordering argument are glm53.tiers.nvme_lane's.

Two class-level hooks, on top of glm53.exl3.hooks' (install those first):

- `BlockSparseMLP.routing_fn`: for a decode call (bsz <= 8) on a module with a `FastLayer`
  attached, the router's picks go through `g53_lane_publish` before the VRAM cache's route, so
  the lane's picks (masked as id -1, weight 0) are neither computed on the GPU nor admitted.
  Prefill calls go through glm53.exl3.hooks' routing as before: those of more than 8 rows by their
  size, and every chunk of `model.prefill` (a prompt's tail can be 8 rows or fewer and take the
  decode kernels) by the `NO_LANE` mark that `mark_prefill_exact` puts in its params.
- `BlockSparseMLP.cpu_split_combine`, which exllamav3 calls with the fp32 routed sum right after
  its MoE call and before the shared expert and post norms: after a publish, it runs the bounded
  wait + combine, exllamav3's MoE call again on the fallback selection (`bc.run_bszN`), and
  select, all on the current stream.

A module qualifies only when its routed input is the router's input (no router or routed
pre-norm, no latent projection) and it has exllamav3's fused decode object (`bc`).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from glm53.exl3.errors import UnsupportedCheckpoint
from glm53.exl3.hooks import (  # noqa: F401 (the prefill mark: fast.py uses it from here)
    DECODE_MAX_ROWS,
    NO_LANE,
    mark_prefill_exact,
    predict_next,
    unmark_prefill_exact,
)
from glm53.exl3.patches import patch_class, shadow, unshadow
from glm53.tiers.lane_mailbox import Mailbox, lane_dev_dtype

# The device's wait for the lane before it falls back is the router's predicted one, set per
# layer by FastLane.step (FastLayer.wait_ns); FastLayer.budget_ns, when set, pins it instead.
# Every TIME_EVERY-th decode call of a layer is timed with CUDA events (the GPU's share and the
# wait), for the router's GPU and link rates: three event records a layer, a few us of host time
TIME_EVERY = 8

# bench/gpu_trace.py turns this on: the hooks' host work runs in named profiler ranges
# (g53_fast_*), so that a trace puts the GPU's idle time on the part of the lane's path the host
# was in (a range costs a few us of host time, so serving leaves it off)
TRACE_RANGES = False


def _traced(name: str):
    if not TRACE_RANGES:
        return nullcontext()
    from torch.profiler import record_function

    return record_function(name)


def exact_call(bsz: int, params: dict) -> bool:
    """Whether a MoE call stays off the lane: prefill-sized, marked NO_LANE, or one that
    activates every expert (exllamav3's calibration passes)."""
    return bsz > DECODE_MAX_ROWS or bool(params.get("activate_all_experts") or params.get(NO_LANE))


class FastLayer:
    """The device-side buffers of one MoE module's hand-off: g53_lane_dev, the saved and the
    fallback selections, the combine scratch. Owned by the engine thread.

    The wait for the lane is `budget_ns` when set (a fixed wait: attach_fast's argument, or a
    test that assigns it), else `wait_ns`, the router's prediction for the step (0 until the
    first FastLane.step, when the budget of experts is 0 too and nothing is waited for)."""

    def __init__(
        self, module, moe_index: int, mailbox: Mailbox, cache=None, budget_ns=None, key_lane=None
    ):
        import torch

        from glm53 import _cuda

        odd = [n for n in ("router_pre_norm", "routed_pre_norm", "latent_in") if getattr(module, n)]
        if odd or module.bc is None:
            raise UnsupportedCheckpoint(
                f"{module.key}: fast mode needs exllamav3's fused decode path with the router's "
                f"input as the experts' ({', '.join(odd) or 'no bc'}); serve it in exact mode"
            )
        dev = module.device
        host = np.zeros(1, lane_dev_dtype(_cuda.lane_dev_layout()))
        host["mbox"] = mailbox.pin()
        self.module, self.moe_index, self.mailbox, self.cache = module, moe_index, mailbox, cache
        # nvme mode: the RAM tier's key -> slot table (glm53.tiers.nvme_lane); None: fast mode
        self.key_lane = key_lane
        self.budget_ns: int | None = budget_ns
        self.wait_ns = 0
        self.calls = 0  # decode calls that published
        # CUDA events of a timed call: after the publish, before and after the wait
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self.timed = False  # this call is timed
        self.timing_pending = False  # a timed call's events are recorded, not read yet
        self.state = torch.from_numpy(host.view(np.uint8).copy()).to(dev)
        n_sel = DECODE_MAX_ROWS * module.num_experts_per_tok
        self.orig_sel = torch.empty(n_sel, dtype=torch.long, device=dev)
        self.orig_w = torch.empty(n_sel, dtype=torch.half, device=dev)
        self.fb_sel = torch.empty(n_sel, dtype=torch.long, device=dev)
        self.fb_w = torch.empty(n_sel, dtype=torch.half, device=dev)
        self.acc = torch.empty((DECODE_MAX_ROWS, module.hidden_size), dtype=torch.float, device=dev)
        self.pending_input = None  # the MoE input of a call that published
        # the budget the call's publish reads (the host sets it between iterations only:
        # FastLane.step), read here at the publish: 0 means the device sends the lane nothing
        self.sent_budget = 0

    def publish(self, z, selected, weights) -> None:
        import torch

        from glm53 import _cuda

        bsz, top_k = selected.shape
        if selected.dtype != torch.long or weights.dtype != torch.half:
            raise RuntimeError(
                f"internal error: {self.module.key}: the router gave {selected.dtype} ids and {weights.dtype} "
                "weights; the lane's publish reads int64 ids and fp16 weights (exllamav3 1.6.5)"
            )
        if not (selected.is_contiguous() and weights.is_contiguous() and z.stride(1) == 1):
            raise RuntimeError(
                f"internal error: {self.module.key}: the router's outputs must be contiguous"
            )
        key_slot = key_score = 0
        key_base = 0
        if self.cache is not None:
            key_slot = self.cache._t["key_slot"].data_ptr()
            if self.cache.freq_window:  # the admission filter's lookup counts: colder is lower
                key_score = self.cache._t["key_freq"].data_ptr()
            key_base = self.moe_index * self.cache.geo.n_experts
        key_lane = 0 if self.key_lane is None else self.key_lane.data_ptr()
        self.sent_budget = int(self.mailbox.load("budget"))
        _cuda.lane_publish(
            self.state.data_ptr(), selected.data_ptr(), weights.data_ptr(), z.data_ptr(), bsz,
            top_k, self.module.hidden_size, z.stride(0), key_slot, key_score, key_lane, key_base,
            self.module.num_experts, self.orig_sel.data_ptr(), self.orig_w.data_ptr(),
            self.moe_index, torch.cuda.current_stream(z.device).cuda_stream,
        )  # fmt: skip
        self.pending_input = z
        self.timed = self.calls % TIME_EVERY == 0
        self.calls += 1
        if self.timed:
            self.events[0].record(torch.cuda.current_stream(z.device))

    def skip_timing(self) -> None:
        """This call is not timed for the router (nvme: its route waited for a store read)."""
        self.timed = False

    def combine(self, final_hidden_states) -> None:
        import torch

        from glm53 import _cuda

        z, self.pending_input = self.pending_input, None
        bsz, hidden = z.shape[0], self.module.hidden_size
        top_k = self.module.num_experts_per_tok
        out = final_hidden_states.view(-1, hidden)
        torch_stream = torch.cuda.current_stream(z.device)
        stream = torch_stream.cuda_stream
        if self.sent_budget == 0:
            # the publish took no pick (its budget was 0): exllamav3's call computed every pick
            # and there is nothing to wait for, fall back on or select; the wait, the fallback
            # MoE call over an all-masked selection and select would change nothing
            if self.timed:  # the GPU's share for the router, with no wait after it
                self.events[1].record(torch_stream)
                self.events[2].record(torch_stream)
                self.timing_pending, self.timed = True, False
            return
        wait_ns = self.wait_ns if self.budget_ns is None else self.budget_ns
        if self.timed:
            self.events[1].record(torch_stream)
        _cuda.lane_wait(
            self.state.data_ptr(), out.data_ptr(), bsz, hidden, out.stride(0),
            self.acc.data_ptr(), self.fb_sel.data_ptr(), self.fb_w.data_ptr(),
            self.orig_sel.data_ptr(), self.orig_w.data_ptr(), wait_ns, stream,
        )  # fmt: skip
        if self.timed:
            self.events[2].record(torch_stream)
            self.timing_pending, self.timed = True, False
        fb_sel = self.fb_sel[: bsz * top_k].view(bsz, top_k)
        fb_w = self.fb_w[: bsz * top_k].view(bsz, top_k)
        with _traced("g53_fast_fallback"):
            self.module.bc.run_bszN(z, fb_sel, fb_w)  # writes the same out_bszn rows
        _cuda.lane_select(
            self.state.data_ptr(), out.data_ptr(), self.acc.data_ptr(), bsz, hidden,
            out.stride(0), stream,
        )  # fmt: skip

    def take_timing(self) -> tuple[float, float] | None:
        """(the GPU's share in ms: its MoE call and the cache's route, from the publish to the
        wait; the wait in ms) of the newest timed call, once; None when no timed call is
        unread or its events have not completed (never blocks)."""
        if not self.timing_pending or not self.events[2].query():
            return None
        self.timing_pending = False
        start, before_wait, after_wait = self.events
        return start.elapsed_time(before_wait), before_wait.elapsed_time(after_wait)

    def counters(self) -> dict:
        """published, lane_picks, fallbacks (a device read: syncs the stream)."""
        from glm53 import _cuda

        st = self.state.cpu().numpy().view(lane_dev_dtype(_cuda.lane_dev_layout()))[0]
        return {k: int(st[k]) for k in ("published", "lane_picks", "fallbacks")}


_installed = False


def install_fast_hooks() -> None:
    """Wrap glm53.exl3.hooks' routing property and cpu_split_combine (idempotent)."""
    global _installed
    if _installed:
        return
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    prop = BlockSparseMLP.__dict__["routing_fn"]
    if not isinstance(prop, property):
        raise RuntimeError(
            "internal error: install glm53.exl3.hooks' hooks (install_hooks) before fast mode's"
        )
    base_get = prop.fget

    def _get(self):
        routed = base_get(self)
        fast = self.__dict__.get("_g53_fast")
        fn = self.__dict__.get("_g53_routing_fn")
        if fast is None or fn is None:
            return routed
        cache = self.__dict__.get("_g53_cache")
        nvme = self.__dict__.get("_g53_nvme")  # nvme mode: glm53.exl3.nvme_device.NvmeHome
        nxt = self.__dict__.get("_g53_next") if nvme is not None else None  # decode prefetch
        loan = getattr(self.__dict__.get("_g53_stager"), "loan", None)  # exact's staging loan

        def fast_routed(bsz, cfg, z, params):
            if exact_call(bsz, params):
                return routed(bsz, cfg, z, params)
            predicted = predict_next(nxt, bsz, z, params)  # before this layer's own routing
            if loan is not None and fast.moe_index == 0:  # a decode forward starts: before the
                loan.decode()  # publish reads which keys the cache holds
            with _traced("g53_fast_router"):
                selected, weights = fn(bsz, cfg, z, params)
            with _traced("g53_fast_publish"):
                fast.publish(z.view(bsz, -1), selected, weights)
            with _traced("g53_fast_cache_route"):
                if nvme is not None:  # resolve + point the picks as routed, admit the GPU's
                    nvme.route(fast.moe_index, selected, True, params, weights, lane=fast,
                               predicted=predicted)  # fmt: skip
                elif cache is not None:
                    cache.route(fast.moe_index, selected.reshape(-1), admit=True)
            return selected, weights

        return fast_routed

    patch_class(BlockSparseMLP, "BlockSparseMLP.routing_fn", property(_get, prop.fset))
    original_combine = BlockSparseMLP.cpu_split_combine

    def cpu_split_combine(self, final_hidden_states, cpu_partial, cpu_pending, shape):
        fast = self.__dict__.get("_g53_fast")
        if fast is not None and fast.pending_input is not None:
            with _traced("g53_fast_combine"):
                fast.combine(final_hidden_states)
        return original_combine(self, final_hidden_states, cpu_partial, cpu_pending, shape)

    cpu_split_combine.__wrapped__ = original_combine
    patch_class(BlockSparseMLP, "BlockSparseMLP.cpu_split_combine", cpu_split_combine)
    _installed = True


def attach_fast(modules, mailboxes, cache=None, budget_ns=None, key_lane=None) -> list[FastLayer]:
    """One FastLayer per MoE module (moe_index = position), on its layer's mailbox; `key_lane`
    (nvme mode) the RAM tier's key -> slot table the publish reads."""
    layers = []
    for i, (mod, mbox) in enumerate(zip(modules, mailboxes, strict=True)):
        layer = FastLayer(mod, i, mbox, cache, budget_ns, key_lane)
        shadow(mod, "BlockSparseMLP._g53_fast", layer)
        layers.append(layer)
    return layers


def detach_fast(modules) -> None:
    for mod in modules:
        layer = unshadow(mod, "BlockSparseMLP._g53_fast")
        if layer is not None:
            layer.mailbox.unpin()
