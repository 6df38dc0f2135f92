"""The CPU lane's fast precision (pyx/gemv_fast.h): every fast kernel against the scalar one bit for
bit and against its fp64 definition, the MoE job against the exact fp64 reference within the fast
bound, and the precision setting. Variants this CPU lacks are skipped with the reason; the GPU
side of the bound (exllamav3's own error on the same expert) is tests/gpu/test_gemv_fast_gpu.py."""

import numpy as np
import pytest

from glm53 import _gemv
from glm53.models.exl3 import decode_states, tc_perm
from glm53.tiers.cpu_lane import (
    FAST_REL_TOL,
    CpuLane,
    LaneConfigError,
    LaneLayout,
    expert_table,
    random_expert,
    reference_moe,
    reference_moe_fast,
)

VARIANTS = [
    pytest.param(
        v,
        marks=pytest.mark.skipif(
            not _gemv.kernel_supported(v, _gemv.FAST),
            reason=f"this CPU lacks the instructions of the {_gemv.variant_name(v)} kernels",
        ),
        id=_gemv.variant_name(v).split()[0],
    )
    for v in _gemv.VARIANTS
]
RATES = [2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]  # k2 = 2 K
MODEL_TOL = 1e-5  # fp32 sums of exact int32 partials against the fp64 model of the same math
JOB_MODEL_TOL = 1e-4  # ... where the model's fp64 Hadamard may move a value across an int16 step
FAST = _gemv.FAST


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def random_trellis(rng, kt, nt, k2):
    return rng.integers(-(2**15), 2**15, (kt, nt, 8 * k2), dtype=np.int16)


def fast_model(trellis, xh, kt0, kt1):
    """The fast tile kernel's definition (gemv_fast.h) in fp64: int16 inputs per 128-block, times
    the unrounded codebook KINV * s + C0."""
    kt, nt, _ = trellis.shape
    x = decode_states(trellis).astype(np.uint32) * np.uint32(0x83DCD12D)
    s = sum((x >> np.uint32(b)) & np.uint32(0xFF) for b in (0, 8, 16, 24))
    tiles = np.empty((kt, nt, 256))
    tiles[:, :, tc_perm()] = s * (1774 / 2**18) - 3.453125
    w = tiles.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(16 * kt, 16 * nt)
    blocks = xh.reshape(len(xh), -1, 128)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    q = np.rint(blocks * (np.float32(16383) / safe))  # fp32, as the kernels compute it
    scale = np.where(amax > 0, safe / np.float32(16383), np.float32(0)).astype(np.float64)
    xq = (q * scale).reshape(xh.shape)
    return xq[:, 16 * kt0 : 16 * kt1] @ w[16 * kt0 : 16 * kt1]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k2", RATES)
def test_fast_kernels_equal_the_scalar_one_and_follow_the_definition(variant, k2):
    rng = np.random.default_rng(100 + k2)
    trellis = random_trellis(rng, 16, 8, k2)  # two 128-row blocks
    xh = (rng.standard_normal((3, 256)) * rng.uniform(0.1, 10, (3, 1))).astype(np.float32)
    for kt0, kt1 in ((0, 16), (3, 13)):  # whole, and a range that crosses the block boundary
        got = _gemv.tiles(variant, trellis, xh, kt0, kt1, precision=FAST)
        assert np.array_equal(got, _gemv.tiles(_gemv.SCALAR, trellis, xh, kt0, kt1, precision=FAST))
        assert rel_err(got, fast_model(trellis, xh, kt0, kt1)) < MODEL_TOL


# The previous kernels kept for same-process A/B (`bench/micro_gemv.py --ab`): each must still
# equal the scalar one, so an A/B compares two right answers.
PREVIOUS = [
    pytest.param(
        v,
        marks=pytest.mark.skipif(
            not _gemv.kernel_supported(v, _gemv.FAST),
            reason=f"this CPU lacks the instructions of the {_gemv.variant_name(v)} kernels",
        ),
        id=_gemv.variant_name(v).split()[0],
    )
    for v in _gemv.VARIANTS
    if _gemv.has_previous(v, _gemv.FAST)
]


def test_the_avx512_fast_kernel_keeps_its_previous_one_and_no_other_does():
    assert [v for v in _gemv.VARIANTS if _gemv.has_previous(v, FAST)] == [
        _gemv.AVX512,
        _gemv.AVX512_FP16,
    ]
    assert not any(_gemv.has_previous(v, _gemv.EXACT) for v in _gemv.VARIANTS)
    trellis = np.zeros((8, 1, 48), np.int16)
    with pytest.raises(ValueError, match="no previous kernel"):
        _gemv.tiles(
            _gemv.SCALAR, trellis, np.ones((1, 128), np.float32), precision=FAST, previous=True
        )


