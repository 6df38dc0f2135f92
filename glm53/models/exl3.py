"""Reference decoder for one EXL3 linear, in numpy (no torch, no GPU).

An EXL3 linear `in_features k -> out_features n` is stored as:

- `trellis` int16 `[k/16, n/16, W]`: one 16x16 weight tile per `[kt, nt]`, each a tail-biting trellis
  bitstream of 256 states; `W = 16 K` for K = 1..8 bits per weight, `16 K + 8` for the half rates
  1.5 / 2.5 / 3.5 (exllamav3 >= 1.6, mul1 only);
- `suh` fp16 `[k]`, `svh` fp16 `[n]`: input / output channel scale x sign (legacy checkpoints store
  only the signs, packed 16 per int16, as `su` / `sv`);
- a codebook marker `mul1` or `mcg` (int32 scalar), none for the legacy 3INST codebook;
- an optional fp16 `bias` `[n]`.

The weight in the original basis is `W = diag(suh) H Wq H diag(svh)`, H the block-diagonal
128-point Walsh-Hadamard matrix scaled by 1/sqrt(128) and Wq the decoded tiles, so a row of
activations maps to `y = had(had(x * suh) @ Wq) * svh (+ bias)`. `inner_weight` is bit-identical to
exllamav3's `reconstruct` (Wq in fp16); `weight` follows `LinearEXL3.get_weight_tensor`'s rounding
points (fp32 Hadamards, fp16 after each step).

Decoding (exllamav3 `quant/exl3_dq.cuh`, `codebook.cuh`): view a tile as 32-bit little-endian words
whose bits are read most-significant first, as one ring of `128 k2` bits (k2 = 2K, K in half bits).
State t (0..255) is the 16-bit window that ends at bit `((t + 1) k2) >> 1` of the ring, and the
codebook maps it to an fp16 value. The state's position in the 16x16 tile follows the tensor-core
fragment order (`tc_perm`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import numpy as np

from glm53.errors import Glm53Error

CODEBOOKS = ("mul1", "mcg", "3inst")
MUL1_MULT = 0x83DCD12D
MCG_MULT = 0xCBAC1FED
INST3_MULT = 89226354
INST3_ADD = 64248484
# mul1: value = fp16(fma(fp16(1024 + bytesum), KINV, KBIAS)), both constants fp16 bit patterns
MUL1_KINV_BITS = 0x1EEE  # 0.00677 ~ 1/147.7
MUL1_KBIAS_BITS = 0xC931  # -10.38 = (-1024 - 510) * KINV
HAD_DIM = 128
HALF_RATES = (1.5, 2.5, 3.5)


class Exl3FormatError(ValueError, Glm53Error):
    """An EXL3 tensor set that this decoder cannot read; the message names the tensor and why."""


def _f16(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint16).view(np.float16).astype(np.float32)[0]


@cache
def tc_perm() -> np.ndarray:
    """Tile position of each trellis state: `tc_perm()[t] = row * 16 + col` (row = input index)."""
    perm = np.empty(256, dtype=np.int64)
    for lane in range(32):
        r0 = (lane % 4) * 2
        c0 = lane // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            col = c0 + (8 if j >= 4 else 0)
            perm[lane * 8 + j] = rows[j % 4] * 16 + col
    return perm


@cache
def hadamard128() -> np.ndarray:
    """The 128-point Sylvester Hadamard matrix (entries +-1, symmetric), as exllamav3 builds it."""
    h = np.ones((1, 1))
    while h.shape[0] < HAD_DIM:
        h = np.block([[h, h], [h, -h]])
    return h


def rate_k2(width: int) -> int:
    """Bitrate in half bits (2K) from the trellis tile width in int16 words (16K or 16K + 8)."""
    if width % 8 != 0 or not 2 <= width // 8 <= 16:
        raise Exl3FormatError(
            f"trellis tile width {width} is neither 16*K (K = 1..8) nor 16*K + 8 (K = 1.5, 2.5, 3.5)"
        )
    k2 = width // 8
    if k2 % 2 == 1 and k2 > 7:
        raise Exl3FormatError(
            f"trellis tile width {width} means K = {k2 / 2}; exllamav3 writes half rates only for "
            f"K = {', '.join(map(str, HALF_RATES))}"
        )
    return k2


@cache
def _state_windows(k2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per state t: index of the word holding the window's first bit, of its last bit, and the
    right shift that aligns the window in the 64-bit concatenation of the two."""
    num_words = 4 * k2
    t = np.arange(256)
    end = (((t + 1) * k2) >> 1) + 128 * k2  # biased by one ring length so starts stay >= 0
    first, last = (end - 16) // 32, (end - 1) // 32
    shift = (last + 1) * 32 - end
    return first % num_words, last % num_words, shift.astype(np.uint64)


