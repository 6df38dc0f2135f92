"""The numpy EXL3 reference decoder: tiles derived by hand, codebook values derived by hand, the
bitstream ring structure, the original-basis weight, and its input checks."""

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.models.exl3 import (
    Exl3FormatError,
    Exl3Weights,
    codebook_values,
    decode_states,
    hadamard128,
    tc_perm,
    unpack_signs,
)


def one_bit_tile(width: int) -> np.ndarray:
    """A single tile whose only set bit is bit 0 of the stream (the MSB of 32-bit word 0)."""
    tile = np.zeros((1, 1, width), dtype=np.int16)
    tile.view(np.uint16)[0, 0, 1] = 0x8000  # little-endian: u16 #1 is the high half of word 0
    return tile


def round_fp16(value: Fraction) -> Fraction:
    """Round a positive or negative value in [2^-14, 65504] to fp16, nearest-even (by hand)."""
    sign, value = (-1 if value < 0 else 1), abs(value)
    exponent = 0
    while value >= 2 ** (exponent + 1):
        exponent += 1
    while value < 2**exponent:
        exponent -= 1
    ulp = Fraction(2) ** (exponent - 10)
    q, r = divmod(value, ulp)
    if r > ulp / 2 or (r == ulp / 2 and q % 2 == 1):
        q += 1
    return sign * q * ulp


def test_tc_perm_follows_the_tensor_core_fragment_layout():
    perm = tc_perm()
    assert sorted(perm.tolist()) == list(range(256))
    # lane 0 holds rows 0, 1, 8, 9 of columns 0 and 8; lane 5 rows 2, 3, 10, 11 of columns 1, 9
    assert perm[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]
    assert perm[40:48].tolist() == [33, 49, 161, 177, 41, 57, 169, 185]


def test_k2_tile_states_derived_by_hand():
    # K = 2: state t is the 16-bit window ending at bit 2(t + 1) of the 512-bit ring, so stream bit 0
    # sits at window bit 2t + 1 for t = 0..7 and outside every later window.
    states = decode_states(one_bit_tile(32))[0, 0]
    assert states[:8].tolist() == [1 << (2 * t + 1) for t in range(8)]
    assert not states[8:].any()


def test_k2_5_half_rate_tile_states_derived_by_hand():
    # K = 2.5: windows end at bit ((t + 1) * 5) >> 1 = 2, 5, 7, 10, 12, 15, 17, ...; bit 0 is in the
    # window iff it ends at <= 16, at value bit (end - 1).
    states = decode_states(one_bit_tile(40))[0, 0]
    assert states[:6].tolist() == [1 << (end - 1) for end in (2, 5, 7, 10, 12, 15)]
    assert not states[6:].any()


def test_codebook_values_derived_by_hand():
    kinv = Fraction(1774, 2**18)  # fp16 0x1eee
    kbias = Fraction(-1329, 128)  # fp16 0xc931
    # mul1, state 1: 0x83DCD12D has byte sum 0x83 + 0xDC + 0xD1 + 0x2D = 605
    mul1_1 = round_fp16((1024 + 605) * kinv + kbias)
    assert mul1_1 == Fraction(1313, 2048)
    got = codebook_values(np.array([0, 1], dtype=np.uint16), "mul1").astype(np.float64)
    assert got.tolist() == [-3.453125, float(mul1_1)]
    # mcg, state 0: both halves become 0x3b60 = 0.921875
    assert codebook_values(np.zeros(1, np.uint16), "mcg").tolist() == [1.84375]
    # 3inst, state 0: 64248484 = 0x03D45AA4 -> halves 0x31C4 + 0x38B4 = 0.18017578125 + 0.587890625
    assert codebook_values(np.zeros(1, np.uint16), "3inst").tolist() == [0.76806640625]


@pytest.mark.parametrize("codebook", ["mcg", "3inst"])
def test_whole_matrices_decode_with_every_codebook(codebook):
    rng = np.random.default_rng(2)
    trellis = rng.integers(-(2**15), 2**15, (8, 16, 48), dtype=np.int16)
    w = Exl3Weights(trellis, np.ones(128, np.float16), np.ones(256, np.float16), codebook)
    inner = w.inner_weight()
    values = codebook_values(decode_states(trellis[3, 5]), codebook)
    assert np.array_equal(inner[48:64, 80:96].reshape(-1)[tc_perm()], values)


def test_inner_weight_places_states_by_the_fragment_permutation():
    trellis = one_bit_tile(32)
    w = Exl3Weights(np.tile(trellis, (8, 8, 1)), np.ones(128, np.float16), np.ones(128, np.float16))
    inner = w.inner_weight()
    values = codebook_values(decode_states(trellis)[0, 0], "mul1")
    for t, (row, col) in enumerate(
        [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    ):
        assert inner[row, col] == values[t]
        assert inner[16 + row, 32 + col] == values[t]  # every tile decodes the same
    assert inner[2, 0] == codebook_values(np.zeros(1, np.uint16), "mul1")[0]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]), st.integers(0, 2**32 - 1))
