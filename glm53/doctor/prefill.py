"""The planner's prefill model per prompt length: chunk-major prefill (what the GPU engine runs),
layer-major prefill (issue 28: its 6 GPU tests passed on an H200 on 2026-12-05, identity with
stock exllamav3's chunk-major prefill, cancel and interleave among them; in the store modes its
GPU test passed on an H100 the same day; served without --allow-unrun-modes in exact, nvme-exact
and nvme mode) and the one-pass stream bound the issue's benchmark ratios are taken against.

Touched experts. Each token of a layer picks expert e with probability r_e, its rate on the
popularity curve (costmodel._pick_rates: the slope of the decode popularity fit, summing to
top-k). T tokens picking independently touch e with probability 1 - (1 - r_e)^T, so a chunk of
T tokens streams sum_e (1 - (1 - r_e)^T) of a layer's experts at most. Independence is the
upper end: neighbouring tokens share experts (decode reuse), which touches fewer. On
GLM-5.3-Flash's curve the coldest of the 288 experts is touched by 36 % of 512-token chunks and
84 % of 2,048-token chunks (284.3 of the 288 on average), and an 8k prompt touches 287.99.

Per layer (the staging copies layer l+1's experts while layer l computes, DESIGN §4), a step
costs the slower of its GPU compute (costmodel._chunk_compute_s, spread evenly over the layers:
measured per chunk and per token when the inputs carry an all-VRAM prefill) and its
host-to-device traffic, except that a chunk-major chunk's first MoE layer pays its stage after
its compute (it is staged on the main stream, with nothing before it to overlap), and every
layer does so with an SM gather stage (x.stage_overlap False). The traffic is: the touched experts not in VRAM (the hottest vram_slots /
num_moe_layers of each layer are resident, as in exact_decode_ms), plus, for layer-major
prefill with its hidden states in pinned RAM, the states read back in; the states written out
take the other direction of the (full-duplex) link, at the same rate. nvme modes read the
touched experts not in the RAM tier from the store first, one read after another, on top.

- chunk-major: every chunk, every layer: the touched experts of that chunk cross per chunk.
- layer-major: every layer once over the whole prompt: its touched experts cross once (in the
  store modes, each chunk reads its picks zero-copy from the RAM tier, so they cross per chunk
  there, while the store is read once per prompt; staging each layer once per pass there runs
  only with --allow-unrun-modes until its GPU test passes, and is not priced), while
  its compute is still every chunk's (each chunk through a layer is its own forward, paying
  the layer's fixed cost per chunk: chunked_compute_s), so a measured fixed cost keeps it at
  the chunk size's compute floor however long the prompt. The
  hidden states take the expert cache's VRAM when they fit (glm53.plan.layer_major.vram_room
  says why lending beats pinning) and those slots stream like any miss; else they go to pinned
  RAM. Prompts of at most one chunk keep the normal path, so both predictions agree there.
- stream once: the prompt's touched experts of every MoE layer a prefill runs (all but the
  last: Geometry.prefill_moe_layers) crossing the link once, VRAM
  cache ignored (bench/gpu_slice.py's stream bound).
"""

from __future__ import annotations

import msgspec

from glm53.doctor.costmodel import (
    CostInputs,
    _chunk_compute_s,
    _expert_ms,
    _pick_rates,
    chunk_lengths,
)
from glm53.doctor.geometry import Geometry
from glm53.plan.layer_major import (
    HiddenStatePlan,
    StreamGeometry,
    hidden_state_bytes,
    lent_cache_slots,
    num_chunks,
    plan_hidden_states,
    uses_layer_major,
)

PREFILL_PROMPTS = (512, 2048, 8192, 32768, 131072)
CHUNK_TOKENS = 2048  # serve's --chunk-size default (exllamav3's too)
LAYER_MAJOR_STATUS = (
    "its 6 GPU tests passed (H200, 2026-12-05), and in the store modes its GPU test (nvme-exact, "
    "RAM 40 %, H100, 2026-12-05): --prefill layer-major on one GPU in exact, nvme-exact or nvme "
    "mode, no --allow-unrun-modes needed; serve runs chunk-major prefill by default"
)


