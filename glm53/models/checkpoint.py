"""Read a glm5_next EXL3 checkpoint without loading its shards.

Only the JSON files and the safetensors headers are read when a `Checkpoint` opens; each
tensor is then known by its file, absolute byte offset, dtype and shape, so the expert store
and the CPU engine can read single tensors (or their 4 KiB aligned spans) by offset.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MUL1_MARKER = -2082680531  # 0x83DCD12D as int32: the `mul1` codebook marker value
MCG_MARKER = -877912083  # 0xCBAC1FED as int32

# safetensors dtype name -> (numpy dtype used to hold the raw bytes, bytes per element)
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),  # raw bits; read_f32 widens them exactly
    "I16": (np.dtype("<i2"), 2),
    "I32": (np.dtype("<i4"), 4),
    "I64": (np.dtype("<i8"), 8),
    "U8": (np.dtype("u1"), 1),
}

MAX_HEADER_BYTES = 100 * 1024 * 1024
_EXPERT_KEY = re.compile(
    r"^(.*\.layers\.(\d+)\.mlp\.experts\.(\d+))\.(gate|up|down)_proj\.trellis$"
)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: `offset_bytes` is absolute within `path`."""

    key: str
    path: Path
    offset_bytes: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Exl3Linear:
    """The tensor set of one EXL3 linear (in_features k -> out_features n, K bits per weight)."""

    key: str
    trellis: TensorInfo
    suh: TensorInfo
    svh: TensorInfo
    marker: TensorInfo | None  # `.mul1` or `.mcg`; None means the legacy 3INST codebook
    in_features: int
    out_features: int
    bits: int

    @property
    def codebook(self) -> str:
        if self.marker is None:
            return "3inst"
        return self.marker.key.rsplit(".", 1)[1]

    @property
    def nbytes(self) -> int:
        extra = self.marker.nbytes if self.marker is not None else 0
        return self.trellis.nbytes + self.suh.nbytes + self.svh.nbytes + extra


