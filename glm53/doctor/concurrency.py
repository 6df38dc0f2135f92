"""Decode at concurrency B for every mode, with costmodel.predict's own layer model.

B streams in one step pick, per MoE layer, the distinct experts any of them picks: expert e
(pick rate r_e on the popularity curve, costmodel._pick_rates) with probability
1 - (1 - r_e)^B. Those distinct picks split into VRAM, RAM and store by rank, as
exact_decode_ms splits them (the hottest vram_slots / num_moe_layers of each layer resident,
then the RAM tier's), and go to the same lanes as at concurrency 1 (costmodel._layer: the GPU,
the CPU lane at the best share, the store). The expected number of distinct picks is not a
whole number: the layer cost is interpolated between its floor and its ceiling. A CPU-lane job
carries B x top_k / distinct rows per expert on average, and its b grows with them
(lane_model.rows_factor). Non-MoE work is the same as at concurrency 1 (bandwidth and launch
bound at these few rows).

At B = 1 this is predict(...).ms_per_token up to the curve's interpolation between ranks; in
exact mode it is exact_decode_ms at every B."""

from __future__ import annotations

import math

from glm53.doctor.costmodel import (
    CONTROLLER_MS_PER_LAYER,
    LANE_MODES,
    STORE_MODES,
    CostInputs,
    Mode,
    _expert_ms,
    _layer,
    _multinomial,
    _pick_rates,
    non_moe_ms,
)
from glm53.doctor.geometry import GLM53_FLASH, Geometry
from glm53.doctor.lane_model import rows_factor


def _shares(x: CostInputs, geo: Geometry, mode: Mode, batch: int) -> tuple[float, list[float]]:
    """(expected distinct picks per layer, [VRAM, RAM, store] shares of them)."""
    vram = x.vram_slots / geo.num_moe_layers
    near = geo.experts_per_layer
    if mode in STORE_MODES:
        near = (x.vram_slots + x.ram_tier_slots) / geo.num_moe_layers
    n = pv = pr = 0.0
    for rank, rate in enumerate(_pick_rates(geo)):
        picked = 1.0 - (1.0 - min(1.0, rate)) ** batch
        in_vram = min(1.0, max(0.0, vram - rank))
        in_near = min(1.0, max(0.0, near - rank))
        n += picked
        pv += picked * in_vram
        pr += picked * max(0.0, in_near - in_vram)
    return n, [pv / n, pr / n, max(0.0, 1.0 - (pv + pr) / n)]


def decode_ms(mode: Mode, x: CostInputs, geo: Geometry = GLM53_FLASH, batch: int = 1) -> float:
    """One decode step of `batch` streams in ms (each stream gets one token)."""
    if mode in LANE_MODES and (x.lane_a_ms is None or x.lane_b_ms is None):
        raise ValueError(f"mode {mode}: needs the CPU lane's lane_a_ms and lane_b_ms")
    if mode in STORE_MODES and (
        x.ram_tier_slots is None or x.store_gbps is None or x.store_latency_ms is None
    ):
        raise ValueError(f"mode {mode}: needs ram_tier_slots, store_gbps and store_latency_ms")
    eb, t_hit, t_copy = _expert_ms(x, geo)
    distinct, (pv, pr, pn) = _shares(x, geo, mode, batch)
    lane = None
    if mode in LANE_MODES:
        lane = (x.lane_a_ms, x.lane_b_ms * rows_factor(batch * geo.top_k / distinct))
    t_read = t_first = 0.0
    if mode in STORE_MODES:
        t_read, t_first = eb / (x.store_gbps * 1e6), x.store_latency_ms

    def layer_at(n: int) -> float:
        return sum(
            p * _layer(nv, nr, nn, t_hit, t_copy, lane, t_read, t_first)[0]
            for p, nv, nr, nn in _multinomial(n, pv, pr, pn)
        )

    low = math.floor(distinct + 1e-9)
    frac = distinct - low if distinct - low > 1e-9 else 0.0
    layer_ms = layer_at(low) * (1 - frac) + (layer_at(low + 1) * frac if frac else 0.0)
    controller = 0.0 if mode == Mode.EXACT else CONTROLLER_MS_PER_LAYER
    return non_moe_ms(x, geo) + geo.num_moe_layers * (controller + layer_ms)