class PrefillRow(msgspec.Struct, frozen=True):
    """Predicted prefill of one prompt length. Rates in prompt tokens per second."""

    prompt_tokens: int
    num_chunks: int
    touched_per_layer_chunk: float  # experts of one MoE layer a chunk touches (expected)
    touched_per_layer_prompt: float  # ... the whole prompt touches
    compute_tok_s: float  # the GPU's compute alone at this chunk size: no prefill is faster
    chunk_major_tok_s: float  # built: what serve runs
    layer_major_tok_s: float | None  # --prefill layer-major; None: no VRAM for its buffers
    stream_once_tok_s: float  # every touched expert crosses the link once
    states_bytes: int  # layer-major's hidden states; 0 on the normal path
    states_placement: str  # "vram", "pinned", "normal path" (one chunk) or "no VRAM room"
    states_pcie_bytes: int  # pinned states' traffic per prompt, both directions


class PrefillOutlook(msgspec.Struct, frozen=True):
    chunk_tokens: int
    layer_major: str  # its status (LAYER_MAJOR_STATUS)
    rows: list[PrefillRow]


def touched(rates: list[float], tokens: int) -> list[float]:
    """Probability that `tokens` tokens touch each expert (per-token pick rates `rates`)."""
    return [1.0 - (1.0 - min(1.0, r)) ** tokens for r in rates]


class _Link(msgspec.Struct, frozen=True):
    """One MoE layer's traffic for a step: host-to-device expert bytes and store bytes."""

    pcie_bytes: float
    store_bytes: float


def _moe_link(p: list[float], resident: float, near: float, eb: int) -> _Link:
    """Touched experts (probabilities p, hottest first) not among the `resident` hottest cross
    PCIe; those not among the `near` hottest (VRAM + RAM tier) come from the store first."""
    pcie = store = 0.0
    for rank, pr in enumerate(p):
        pcie += pr * (1.0 - min(1.0, max(0.0, resident - rank))) * eb
        store += pr * (1.0 - min(1.0, max(0.0, near - rank))) * eb
    return _Link(pcie, store)


def chunked_compute_s(x: CostInputs, geo: Geometry, prompt_tokens: int, chunk_tokens: int) -> float:
    """GPU compute of a prompt run at `chunk_tokens`-token chunks, in either order: every chunk
    of every layer pays the layer's fixed cost per chunk (layer-major runs each chunk through
    a layer as its own forward, the same kernels as chunk-major), plus the cost per token."""
    return sum(_chunk_compute_s(x, geo, n) for n in chunk_lengths(prompt_tokens, chunk_tokens))


def _step_s(
    x: CostInputs,
    geo: Geometry,
    tokens: int,
    resident_slots: float,
    states: HiddenStatePlan | None,
    compute_s: float | None = None,
    pcie_bytes: float | None = None,
) -> float:
    """One pass of `tokens` tokens through every layer: per layer the slower of compute and
    link, plus store reads. `compute_s`: the pass's GPU compute when it is not one chunk of
    `tokens` (layer-major: every chunk of the prompt through each layer). `pcie_bytes`: a MoE
    layer's expert bytes over the link when they are not the `tokens` tokens' touched experts
    once (layer-major in the store modes: each chunk reads its picks zero-copy)."""
    eb, _, _ = _expert_ms(x, geo)
    if compute_s is None:
        compute_s = _chunk_compute_s(x, geo, tokens)
    compute = compute_s / geo.num_layers
    p = touched(_pick_rates(geo), tokens)
    resident = resident_slots / geo.num_moe_layers
    near = geo.experts_per_layer
    if x.ram_tier_slots is not None:
        near = (x.vram_slots + x.ram_tier_slots) / geo.num_moe_layers
    link = _moe_link(p, resident, near, eb)
    if pcie_bytes is not None:
        link = _Link(pcie_bytes, link.store_bytes)
    elif x.stage_records is not None and link.pcie_bytes > 0:  # the stage copies these records
        link = _Link(x.stage_records * eb, link.store_bytes)
    rate = x.pcie_gbps * 1e9
    store = link.store_bytes / (x.store_gbps * 1e9) if x.store_gbps else 0.0
    first_moe = geo.num_layers - geo.num_moe_layers  # glm5_next: dense layers come first
    moe_end = first_moe + geo.prefill_moe_layers  # the last layer's MLP never runs in prefill
    seconds = 0.0
    for layer in range(geo.num_layers):
        h2d = link.pcie_bytes if first_moe <= layer < moe_end else 0.0
        d2h = 0.0
        if states is not None:
            h2d += states.h2d_bytes_per_layer if layer > 0 else 0
            d2h = states.d2h_bytes_per_layer if layer < geo.num_layers - 1 else 0
        if states is None and (layer == first_moe or not x.stage_overlap):
            # PrefillStager stages a chunk's first MoE layer on the main stream after its
            # router (nothing ran before it to hide the copy behind); an SM gather stage
            # (stage_overlap False) runs after the compute in every layer
            seconds += compute + h2d / rate
        else:
            seconds += max(compute, h2d / rate, d2h / rate)
        seconds += store if first_moe <= layer < moe_end else 0.0
    return seconds