def decode_states(trellis: np.ndarray) -> np.ndarray:
    """Trellis states `[..., 256]` uint16, in trellis (tensor-core) order, of int16 tiles `[..., W]`."""
    trellis = np.ascontiguousarray(trellis)
    if trellis.dtype != np.int16:
        raise Exl3FormatError(f"trellis must be int16, got {trellis.dtype}")
    k2 = rate_k2(trellis.shape[-1])
    u16 = trellis.view(np.uint16).reshape(-1, trellis.shape[-1]).astype(np.uint64)
    words = u16[:, 0::2] | (u16[:, 1::2] << np.uint64(16))  # little-endian 32-bit words
    first, last, shift = _state_windows(k2)
    pair = (words[:, first] << np.uint64(32)) | words[:, last]
    states = (pair >> shift) & np.uint64(0xFFFF)
    return np.ascontiguousarray(states, dtype=np.uint16).reshape(*trellis.shape[:-1], 256)


def _lop3_halves(x: np.ndarray) -> np.ndarray:
    """mcg / 3INST: (x & 0x8fff8fff) ^ 0x3b603b60 read as two fp16, summed with one fp16 rounding."""
    x = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
    halves = np.ascontiguousarray(x, dtype=np.uint32).view(np.uint16)
    halves = halves.reshape(*x.shape, 2).view(np.float16)
    # The sum of two fp16 values is exact in fp64, so one cast gives the correctly rounded fp16 add
    return (halves[..., 0].astype(np.float64) + halves[..., 1].astype(np.float64)).astype(
        np.float16
    )


@cache
def mul1_table() -> np.ndarray:
    """mul1 codebook value (fp16) of every byte sum 0..1020.

    fp16(1024 + s) * KINV + KBIAS is exact in fp32 (all terms are multiples of 2^-18 below 16), so
    one rounding to fp16 reproduces the GPU's fused hfma bit for bit."""
    s = np.arange(1021, dtype=np.float32)
    exact = (np.float32(1024) + s) * _f16(MUL1_KINV_BITS) + _f16(MUL1_KBIAS_BITS)
    return exact.astype(np.float16)


def codebook_values(states: np.ndarray, codebook: str) -> np.ndarray:
    """fp16 weight of each 16-bit trellis state under `codebook` (mul1, mcg or 3inst)."""
    x = states.astype(np.uint32)
    if codebook == "mul1":
        x = x * np.uint32(MUL1_MULT)
        byte_sum = sum((x >> np.uint32(s)) & np.uint32(0xFF) for s in (0, 8, 16, 24))
        return mul1_table()[byte_sum]
    if codebook == "mcg":
        return _lop3_halves(x * np.uint32(MCG_MULT))
    if codebook == "3inst":
        return _lop3_halves(x * np.uint32(INST3_MULT) + np.uint32(INST3_ADD))
    raise Exl3FormatError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")


def decode_tiles(trellis: np.ndarray, codebook: str = "mul1") -> np.ndarray:
    """The fp16 weights `[16 kt, 16 nt]` of int16 tiles `[kt, nt, W]`, rows = input index."""
    kt, nt, _ = trellis.shape
    values = codebook_values(decode_states(trellis), codebook)
    tiles = np.empty((kt, nt, 256), dtype=np.float16)
    tiles[:, :, tc_perm()] = values
    return tiles.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(16 * kt, 16 * nt)


def unpack_signs(packed: np.ndarray) -> np.ndarray:
    """Legacy packed sign vector (`su`/`sv`, int16, 16 signs per word, bit set = -1) as fp16 +-1."""
    bits = (packed.view(np.uint16)[:, None] >> np.arange(16, dtype=np.uint16)) & 1
    return (1 - 2 * bits.reshape(-1).astype(np.int32)).astype(np.float16)


