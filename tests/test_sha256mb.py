"""The multi-buffer SHA-256 (pyx/sha256mb_avx512.c via glm53._odirect.sha256_many) against
hashlib, and the store's hashing engines (glm53/store/hashing.py)."""

import hashlib

import numpy as np
import pytest

from glm53._odirect import SHA256_LANES, aligned_empty, sha256_many
from glm53.store import hashing
from glm53.store.errors import StoreError

needs_x16 = pytest.mark.skipif(SHA256_LANES == 0, reason="this CPU lacks AVX-512F/BW")

# every padding case: empty, short, one byte either side of 55/56 (the length field fits or
# spills into a second block) and of the block and two-block edges
EDGE_LENGTHS = [0, 1, 3, 54, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 191, 192, 4096]


def _random(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@needs_x16
def test_sha256_many_equals_hashlib_at_every_padding_edge():
    buffers = [_random(n, n) for n in EDGE_LENGTHS]
    got = sha256_many(buffers)
    assert got == [hashlib.sha256(b).digest() for b in buffers]


@needs_x16
def test_sha256_many_takes_any_count_and_mixed_lengths():
    rng = np.random.default_rng(7)
    for count in (1, 2, 15, 16, 17, 33):
        lengths = rng.integers(0, 20_000, count)
        buffers = [_random(int(n), i) for i, n in enumerate(lengths)]
        assert sha256_many(buffers) == [hashlib.sha256(b).digest() for b in buffers]
    assert sha256_many([]) == []


@needs_x16
def test_sha256_many_on_record_sized_buffers_of_one_length():
    # the store's case: 16 equal records, each of a multiple of 4096 bytes
    buffers = []
    for i in range(16):
        buf = aligned_empty(77_824)
        buf[:] = _random(77_824, 100 + i)
        buffers.append(buf)
    assert [d.hex() for d in sha256_many(buffers)] == [
        hashlib.sha256(b).hexdigest() for b in buffers
    ]


@needs_x16
def test_sha256_many_takes_any_contiguous_buffer_and_refuses_strided_ones():
    data = bytes(range(256)) * 40
    got = sha256_many([data, bytearray(data), memoryview(data)[5:], np.frombuffer(data, "<u4")])
    want = [hashlib.sha256(x).digest() for x in (data, data, data[5:], data)]
    assert got == want
    strided = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match=r"buffers\[1\] must be a contiguous buffer"):
        sha256_many([data, strided])
    with pytest.raises(TypeError):
        sha256_many([data, 3])


def test_sha256_many_without_avx512_says_so(monkeypatch):
    if SHA256_LANES:
        pytest.skip("this CPU has AVX-512: the refusal is for CPUs without it")
    with pytest.raises(RuntimeError, match="needs AVX-512F and AVX-512BW"):
        sha256_many([b"x"])


def test_engines_give_the_same_digests():
    buffers = [_random(n, n) for n in (4096, 8192, 77_824)]
    want = [hashlib.sha256(b).hexdigest() for b in buffers]
    engines = ["openssl"] + (["x16"] if SHA256_LANES else [])
    for engine in engines:
        with hashing.RecordHasher(engine, threads=2) as hasher:
            assert hasher.submit(buffers).result() == want
            assert hasher.lanes == (16 if engine == "x16" else 1)


def test_engine_choice(monkeypatch):
    assert hashing.resolve_engine("openssl") == "openssl"
    assert hashing.resolve_engine("auto") == ("x16" if SHA256_LANES else "openssl")
    with pytest.raises(StoreError, match="sha256 engine 'md5' is not one of auto, x16, openssl"):
        hashing.resolve_engine("md5")
    monkeypatch.setattr(hashing, "SHA256_LANES", 0)
    assert hashing.resolve_engine("auto") == "openssl"
    with pytest.raises(StoreError, match="x16 sha256 engine needs AVX-512F and AVX-512BW"):
        hashing.resolve_engine("x16")


def test_the_cli_offers_the_engines_there_are():
    from glm53.store.cli import SHA256_ENGINES

    assert SHA256_ENGINES == hashing.ENGINES