def predict_prefill(
    x: CostInputs, geo: Geometry, prompt_tokens: int, chunk_tokens: int = CHUNK_TOKENS
) -> PrefillRow:
    """Chunk-major, layer-major and the bounds for one prompt length (see the module doc)."""
    eb, _, _ = _expert_ms(x, geo)
    rates = _pick_rates(geo)
    chunks = chunk_lengths(prompt_tokens, chunk_tokens)
    chunk_s = sum(_step_s(x, geo, n, x.vram_slots, None) for n in chunks)
    layer_tok_s: float | None = prompt_tokens / chunk_s
    states, placement, states_pcie = 0, "normal path", 0
    if uses_layer_major(prompt_tokens, chunk_tokens):
        streams = StreamGeometry(geo.hidden_size, geo.hc_mult, geo.num_layers)
        try:
            plan = plan_hidden_states(streams, prompt_tokens, chunk_tokens, x.vram_slots * eb)
        except ValueError:  # not even two chunks of states fit beside the model: it cannot run
            layer_tok_s, placement = None, "no VRAM room"
            states = hidden_state_bytes(streams, prompt_tokens)
        else:
            lent = lent_cache_slots(plan, 0, eb)  # the doctor's slots leave no VRAM free
            compute_s = chunked_compute_s(x, geo, prompt_tokens, chunk_tokens)
            per_chunk = None
            if x.ram_tier_slots is not None:  # the store modes: unstaged, zero-copy per chunk
                resident = (x.vram_slots - lent) / geo.num_moe_layers
                per_chunk = sum(
                    _moe_link(touched(rates, n), resident, geo.experts_per_layer, eb).pcie_bytes
                    for n in chunks
                )
            step_s = _step_s(x, geo, prompt_tokens, x.vram_slots - lent, plan, compute_s,
                             per_chunk)  # fmt: skip
            layer_tok_s = prompt_tokens / step_s
            states, placement = plan.state_bytes, str(plan.placement)
            states_pcie = plan.h2d_bytes_per_prompt + plan.d2h_bytes_per_prompt
    once = geo.prefill_moe_layers * sum(touched(rates, prompt_tokens)) * eb / (x.pcie_gbps * 1e9)
    return PrefillRow(
        prompt_tokens=prompt_tokens,
        num_chunks=num_chunks(prompt_tokens, chunk_tokens),
        touched_per_layer_chunk=round(sum(touched(rates, min(chunk_tokens, prompt_tokens))), 1),
        touched_per_layer_prompt=round(sum(touched(rates, prompt_tokens)), 1),
        compute_tok_s=round(
            prompt_tokens / chunked_compute_s(x, geo, prompt_tokens, chunk_tokens), 1
        ),
        chunk_major_tok_s=round(prompt_tokens / chunk_s, 1),
        layer_major_tok_s=None if layer_tok_s is None else round(layer_tok_s, 1),
        stream_once_tok_s=round(prompt_tokens / once, 1),
        states_bytes=states,
        states_placement=placement,
        states_pcie_bytes=states_pcie,
    )


def prefill_outlook(
    x: CostInputs, geo: Geometry, chunk_tokens: int = CHUNK_TOKENS
) -> PrefillOutlook:
    """predict_prefill at every PREFILL_PROMPTS length, labelled with layer-major's status."""
    rows = [predict_prefill(x, geo, n, chunk_tokens) for n in PREFILL_PROMPTS]
    return PrefillOutlook(chunk_tokens=chunk_tokens, layer_major=LAYER_MAJOR_STATUS, rows=rows)