def _blocks(a: np.ndarray, axis: int) -> np.ndarray:
    """Apply the 128-point Hadamard (scaled 1/sqrt(128)) to every 128-block along `axis` in fp64."""
    a = np.moveaxis(np.asarray(a, dtype=np.float64), axis, -1)
    shape = a.shape
    out = a.reshape(*shape[:-1], shape[-1] // HAD_DIM, HAD_DIM) @ hadamard128()
    return np.moveaxis(out.reshape(shape) / np.sqrt(HAD_DIM), -1, axis)


def _blocks_f32(w: np.ndarray, axis: int) -> np.ndarray:
    """The same in fp32 with fp32 Hadamard entries, as `preapply_had_l/r` compute it."""
    had = hadamard128().astype(np.float32) * np.float32(1.0 / np.sqrt(HAD_DIM))
    w = np.moveaxis(w.astype(np.float32), axis, -1)
    shape = w.shape
    out = w.reshape(*shape[:-1], shape[-1] // HAD_DIM, HAD_DIM) @ had
    return np.moveaxis(out.reshape(shape), -1, axis)


@dataclass(frozen=True, slots=True)
class Exl3Weights:
    """The arrays of one EXL3 linear (`in_features` -> `out_features`) and their decoding."""

    trellis: np.ndarray  # int16 [k/16, n/16, W]
    suh: np.ndarray  # fp16 [k]
    svh: np.ndarray  # fp16 [n]
    codebook: str = "mul1"
    bias: np.ndarray | None = None  # fp16 [n]

    def __post_init__(self) -> None:
        t = self.trellis
        if t.dtype != np.int16 or t.ndim != 3:
            raise Exl3FormatError(
                f"trellis must be int16 [k/16, n/16, 16K], got {t.dtype} {list(t.shape)}"
            )
        k2 = rate_k2(t.shape[2])
        if self.codebook not in CODEBOOKS:
            raise Exl3FormatError(
                f"unknown EXL3 codebook {self.codebook!r}; expected one of {CODEBOOKS}"
            )
        if k2 % 2 == 1 and self.codebook != "mul1":
            raise Exl3FormatError(
                f"half-integer rate K = {k2 / 2} needs the mul1 codebook; this tensor uses "
                f"{self.codebook}, which exllamav3 never writes at half rates"
            )
        k, n = 16 * t.shape[0], 16 * t.shape[1]
        for name, vec, size in (("suh", self.suh, k), ("svh", self.svh, n), ("bias", self.bias, n)):
            if vec is not None and (vec.dtype != np.float16 or vec.shape != (size,)):
                raise Exl3FormatError(
                    f"{name} must be float16 [{size}] for trellis {list(t.shape)}, "
                    f"got {vec.dtype} {list(vec.shape)}"
                )
        if k % HAD_DIM or n % HAD_DIM:
            raise Exl3FormatError(
                f"EXL3 linear {k} -> {n}: both dims must be multiples of {HAD_DIM} "
                "(the Hadamard block); pad the tensor as exllamav3's loader does"
            )

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, np.ndarray], key: str = "") -> Exl3Weights:
        """Parse `{key}.trellis`, `.suh`/`.su`, `.svh`/`.sv`, `.mul1`/`.mcg`, `.bias` from a mapping."""
        prefix = f"{key}." if key else ""

        def get(name: str) -> np.ndarray | None:
            value = tensors.get(prefix + name)
            return None if value is None else np.asarray(value)

        trellis = get("trellis")
        if trellis is None:
            raise Exl3FormatError(f"{prefix}trellis is missing; not an EXL3 linear")
        suh, svh = get("suh"), get("svh")
        if suh is None and get("su") is not None:
            suh = unpack_signs(get("su"))
        if svh is None and get("sv") is not None:
            svh = unpack_signs(get("sv"))
        if suh is None or svh is None:
            raise Exl3FormatError(f"{prefix}suh (or su) and {prefix}svh (or sv) are both required")
        if get("mul1") is not None and get("mcg") is not None:
            raise Exl3FormatError(f"{prefix}mul1 and {prefix}mcg are both present; keep one marker")
        codebook = (
            "mul1" if get("mul1") is not None else "mcg" if get("mcg") is not None else "3inst"
        )
        bias = get("bias")
        if bias is not None and bias.dtype == np.float32:
            bias = bias.astype(np.float16)  # exllamav3 converts fp32 biases the same way
        return cls(trellis, suh, svh, codebook, bias)

    @property
    def in_features(self) -> int:
        return 16 * self.trellis.shape[0]

    @property
    def out_features(self) -> int:
        return 16 * self.trellis.shape[1]

    @property
    def k2(self) -> int:
        """Bits per weight in half bits (6 for K = 3, 5 for K = 2.5)."""
        return rate_k2(self.trellis.shape[2])

    @property
    def bits(self) -> float:
        return self.k2 / 2

    def inner_weight(self) -> np.ndarray:
        """Wq `[k, n]` fp16 in the rotated basis: exllamav3's `reconstruct`, bit for bit."""
        return decode_tiles(self.trellis, self.codebook)

    def weight(self) -> np.ndarray:
        """W `[k, n]` fp16 in the original basis, with `get_weight_tensor`'s fp16 rounding points."""
        w = _blocks_f32(self.inner_weight(), axis=0).astype(np.float16)
        w = (w.astype(np.float32) * self.suh.astype(np.float32)[:, None]).astype(np.float16)
        w = _blocks_f32(w, axis=1).astype(np.float16)
        return (w.astype(np.float32) * self.svh.astype(np.float32)[None, :]).astype(np.float16)

    def apply(self, x: np.ndarray, inner: np.ndarray | None = None) -> np.ndarray:
        """`had(had(x * suh) @ Wq) * svh (+ bias)` for rows `x [..., k]`, in fp64; returns fp64.
        `inner`: Wq already decoded (`inner_weight()`), to decode a linear once for many calls."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features; this linear takes {self.in_features}")
        if inner is None:
            inner = self.inner_weight()
        xh = _blocks(x * self.suh.astype(np.float64), axis=-1)
        y = _blocks(xh @ inner.astype(np.float64), axis=-1)
        y = y * self.svh.astype(np.float64)
        if self.bias is not None:
            y = y + self.bias.astype(np.float64)
        return y
