"""One synthetic tensor at a time: its random values, its bytes, a shard header, and rewriting
a tensor in place in a written shard.

Every tensor's values come from its own random stream, seeded by (seed, key): the same seed
gives the same bytes, and no tensor depends on the order in which others were made.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from glm53.models.checkpoint import MUL1_MARKER, Checkpoint
from glm53.synth.layout import TensorSpec


def tensor_rng(seed: int, key: str) -> np.random.Generator:
    digest = hashlib.sha256(key.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng([seed, *words])


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def encode(spec: TensorSpec, values: np.ndarray) -> bytes:
    """Float or integer values -> the bytes of spec.dtype."""
    if spec.dtype == "BF16":
        return to_bf16_bits(values).tobytes()
    np_dtype = {"F32": "<f4", "F16": "<f2", "I16": "<i2", "I32": "<i4"}[spec.dtype]
    return np.ascontiguousarray(values, dtype=np_dtype).tobytes()


def generate(spec: TensorSpec, seed: int) -> np.ndarray:
    rng = tensor_rng(seed, spec.key)
    shape = spec.shape
    match spec.fill:
        case "trellis":
            count = int(np.prod(shape))
            return np.frombuffer(rng.bytes(2 * count), dtype="<i2").reshape(shape)
        case "signs":
            return np.where(rng.random(shape) < 0.5, -spec.scale, spec.scale).astype(np.float32)
        case "mul1":
            return np.array(MUL1_MARKER, dtype=np.int32)
        case "ones":
            return np.ones(shape, dtype=np.float32)
        case "zeros":
            return np.zeros(shape, dtype=np.float32)
        case "normal":
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.scale)
        case "log_uniform_1_16":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        case "hc_base":
            # pre 4, post 4, then the 4x4 combine block = 2*I: leans to identity, keeps streams apart
            hc = int(round((-2 + (4 + 4 * shape[0]) ** 0.5) / 2))
            base = np.zeros(shape, dtype=np.float32)
            base[2 * hc :] = (2.0 * np.eye(hc, dtype=np.float32)).reshape(-1)
            return base
    raise ValueError(f"unknown fill {spec.fill!r} for {spec.key}")


def header_bytes(specs: list[TensorSpec]) -> bytes:
    header, offset = {}, 0
    for spec in specs:
        header[spec.key] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def rewrite_tensor(checkpoint: Checkpoint, key: str, values: np.ndarray) -> None:
    """Overwrite one tensor's bytes in place (same dtype and shape as stored)."""
    info = checkpoint.info(key)
    spec = TensorSpec(key, info.dtype, info.shape, "override")
    data = encode(spec, values)
    if len(data) != info.nbytes or tuple(values.shape) != info.shape:
        raise ValueError(f"{key}: new values {values.shape} do not match stored {info.shape}")
    with open(info.path, "r+b") as f:
        f.seek(info.offset_bytes)
        f.write(data)
