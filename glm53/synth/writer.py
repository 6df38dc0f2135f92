"""Write a synthetic GLM-5.3-Flash EXL3 checkpoint, shard by shard.

Each shard's header is computed from the tensor plan first, then every tensor is generated and
written in file order (synth/tensors.py), so at most one tensor is in memory at a time.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glm53.models.checkpoint import MUL1_MARKER
from glm53.models.tokenizer import token_ids, write_json, write_tokenizer
from glm53.synth import routing
from glm53.synth.decode_fit import calibrate_on_decode
from glm53.synth.layout import (
    TensorSpec,
    model_config,
    plan,
    processor_config,
    quantization_config,
    router_keys,
)
from glm53.synth.shapes import SynthShape
from glm53.synth.tensors import encode, generate, header_bytes

CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "chat" / "chat_template.jinja"
DEFAULT_SHARD_BYTES = 2 << 30
ROUTER_CALIBRATION_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class RoutingReport:
    """Measured popularity curve (and decode locality) of each MoE layer."""

    mode: str
    source: str  # what the router inputs were: "stand-in inputs" or "greedy decode"
    curves: dict[int, routing.PopularityCurve]
    reuse: dict[int, float]

    def lines(self) -> list[str]:
        target = routing.target_shares(self.mode)
        out = [
            f"routing {self.mode} measured on {self.source}; target "
            + " ".join(
                f"{int(f * 100)}%->{t * 100:.1f}%"
                for f, t in zip(routing.CURVE_FRACTIONS, target, strict=True)
            )
        ]
        for layer, curve in self.curves.items():
            out.append(
                f"  layer {layer:3d}: {curve}  max err {curve.max_error(target) * 100:.1f} pts, "
                f"reuse {self.reuse[layer] * 100:.0f}%"
            )
        return out


def split_shards(groups: list[list[TensorSpec]], shard_bytes: int) -> list[list[TensorSpec]]:
    """Pack whole groups (one layer each) into shards of about shard_bytes; a group larger than
    a shard is split at tensor boundaries."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for group in groups:
        for spec in group:
            if shards[-1] and size + spec.nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
    return shards


def write_shard(
    path: Path, specs: list[TensorSpec], seed: int, overrides: dict[str, np.ndarray]
) -> None:
    """One shard: its header, then each tensor generated and written in file order."""
    with open(path, "wb") as f:
        f.write(header_bytes(specs))
        for spec in specs:
            values = overrides[spec.key] if spec.key in overrides else generate(spec, seed)
            data = encode(spec, values)
            if len(data) != spec.nbytes:
                raise AssertionError(f"{spec.key}: {len(data)} bytes, planned {spec.nbytes}")
            f.write(data)


