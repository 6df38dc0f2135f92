"""`glm53 doctor` on a host with two or more GPUs, or with `--gpus`: the layer split per GPU
(glm53.plan.split, with the engine's own VRAM accounting at serve's defaults) and a
PREDICTION of exact mode's decode over it, beside one GPU alone and one GPU holding the same
total cache. The split has run only on one GPU (--gpus 0,0 on an H200 and on an H100,
2026-12-05: its GPU tests passed, and serve runs it without --allow-unrun-modes), never over two
distinct devices, which serve runs only with --allow-unrun-modes (docs/multi-gpu.md).

The prediction is the cost model's (costmodel.predict) at the split's total expert slots, plus
an explicit hop: at every device boundary each token's hidden state (the mHC residual streams,
hop_bytes_per_token) crosses PCIe, at HOP_LATENCY_MS plus its bytes over the slowest listed
link. Inputs (PCIe, VRAM bandwidth, fp16 rate) are the slowest of the listed GPUs'.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import msgspec

from glm53.doctor.costmodel import CostInputs, Mode, predict
from glm53.doctor.geometry import model_geometry
from glm53.plan import split as mg

# A small device-to-device copy of one token's hidden state and the wait for it: a few
# microseconds of copy-engine latency on each side of the link plus a stream event. Assumed,
# not measured (no two-GPU machine was lent); the one figure a two-GPU run should replace.
HOP_LATENCY_MS = 0.015
FLASH_VOCAB = 154_880


class MultiGpuOutlook(msgspec.Struct):
    """The split over `gpus` and what it predicts; `reason` says why there is no split."""

    gpus: list[int]
    chosen_by: str  # "--gpus" or "every GPU of this host"
    settings: str  # the serve settings the VRAM plan assumes
    reason: str = ""
    split: mg.SplitPlan | None = None
    one_gpu_slots: int | None = None  # the first listed GPU alone, same accounting
    hop_ms_per_token: float | None = None
    decode_tok_s: float | None = None  # predicted over the split, hops included
    one_gpu_decode_tok_s: float | None = None  # the first GPU alone (its own cache)
    same_cache_decode_tok_s: float | None = None  # one GPU with the split's total cache
    two_gpu_vs_one_gpu_same_cache: float | None = None  # the ratio bench/multi_gpu.py measures
    label: str = ""  # what the figures are and where the split stands (set by outlook)


@functools.cache
def flash_tensors() -> tuple[dict[str, int], dict]:
    """GLM-5.3-Flash's tensor sizes and text config as the synthetic writer lays them out for
    exllamav3 1.6.5's glm5_next loader (the deep preset's 45-layer cycle at the real widths, with
    the real 288 experts per layer and the real vocabulary)."""
    from glm53.models.tokenizer import token_ids
    from glm53.synth.layout import plan, text_config
    from glm53.synth.shapes import DEEP

    shape = dataclasses.replace(DEEP, name="flash", num_experts=288, vocab_size=FLASH_VOCAB)
    tensors = {t.key: t.nbytes for group in plan(shape) for t in group}
    return tensors, text_config(shape, token_ids())


def checkpoint_tensors(model_dir: str | None) -> tuple[dict[str, int], dict]:
    """The checkpoint's own tensor sizes and text config (--model DIR), else GLM-5.3-Flash's."""
    if model_dir and os.path.isfile(os.path.join(model_dir, "config.json")):
        from glm53.models.checkpoint import Checkpoint

        ckpt = Checkpoint(model_dir)
        return {k: i.nbytes for k, i in ckpt.tensors.items()}, ckpt.text_config
    return flash_tensors()


def serve_defaults() -> tuple[int, int, int, float]:
    """(cache tokens, max batch, chunk, reserve GiB) the GPU engine uses at serve's defaults."""
    from glm53.config import Settings
    from glm53.exl3 import PAGE

    s = Settings()
    return s.max_batch * -(-s.context // PAGE) * PAGE, s.max_batch, s.chunk_size, s.ec_reserve_gb


def label(gpus: list[int]) -> str:
    """What an outlook's figures are, and whether serve runs this split without
    --allow-unrun-modes (glm53.modes.UNRUN["split"]: two or more distinct GPUs)."""
    ran = "the split has run only on one GPU, as 0,0, never over two distinct GPUs"
    if len(set(gpus)) > 1:
        return f"prediction (cost model; {ran}: serve needs --allow-unrun-modes for it)"
    return f"prediction (cost model; {ran}: serve runs this one without --allow-unrun-modes)"


def outlook(gpus_free: dict[int, int], listed: list[int] | None, model_dir: str | None,
            link: dict[str, float], ec_max_slots: int | None = None) -> MultiGpuOutlook:  # fmt: skip
    """The split over `listed` (--gpus; None: every GPU in index order) on GPUs with
    `gpus_free` bytes free, and its prediction with the cost-model inputs in `link` (pcie_gbps,
    vram_gbps, gpu_fp16_tflops: the slowest listed GPU's). A --gpus the planner refuses raises
    ValueError; a host whose GPUs together cannot hold the split gets a reason instead."""
    chosen_by = "--gpus" if listed else "every GPU of this host"
    listed = list(listed) if listed else None
    gpus = list(listed) if listed else sorted(gpus_free)
    tensors, tc = checkpoint_tensors(model_dir)
    tokens, batch, chunk, reserve = serve_defaults()
    settings = f"cache of {tokens:,} tokens, --max-batch {batch}, --chunk-size {chunk}, "
    settings += f"--ec-reserve-gb {reserve:g} (serve's defaults)"
    out = MultiGpuOutlook(gpus=gpus, chosen_by=chosen_by, settings=settings, label=label(gpus))
    layers = mg.model_layers(tensors, tc)
    x = mg.split_inputs(layers, gpus, gpus_free, tc, tokens, batch, chunk, reserve,
                        ec_max_slots=ec_max_slots)  # fmt: skip
    try:
        split = mg.plan_split(x)
    except ValueError as e:
        if listed:
            raise
        out.reason = str(e)
        return out
    out.split = split
    try:
        one = mg.plan_split(msgspec.structs.replace(x, gpus=(gpus[0],)))
        out.one_gpu_slots = one.total_slots
    except ValueError:
        one = None
    geo = model_geometry(model_dir)
    base = CostInputs(vram_slots=0, **link)
    hop = HOP_LATENCY_MS + split.hop_bytes_per_token / (link["pcie_gbps"] * 1e6)
    out.hop_ms_per_token = round(split.boundaries * hop, 4)
    same = predict(Mode.EXACT, msgspec.structs.replace(base, vram_slots=split.total_slots), geo)
    ms = same.ms_per_token + split.boundaries * hop
    out.decode_tok_s = round(1000 / ms, 2)
    out.same_cache_decode_tok_s = same.decode_tok_s
    out.two_gpu_vs_one_gpu_same_cache = round(same.ms_per_token / ms, 4)
    if one is not None:
        alone = msgspec.structs.replace(base, vram_slots=one.total_slots)
        out.one_gpu_decode_tok_s = predict(Mode.EXACT, alone, geo).decode_tok_s
    return out
