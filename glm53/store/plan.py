"""What goes into a store: the routed experts of a glm5_next EXL3 checkpoint, all of one shape.

`plan_store` reads only JSON files and safetensors headers. It refuses a checkpoint that is not
GLM-5.3-Flash EXL3, one with missing shards or tensors, and one whose routed experts do not all
have the shapes the config implies; each refusal is a StoreError naming the thing and the fix.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from glm53.models.checkpoint import Checkpoint, ExpertTensors, TensorInfo
from glm53.store.errors import StoreError, StoreMismatchError, reason
from glm53.store.format import (
    ALIGN,
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    ORDER,
    PROJECTIONS,
    Fingerprint,
    Manifest,
    RecordLayout,
    StoreLayer,
    layout_of,
    record_layout,
)

MODEL_TYPE = "glm5_next"
FETCH_HINT = "download it with `glm53 download` (or make a test one with `glm53 synth`)"
_EXPERT_TRELLIS = re.compile(r"^(.*\.layers\.(\d+)\.mlp\.experts)\.\d+\.gate_proj\.trellis$")
_HF_METADATA = Path(".cache") / "huggingface" / "download" / "config.json.metadata"


@dataclass(frozen=True, slots=True)
class StorePlan:
    """The records of a store-to-be: experts[store_layer][expert], one layout for all."""

    checkpoint: Checkpoint
    layers: tuple[StoreLayer, ...]
    experts: tuple[tuple[ExpertTensors, ...], ...]
    layout: RecordLayout
    bits: int
    codebook: str
    codebook_marker: int | None
    hidden_size: int
    moe_intermediate_size: int
    fingerprint: Fingerprint

    @property
    def experts_per_layer(self) -> int:
        return len(self.experts[0])

    @property
    def num_records(self) -> int:
        return len(self.layers) * self.experts_per_layer

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_records * self.record_bytes

    def expert(self, record: int) -> ExpertTensors:
        return self.experts[record // self.experts_per_layer][record % self.experts_per_layer]

    def describe_record(self, record: int) -> str:
        layer, expert = divmod(record, self.experts_per_layer)
        mtp = ", MTP" if self.layers[layer].is_mtp else ""
        return f"record {record} (layer {self.layers[layer].model_layer}{mtp}, expert {expert})"

    def manifest(self, sha256: list[str]) -> Manifest:
        return Manifest(
            format=FORMAT_NAME,
            version=FORMAT_VERSION,
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            model_dir=str(self.checkpoint.directory.resolve()),
            data_file=DATA_FILE,
            order=ORDER,
            align=ALIGN,
            record_bytes=self.record_bytes,
            slot_bytes=self.layout.slot_bytes,
            trellis_bytes=tuple(f.nbytes for f in self.layout.fields[:3]),
            bits=self.bits,
            codebook=self.codebook,
            codebook_marker=self.codebook_marker,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            experts_per_layer=self.experts_per_layer,
            num_layers=len(self.layers),
            layers=list(self.layers),
            fields=list(self.layout.fields),
            fingerprint=self.fingerprint,
            sha256=list(sha256),
            total_bytes=self.total_bytes,
        )


def plan_store(model_dir: str | Path, include_mtp: bool = True) -> StorePlan:
    directory = Path(model_dir)
    config, quant = _check_checkpoint_files(directory)
    try:
        ckpt = Checkpoint(directory)
    except (ValueError, OSError) as exc:
        raise StoreError(f"cannot read checkpoint {directory}: {reason(exc)}") from None
    text = ckpt.text_config
    try:
        hidden = int(text["hidden_size"])
        inter = int(text["moe_intermediate_size"])
        num_experts = int(text["n_routed_experts"])
        num_mtp = int(text.get("num_nextn_predict_layers", 0))
        moe_layers = ckpt.moe_layers
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise StoreError(
            f"{directory / 'config.json'}: text config lacks or mangles {exc}; the config is not "
            f"a GLM-5.3-Flash one: {FETCH_HINT}"
        ) from None
    if not moe_layers or num_experts < 1:
        raise StoreError(f"{directory}: the config lists no MoE layer with routed experts")

    layers = [
        StoreLayer(i, layer, f"{ckpt.prefix}.layers.{layer}.mlp.experts")
        for i, layer in enumerate(moe_layers)
    ]
    if include_mtp and num_mtp:
        found = _expert_prefixes(ckpt)
        for layer in range(ckpt.num_layers, ckpt.num_layers + num_mtp):
            if layer not in found:
                raise StoreError(
                    f"{directory}: the config has MTP layer {layer} but no shard holds its routed "
                    "experts (is mtp.safetensors missing?); restore the file, or pack without "
                    "the MTP layer (--no-mtp)"
                )
            layers.append(StoreLayer(len(layers), layer, found[layer], is_mtp=True))

    experts = tuple(tuple(_expert(ckpt, layer, e) for e in range(num_experts)) for layer in layers)
    first = experts[0][0]
    bits = first.gate.bits
    arrays = _expected_arrays(hidden, inter, bits)
    why = f"hidden_size {hidden}, moe_intermediate_size {inter}, {bits} bits like expert 0"
    for expert in (e for layer in experts for e in layer):
        _check_shapes(expert, arrays, why, first.gate.codebook)
    layout = record_layout(arrays)
    marker = _marker_value(ckpt, first.gate.marker)
    return StorePlan(
        checkpoint=ckpt,
        layers=tuple(layers),
        experts=experts,
        layout=layout,
        bits=bits,
        codebook=first.gate.codebook,
        codebook_marker=marker,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        fingerprint=fingerprint(ckpt, config, quant, experts),
    )


# --- checkpoint checks ---------------------------------------------------------------------


def _check_checkpoint_files(directory: Path) -> tuple[dict, dict]:
    """(config, quantization config) of a GLM-5.3-Flash EXL3 checkpoint with all its shards."""
    if not directory.is_dir():
        raise StoreError(f"--model {directory} is not a directory; {FETCH_HINT}")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise StoreError(
            f"{directory} has no config.json, so it is not a checkpoint directory; point --model "
            f"at the GLM-5.3-Flash EXL3 checkpoint ({FETCH_HINT})"
        )
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{config_path} is not valid JSON ({exc}); {FETCH_HINT} again") from None
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise StoreError(
            f"{directory} is a {model_type!r} checkpoint, not GLM-5.3-Flash (model_type "
            f"{MODEL_TYPE!r}); point --model at the GLM-5.3-Flash EXL3 checkpoint ({FETCH_HINT})"
        )
    quant = _quantization(directory, config)
    method = quant.get("quant_method") if quant else None
    if method != "exl3":
        found = "no quantization_config" if quant is None else f"quant_method {method!r}"
        raise StoreError(
            f"{directory} is not an EXL3 checkpoint ({found}); the store packs EXL3 trellis "
            f"experts: use the EXL3 quantization (turboderp/GLM-5.3-Flash-exl3; {FETCH_HINT})"
        )
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise StoreError(f"{index_path} is not a safetensors index ({exc})") from None
        missing = sorted(f for f in set(weight_map.values()) if not (directory / f).is_file())
        if missing:
            listed = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if missing[5:] else ""
            )
            raise StoreError(
                f"{directory} is missing {len(missing)} shard(s) listed in {index_path.name}: "
                f"{listed}; the download is incomplete: rerun `glm53 download` (it resumes) or "
                "copy the missing files"
            )
    return config, quant


def _quantization(directory: Path, config: dict) -> dict | None:
    path = directory / "quantization_config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{path} is not valid JSON ({exc}); {FETCH_HINT} again") from None
    return config.get("quantization_config")


def _expert_prefixes(ckpt: Checkpoint) -> dict[int, str]:
    """Model layer -> key prefix of its routed experts, from the tensor keys."""
    found: dict[int, str] = {}
    for key in ckpt.tensors:
        m = _EXPERT_TRELLIS.match(key)
        if m:
            found.setdefault(int(m.group(2)), m.group(1))
    return found


def _expert(ckpt: Checkpoint, layer: StoreLayer, expert: int) -> ExpertTensors:
    linears = []
    for proj in PROJECTIONS:
        key = f"{layer.prefix}.{expert}.{proj}_proj"
        try:
            linears.append(ckpt.linear(key))
        except KeyError as exc:
            raise StoreError(
                f"{exc.args[0]}: no shard holds it, so the checkpoint is incomplete (a missing "
                f"or truncated shard?); {FETCH_HINT} again"
            ) from None
        except ValueError as exc:
            raise StoreError(
                f"{ckpt.directory}: {exc}; the checkpoint is inconsistent: {FETCH_HINT} again"
            ) from None
    return ExpertTensors(layer.model_layer, expert, *linears)


def _expected_arrays(hidden: int, inter: int, bits: int) -> dict[str, tuple[str, tuple, int]]:
    """name -> (dtype, shape, bytes) of every record field, from the config's widths."""
    out = {}
    for proj, (k, n) in zip(
        PROJECTIONS, ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True
    ):
        out[f"{proj}.trellis"] = ("I16", (k // 16, n // 16, 16 * bits), k * n * bits // 8)
        out[f"{proj}.suh"] = ("F16", (k,), 2 * k)
        out[f"{proj}.svh"] = ("F16", (n,), 2 * n)
    return out


def _check_shapes(expert: ExpertTensors, arrays: dict, why: str, codebook: str) -> None:
    for proj, lin in zip(PROJECTIONS, expert.linears, strict=True):
        for part, info in (("trellis", lin.trellis), ("suh", lin.suh), ("svh", lin.svh)):
            dtype, shape, _ = arrays[f"{proj}.{part}"]
            if info.shape != shape or info.dtype != dtype:
                raise StoreError(
                    f"tensor {info.key} is {info.dtype} {list(info.shape)}, expected {dtype} "
                    f"{list(shape)} ({why}); the checkpoint is inconsistent: {FETCH_HINT} again"
                )
        if lin.codebook != codebook:
            raise StoreError(
                f"{lin.key} uses the {lin.codebook} codebook, the first routed expert {codebook}; "
                "a store holds one codebook: the checkpoint is inconsistent"
            )


def _marker_value(ckpt: Checkpoint, marker: TensorInfo | None) -> int | None:
    if marker is None:
        return None
    return int(np.asarray(ckpt.read(marker.key)).reshape(-1)[0])


# --- fingerprint ---------------------------------------------------------------------------


def _canonical_sha256(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def hub_revision(directory: Path) -> str | None:
    """The commit `huggingface_hub` recorded when it downloaded config.json, if it did."""
    try:
        first = (directory / _HF_METADATA).read_text().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError):
        return None
    return first if re.fullmatch(r"[0-9a-f]{40}", first) else None


def fingerprint(ckpt: Checkpoint, config: dict, quant: dict, experts) -> Fingerprint:
    h, count = hashlib.sha256(), 0
    for expert in (e for layer in experts for e in layer):
        for lin in expert.linears:
            for info in (lin.trellis, lin.suh, lin.svh, lin.marker):
                if info is None:
                    continue
                line = (
                    f"{info.key}\t{info.path.name}\t{info.offset_bytes}\t{info.nbytes}\t"
                    f"{info.dtype}\t{list(info.shape)}\n"
                )
                h.update(line.encode())
                count += 1
    return Fingerprint(
        model_type=str(config.get("model_type")),
        config_sha256=_canonical_sha256(config),
        quantization_sha256=_canonical_sha256(quant),
        tensors_sha256=h.hexdigest(),
        num_tensors=count,
        sample_sha256=_content_sample(ckpt, experts),
        revision=hub_revision(ckpt.directory),
    )


def _content_sample(ckpt: Checkpoint, experts) -> str:
    """sha256 of the gate suh and down svh of the first and last expert of every layer: a
    few KB per layer that tell apart checkpoints whose files have the same layout."""
    h = hashlib.sha256()
    for layer in experts:
        for expert in (layer[0], layer[-1]):
            for info in (expert.gate.suh, expert.down.svh):
                h.update(info.key.encode())
                h.update(np.ascontiguousarray(ckpt.read(info.key)).tobytes())
    return h.hexdigest()


def fingerprint_difference(store: Fingerprint, here: Fingerprint) -> str:
    """What differs between two fingerprints, as a phrase; "" when they match."""
    out = []
    if store.revision and here.revision and store.revision != here.revision:
        out.append(f"revision {store.revision[:12]} vs {here.revision[:12]}")
    if store.model_type != here.model_type:
        out.append(f"model_type {store.model_type!r} vs {here.model_type!r}")
    if store.config_sha256 != here.config_sha256:
        out.append("config.json differs")
    if store.quantization_sha256 != here.quantization_sha256:
        out.append("the quantization config differs")
    if store.sample_sha256 != here.sample_sha256:
        out.append("the sampled expert bytes differ (other weights)")
    if store.tensors_sha256 != here.tensors_sha256:
        out.append(
            f"the routed-expert tensors differ in name, shard, offset or size "
            f"({store.num_tensors} source tensors vs {here.num_tensors})"
        )
    return "; ".join(out)


def check_matches(manifest: Manifest, store_dir: Path, plan: StorePlan) -> None:
    """StoreMismatchError unless the store was packed from this checkpoint with this layout."""
    diff = fingerprint_difference(manifest.fingerprint, plan.fingerprint)
    if not diff and (
        layout_of(manifest) != plan.layout
        or tuple(manifest.layers) != plan.layers
        or manifest.experts_per_layer != plan.experts_per_layer
    ):
        diff = "the record layout or layer map differs"
    if diff:
        raise StoreMismatchError(
            f"store {store_dir} was packed from another checkpoint than "
            f"{plan.checkpoint.directory} ({diff}); the store was packed from "
            f"{manifest.model_dir}: serve it with that checkpoint, or repack: "
            f"`glm53 store pack --model {plan.checkpoint.directory} --out NEW_DIR`"
        )