class SynthWriter:
    """Writes one synthetic checkpoint; `overrides` replaces planned values (router tensors)."""

    def __init__(self, shape: SynthShape, seed: int, out_dir: Path):
        self.shape = shape
        self.seed = seed
        self.out_dir = Path(out_dir)
        self.overrides: dict[str, np.ndarray] = {}

    def write_shards(self, shard_bytes: int, jobs: int = 1) -> None:
        """Write every shard and the index; with jobs > 1, that many shards at a time in
        worker processes (each tensor's bytes depend only on the seed and its key, so the
        files are the same either way)."""
        shards = split_shards(plan(self.shape), shard_bytes)
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        work = [
            (self.out_dir / name, specs, self.seed,
             {t.key: self.overrides[t.key] for t in specs if t.key in self.overrides})
            for name, specs in zip(names, shards, strict=True)
        ]  # fmt: skip
        if jobs > 1 and len(shards) > 1:
            # spawn, not fork: the parent has run torch, whose threads a fork would not carry
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(min(jobs, len(shards)), mp_context=ctx) as pool:
                list(pool.map(write_shard, *zip(*work, strict=True)))
        else:
            for args in work:
                write_shard(*args)
        weight_map = {t.key: name for name, specs in zip(names, shards, strict=True) for t in specs}
        total = sum(t.nbytes for specs in shards for t in specs)
        write_json(
            self.out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )

    def write_metadata(self) -> None:
        ids = token_ids()
        s = self.shape
        write_json(self.out_dir / "config.json", model_config(s, ids))
        qcfg = quantization_config(s)
        qcfg["tensor_storage"] = tensor_storage(plan(s))
        write_json(self.out_dir / "quantization_config.json", qcfg)
        write_json(self.out_dir / "processor_config.json", processor_config())
        template = read_chat_template()
        (self.out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
        write_tokenizer(self.out_dir, s.vocab_size, template, s.max_position_embeddings)

    def calibrate_on_stand_in_inputs(self, mode: str) -> RoutingReport:
        """Fit every MoE layer's selection bias on stand-in router inputs (the router math only)."""
        s = self.shape
        curves, reuse = {}, {}
        for layer in s.moe_layers:
            gate_key, bias_key = router_keys(layer)
            gate_spec = TensorSpec(
                gate_key, "F16", (s.num_experts, s.hidden_size), "normal", s.hidden_size**-0.5
            )
            weight = torch.from_numpy(
                generate(gate_spec, self.seed).astype(np.float16).astype(np.float32)
            )
            fit_x = routing.hidden_like_inputs(
                ROUTER_CALIBRATION_TOKENS, s.hidden_size, self.seed, layer
            )
            bias = fit_layer_bias(mode, weight, fit_x, s, self.seed, layer)
            self.overrides[bias_key] = bias.numpy()
            # measure on fresh stand-in inputs, not the ones the bias was fitted on
            check_x = routing.hidden_like_inputs(
                ROUTER_CALIBRATION_TOKENS, s.hidden_size, self.seed + 1, layer
            )
            picks = routing.select(
                routing.router_scores(check_x, weight), bias, s.num_experts_per_tok
            )
            curves[layer] = routing.popularity_curve(routing.pick_counts(picks, s.num_experts))
            reuse[layer] = routing.reuse_rate(picks)
        return RoutingReport(mode, "stand-in inputs", curves, reuse)


def fit_layer_bias(
    mode: str, weight: torch.Tensor, x: torch.Tensor, s: SynthShape, seed: int, layer: int
) -> torch.Tensor:
    rates = routing.target_pick_rates(mode, s.num_experts, s.num_experts_per_tok)
    target = np.empty(s.num_experts)
    target[routing.hot_order(s.num_experts, seed, layer)] = rates
    scores = routing.router_scores(x, weight)
    return routing.fit_bias(scores, target, s.num_experts_per_tok)


def tensor_storage(groups: list[list[TensorSpec]]) -> dict:
    """quantization_config.json's per-module listing, as exllamav3's converter writes it."""
    modules: dict[str, dict] = {}
    torch_dtype = {
        "F32": "torch.float32",
        "F16": "torch.float16",
        "BF16": "torch.bfloat16",
        "I16": "torch.int16",
        "I32": "torch.int32",
    }
    for spec in (t for g in groups for t in g):
        module, _, leaf = spec.key.rpartition(".")
        entry = modules.setdefault(module, {"stored_tensors": {}})
        entry["stored_tensors"][spec.key] = {
            "shape": list(spec.shape),
            "n_bytes": spec.nbytes,
            "dtype": torch_dtype[spec.dtype],
        }
        if leaf == "trellis":
            entry["quant_format"] = "exl3"
            entry["bits_per_weight"] = spec.shape[-1] // 16
            entry["mul1_multiplier"] = MUL1_MARKER & 0xFFFFFFFF
    return modules


def read_chat_template() -> str:
    if not CHAT_TEMPLATE_PATH.is_file():
        raise FileNotFoundError(
            f"{CHAT_TEMPLATE_PATH} is missing; the synthetic checkpoint ships the project's "
            "GLM-5.3-Flash chat template from that path (reinstall glm53)"
        )
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")


def write_checkpoint(
    shape: SynthShape,
    out_dir: str | Path,
    seed: int = 0,
    routing_mode: str = "glm53",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    routing_source: str = "auto",
    jobs: int = 1,
) -> RoutingReport:
    """Write the checkpoint into out_dir (created; must be empty) and return its routing report.

    routing_source: "stand-in" fits the router bias on stand-in inputs only; "decode" then
    refits and measures it on the checkpoint's own greedy decoding (the CPU runs the model, so
    only for CPU-sized checkpoints); "auto" is "decode" for the demo preset, else "stand-in".
    jobs: shards written at a time (worker processes); the bytes do not depend on it."""
    shape.check()
    routing.target_shares(routing_mode)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    writer = SynthWriter(shape, seed, out)
    writer.write_metadata()
    report = writer.calibrate_on_stand_in_inputs(routing_mode)
    writer.write_shards(shard_bytes, jobs)
    if routing_source == "auto":
        routing_source = "decode" if shape.name == "demo" else "stand-in"
    if routing_source == "stand-in":
        return report
    if routing_source != "decode":
        raise ValueError(f"routing_source {routing_source!r} is not auto, decode or stand-in")
    curves, reuse = calibrate_on_decode(out, routing_mode, seed)
    return RoutingReport(routing_mode, "greedy decode", curves, reuse)