def test_states_are_the_ring_read_k_bits_at_a_time(k2, seed):
    # Each state's low bits are the bits the trellis advanced by, so the states give back the
    # tile, and consecutive states overlap in the rest of their window.
    width = 8 * k2
    tile = np.random.default_rng(seed).integers(-(2**15), 2**15, (1, 1, width), dtype=np.int16)
    states = decode_states(tile)[0, 0].astype(np.int64)
    ends = [((t + 1) * k2) >> 1 for t in range(256)]
    steps = [ends[0] - (ends[-1] - 128 * k2)] + [ends[t] - ends[t - 1] for t in range(1, 256)]
    bits = []
    for t in range(256):
        bits += [(states[t] >> b) & 1 for b in reversed(range(steps[t]))]
        prev = states[t - 1]
        assert states[t] >> steps[t] == prev & ((1 << (16 - steps[t])) - 1)
    words = np.packbits(np.array(bits, dtype=np.uint8)).view(">u4").astype("<u4")
    assert np.array_equal(words.view(np.int16), tile.reshape(-1))


def test_weight_is_the_rotated_inner_weight_with_scales():
    rng = np.random.default_rng(7)
    trellis = rng.integers(-(2**15), 2**15, (16, 8, 48), dtype=np.int16)
    suh = rng.uniform(0.5, 1.5, 256).astype(np.float16) * rng.choice([-1, 1], 256).astype(
        np.float16
    )
    svh = rng.uniform(0.5, 1.5, 128).astype(np.float16)
    w = Exl3Weights(trellis, suh, svh)
    blocks = np.kron(np.eye(2), hadamard128()) / np.sqrt(128)
    exact = (
        np.diag(suh.astype(np.float64))
        @ blocks
        @ w.inner_weight().astype(np.float64)
        @ (hadamard128() / np.sqrt(128))
        @ np.diag(svh.astype(np.float64))
    )
    assert w.weight().dtype == np.float16
    np.testing.assert_allclose(w.weight(), exact, rtol=2e-3, atol=2e-3)
    x = rng.standard_normal((3, 256))
    np.testing.assert_allclose(w.apply(x), x @ exact, rtol=1e-12, atol=1e-12)


def test_legacy_packed_signs_match_unpacked_scales():
    rng = np.random.default_rng(1)
    packed = rng.integers(-(2**15), 2**15, 8, dtype=np.int16)
    signs = unpack_signs(packed)
    assert signs.dtype == np.float16 and signs.shape == (128,)
    assert signs[0] == (-1.0 if packed.view(np.uint16)[0] & 1 else 1.0)
    trellis = rng.integers(-(2**15), 2**15, (8, 8, 48), dtype=np.int16)
    legacy = Exl3Weights.from_tensors(
        {"p.trellis": trellis, "p.su": packed, "p.sv": packed, "p.mul1": 0}, "p"
    )
    assert np.array_equal(legacy.suh, signs) and legacy.codebook == "mul1"


def test_codebook_comes_from_the_marker():
    base = {
        "trellis": np.zeros((8, 8, 32), np.int16),
        "suh": np.ones(128, np.float16),
        "svh": np.ones(128, np.float16),
    }
    assert Exl3Weights.from_tensors(base).codebook == "3inst"
    assert Exl3Weights.from_tensors({**base, "mcg": np.int32(0)}).codebook == "mcg"
    assert Exl3Weights.from_tensors({**base, "mul1": np.int32(0)}).codebook == "mul1"
    with pytest.raises(Exl3FormatError, match="mul1 and mcg are both present"):
        Exl3Weights.from_tensors({**base, "mul1": np.int32(0), "mcg": np.int32(0)})


@pytest.mark.parametrize(
    ("trellis", "suh", "codebook", "message"),
    [
        (np.zeros((8, 8, 48), np.int32), 128, "mul1", "trellis must be int16"),
        (np.zeros((8, 8, 20), np.int16), 128, "mul1", "tile width 20 is neither"),
        (np.zeros((8, 8, 72), np.int16), 128, "mul1", "K = 4.5; exllamav3 writes half rates only"),
        (np.zeros((8, 8, 40), np.int16), 128, "mcg", "half-integer rate K = 2.5 needs the mul1"),
        (np.zeros((8, 8, 48), np.int16), 64, "mul1", r"suh must be float16 \[128\]"),
        (np.zeros((4, 8, 48), np.int16), 64, "mul1", "multiples of 128"),
        (np.zeros((8, 8, 48), np.int16), 128, "int4", "unknown EXL3 codebook 'int4'"),
    ],
)
def test_bad_tensors_are_refused_with_the_reason(trellis, suh, codebook, message):
    with pytest.raises(Exl3FormatError, match=message):
        Exl3Weights(trellis, np.ones(suh, np.float16), np.ones(128, np.float16), codebook)


def test_apply_checks_the_feature_count():
    w = Exl3Weights(
        np.zeros((8, 8, 48), np.int16), np.ones(128, np.float16), np.ones(128, np.float16)
    )
    with pytest.raises(ValueError, match="x has 64 features; this linear takes 128"):
        w.apply(np.zeros((1, 64)))