@dataclass(frozen=True, slots=True)
class ExpertTensors:
    """One routed expert of one MoE layer: its gate, up and down EXL3 linears."""

    layer: int
    expert: int
    gate: Exl3Linear
    up: Exl3Linear
    down: Exl3Linear

    @property
    def linears(self) -> tuple[Exl3Linear, Exl3Linear, Exl3Linear]:
        return (self.gate, self.up, self.down)

    @property
    def nbytes(self) -> int:
        return sum(lin.nbytes for lin in self.linears)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header; returns key -> TensorInfo with absolute offsets."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {header_bytes} is implausible; file corrupt?")
        header = json.loads(f.read(header_bytes))
    file_bytes = path.stat().st_size
    data_start = 8 + header_bytes
    out: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = entry["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"{path}: tensor {key} has dtype {dtype}, which glm53 cannot read")
        begin, end = entry["data_offsets"]
        shape = tuple(int(d) for d in entry["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
        if end - begin != expected or data_start + end > file_bytes:
            raise ValueError(
                f"{path}: tensor {key} spans bytes [{begin}, {end}) but dtype {dtype} and shape "
                f"{list(shape)} need {expected} bytes inside a {file_bytes}-byte file"
            )
        out[key] = TensorInfo(key, path, data_start + begin, end - begin, dtype, shape)
    return out


class Checkpoint:
    """A checkpoint directory: config, quantization config and every tensor's location."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"{config_path} not found; point at a checkpoint directory "
                "(make one with `glm53 synth --preset demo --out DIR`)"
            )
        self.config: dict = json.loads(config_path.read_text())
        self.text_config: dict = self.config.get("text_config", self.config)
        quant_path = self.directory / "quantization_config.json"
        self.quantization: dict | None = (
            json.loads(quant_path.read_text()) if quant_path.is_file() else None
        )
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shard_paths():
            for key, info in read_safetensors_header(shard).items():
                if key in self.tensors:
                    raise ValueError(
                        f"tensor {key} is in both {self.tensors[key].path.name} and "
                        f"{shard.name}; remove one copy"
                    )
                self.tensors[key] = info
        self._check_index()

    def _shard_paths(self) -> list[Path]:
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"{self.directory} holds no *.safetensors shards")
        return shards

    def _check_index(self) -> None:
        index_path = self.directory / "model.safetensors.index.json"
        if not index_path.is_file():
            return
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        for key, filename in weight_map.items():
            info = self.tensors.get(key)
            if info is None or info.path.name != filename:
                found = info.path.name if info else "no shard"
                raise ValueError(
                    f"{index_path.name} puts {key} in {filename} but the headers put it in "
                    f"{found}; the index is stale"
                )

    # --- tensors ---------------------------------------------------------------------------

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"tensor {key} is not in checkpoint {self.directory}") from None

    def read(self, key: str) -> np.ndarray:
        """One tensor in its stored dtype (BF16 as raw uint16 bits), read by offset."""
        info = self.info(key)
        dtype, _ = DTYPES[info.dtype]
        count = info.nbytes // dtype.itemsize
        with open(info.path, "rb") as f:
            array = np.fromfile(f, dtype=dtype, count=count, offset=info.offset_bytes)
        return array.reshape(info.shape)

    def read_f32(self, key: str) -> np.ndarray:
        """One floating-point tensor widened exactly to float32."""
        info = self.info(key)
        raw = self.read(key)
        if info.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if info.dtype in ("F16", "F32"):
            return raw.astype(np.float32)
        raise TypeError(f"tensor {key} has dtype {info.dtype}, not a floating-point type")

    # --- EXL3 linears and experts ----------------------------------------------------------

    def is_exl3(self, key: str) -> bool:
        return f"{key}.trellis" in self.tensors

    def linear(self, key: str) -> Exl3Linear:
        """The EXL3 tensor set of linear `key` (e.g. `...layers.3.self_attn.o_proj`)."""
        trellis = self.info(f"{key}.trellis")
        suh, svh = self.info(f"{key}.suh"), self.info(f"{key}.svh")
        marker = self.tensors.get(f"{key}.mul1") or self.tensors.get(f"{key}.mcg")
        if len(trellis.shape) != 3 or trellis.dtype != "I16":
            raise ValueError(f"{key}.trellis must be int16 [k/16, n/16, 16K], got {trellis}")
        k_tiles, n_tiles, words = trellis.shape
        if words % 16 != 0:
            raise ValueError(
                f"{key}.trellis last dim {words} is not 16*K; half-integer rates are not supported"
            )
        k, n = k_tiles * 16, n_tiles * 16
        if suh.shape != (k,) or svh.shape != (n,):
            raise ValueError(
                f"{key}: suh {list(suh.shape)} / svh {list(svh.shape)} do not match trellis "
                f"{list(trellis.shape)} (expected [{k}] / [{n}])"
            )
        return Exl3Linear(key, trellis, suh, svh, marker, k, n, words // 16)

    @property
    def prefix(self) -> str:
        return "model.language_model"

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def moe_layers(self) -> list[int]:
        """Layer indices whose MLP is a routed MoE, in order."""
        types = self.text_config.get("mlp_layer_types")
        if types is None:
            first_dense = int(self.text_config.get("first_k_dense_replace", 3))
            types = ["dense"] * first_dense + ["sparse"] * (self.num_layers - first_dense)
        return [i for i in range(self.num_layers) if types[i] == "sparse"]

    def experts(self, layer: int) -> list[ExpertTensors]:
        """The routed experts of MoE layer `layer`, indexed by expert id."""
        num_experts = int(self.text_config["n_routed_experts"])
        base = f"{self.prefix}.layers.{layer}.mlp.experts"
        out = []
        for e in range(num_experts):
            lin = [self.linear(f"{base}.{e}.{proj}_proj") for proj in ("gate", "up", "down")]
            out.append(ExpertTensors(layer, e, *lin))
        return out

    def expert_keys(self) -> dict[int, set[int]]:
        """Layer -> expert ids found among the tensor keys (to cross-check the config)."""
        found: dict[int, set[int]] = {}
        for key in self.tensors:
            m = _EXPERT_KEY.match(key)
            if m:
                found.setdefault(int(m.group(2)), set()).add(int(m.group(3)))
        return found