@pytest.mark.parametrize("variant", PREVIOUS)
@pytest.mark.parametrize("k2", RATES)
def test_previous_fast_kernels_equal_the_scalar_one(variant, k2):
    rng = np.random.default_rng(200 + k2)
    trellis = random_trellis(rng, 16, 8, k2)
    for m in (1, 3, 8):
        xh = (rng.standard_normal((m, 256)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
        for kt0, kt1 in ((0, 16), (3, 13)):
            got = _gemv.tiles(variant, trellis, xh, kt0, kt1, precision=FAST, previous=True)
            want = _gemv.tiles(_gemv.SCALAR, trellis, xh, kt0, kt1, precision=FAST)
            assert np.array_equal(got, want)
            assert np.array_equal(got, _gemv.tiles(variant, trellis, xh, kt0, kt1, precision=FAST))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_fast_kernels_take_one_to_eight_rows_and_zero_blocks(variant, m):
    rng = np.random.default_rng(m)
    trellis = random_trellis(rng, 16, 8, 6)
    xh = rng.standard_normal((m, 256)).astype(np.float32)
    xh[0, 128:] = 0.0  # an all-zero block: scale 0, contributes nothing
    got = _gemv.tiles(variant, trellis, xh, precision=FAST)
    assert np.array_equal(got, _gemv.tiles(_gemv.SCALAR, trellis, xh, precision=FAST))
    assert rel_err(got, fast_model(trellis, xh, 0, 16)) < MODEL_TOL


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(21)
    experts = [random_expert(rng, 512, 256, 3) for _ in range(4)]
    return experts, expert_table(experts)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fast_moe_stays_within_the_bound_of_the_exact_reference(layer, variant, threads):
    experts, table = layer
    rng = np.random.default_rng(threads)
    lane = CpuLane(LaneLayout((0,) * threads), variant, "fast")
    exact = CpuLane(LaneLayout((0,) * threads), variant)
    for num_rows in (1, 3):
        x = rng.standard_normal((num_rows, 512)).astype(np.float16).astype(np.float32)
        rows = np.concatenate([np.arange(num_rows), rng.integers(0, num_rows, num_rows)])
        ids = rng.integers(0, len(experts), len(rows))
        weights = rng.uniform(0.1, 1, len(rows)).astype(np.float32)
        out = lane.run(table, x, rows, ids, weights)
        ref = reference_moe(x, rows, ids, weights, experts)
        err = rel_err(out, ref)
        assert err < FAST_REL_TOL
        assert err > 10 * rel_err(exact.run(table, x, rows, ids, weights), ref)  # it is inexact
        assert rel_err(out, reference_moe_fast(x, rows, ids, weights, experts)) < JOB_MODEL_TOL


def test_fast_variants_agree_bit_for_bit_on_a_job(layer):
    experts, table = layer
    x = np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32)
    rows, ids, weights = [0, 1, 1], [3, 3, 0], [0.5, 1.0, 0.25]
    runnable = [v for v in _gemv.VARIANTS if _gemv.kernel_supported(v, FAST)]
    outs = [
        CpuLane(LaneLayout((0, 0)), v, "fast").run(table, x, rows, ids, weights) for v in runnable
    ]
    for v, out in zip(runnable[1:], outs[1:], strict=True):
        assert np.array_equal(out, outs[0]), _gemv.variant_name(v)


def test_precision_is_a_setting_named_in_errors_and_descriptions(layer):
    _, table = layer
    lane = CpuLane(LaneLayout((0,)), "best", "fast")
    assert lane.precision == _gemv.FAST and lane.precision_name == "fast"
    assert " fast, 1 thread(s)" in lane.describe()
    assert CpuLane(LaneLayout((0,))).precision == _gemv.EXACT
    with pytest.raises(LaneConfigError, match="lane precision 'fp8' is not one of exact, fast"):
        CpuLane(LaneLayout((0,)), "best", "fp8")
    x = np.zeros((1, 512), np.float32)
    with pytest.raises(ValueError, match="precision 7 is not 0 .exact. or 1 .fast."):
        _gemv.Pool(1).run(table, x, [0], [0], [1.0], precision=7)
    with pytest.raises(ValueError, match="precision 2 is not EXACT"):
        _gemv.tiles(
            _gemv.SCALAR, np.zeros((8, 8, 48), np.int16), np.ones((1, 128), np.float32), precision=2
        )


def test_ct_precision_auto_is_fast_only_where_the_lane_runs_beside_the_gpu():
    from glm53.config import Settings
    from glm53.tiers.cpu_lane import lane_precision

    assert Settings().ct_precision == "auto"
    assert lane_precision("auto", "gpu", "fast") == lane_precision("auto", "gpu", "nvme") == "fast"
    assert (
        lane_precision("auto", "gpu", "exact") == lane_precision("auto", "cpu", "fast") == "exact"
    )
    assert lane_precision("fast", "cpu", "auto") == "fast"
    assert lane_precision("exact", "gpu", "fast") == "exact"
    with pytest.raises(
        LaneConfigError, match="--ct-precision 'fp8' is not one of auto, exact, fast"
    ):
        lane_precision("fp8", "gpu", "fast")
