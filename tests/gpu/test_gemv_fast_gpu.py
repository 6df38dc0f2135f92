"""The fast CPU lane's error bound, measured against the GPU: on the same GLM-5.3-Flash-shaped mul1
expert and the same fp16 input, the lane's fast output may stray from the fp64 reference by no
more than exllamav3's own GPU kernel does (its EXL3 GEMV, LinearEXL3.forward, on gate, up and
down, with the activation in fp16 between them as exllamav3's MoE keeps it). Also the exact lane,
which must be far closer than either."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("exllamav3")

from gpu_kit import exl3_linears  # noqa: E402

from glm53 import _gemv  # noqa: E402
from glm53.tiers.cpu_lane import (  # noqa: E402
    SWIGLU_LIMIT,
    CpuLane,
    LaneLayout,
    expert_table,
    random_expert,
    reference_moe,
)

HIDDEN, INTER, BITS = 4096, 2048, 3
CASES = [(seed, scale) for seed in range(3) for scale in (1.0, 8.0)]  # expert seed, input size


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |error| / max |ref|, rms error / rms ref)."""
    d = got.astype(np.float64) - ref
    return float(np.abs(d).max() / np.abs(ref).max()), float(
        np.sqrt((d**2).mean() / (ref**2).mean())
    )


def gpu_expert(expert, x16: np.ndarray, device) -> np.ndarray:
    """One expert on exllamav3's GPU EXL3 kernel: down(act(gate(x), up(x))), fp16 between steps."""
    linears = exl3_linears(expert, device)
    x = torch.from_numpy(x16).to(device).view(1, -1)
    g = linears[0].forward(x, {}).float()
    u = linears[1].forward(x, {}).float()
    g = g.clamp(max=SWIGLU_LIMIT)
    u = u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    a = (torch.nn.functional.silu(g) * u).half().contiguous()
    y = linears[2].forward(a, {})
    torch.cuda.synchronize()
    return y.float().cpu().numpy().astype(np.float64).reshape(-1)


@pytest.mark.parametrize(("seed", "scale"), CASES)
def test_fast_lane_error_is_within_the_gpu_kernels_own(device, seed, scale):
    rng = np.random.default_rng(1000 + seed)
    expert = random_expert(rng, HIDDEN, INTER, BITS)
    x16 = (rng.standard_normal(HIDDEN) * scale).astype(np.float16)
    x = x16.astype(np.float32)[None]
    ref = reference_moe(x, [0], [0], [1.0], [expert])[0]
    gpu = errors(gpu_expert(expert, x16, device), ref)
    table = expert_table([expert])
    lane = {}
    for v in _gemv.VARIANTS:
        for p in _gemv.PRECISIONS:
            if v != _gemv.SCALAR and _gemv.kernel_supported(v, p):
                out = CpuLane(LaneLayout((0,)), v, p).run(table, x, [0], [0], [1.0])[0]
                lane[(_gemv.variant_name(v), _gemv.precision_name(p))] = errors(out, ref)
    report = f"gpu (max, rms) {gpu}; lane {lane}"
    for (name, precision), (max_err, rms_err) in lane.items():
        assert max_err <= gpu[0] and rms_err <= gpu[1], f"{name} {precision}: {report}"
        if precision == "exact":
            assert rms_err < gpu[1] / 10, f"{name} exact: {report}"
