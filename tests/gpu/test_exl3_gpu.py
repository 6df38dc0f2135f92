"""The numpy EXL3 decoder against exllamav3's own CUDA reconstruct, on random trellis: the
rotated-basis weights must agree to the last fp16 bit; the original-basis weight (fp32 Hadamards
on both sides, so summation order may move a value by one fp16 ulp) nearly everywhere."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("exllamav3")

from glm53.models.exl3 import Exl3Weights  # noqa: E402

K_IN, N_OUT = 256, 512


@pytest.fixture(scope="module")
def ext():
    from exllamav3.ext import exllamav3_ext

    return exllamav3_ext


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", torch.cuda.current_device())


def random_linear(bits, codebook, seed):
    rng = np.random.default_rng(seed)
    width = int(16 * bits)
    trellis = rng.integers(-(2**15), 2**15, (K_IN // 16, N_OUT // 16, width), dtype=np.int16)
    suh = (rng.choice([-1.0, 1.0], K_IN) * rng.uniform(0.5, 2.0, K_IN)).astype(np.float16)
    svh = (rng.choice([-1.0, 1.0], N_OUT) * rng.uniform(0.5, 2.0, N_OUT)).astype(np.float16)
    return Exl3Weights(trellis, suh, svh, codebook)


def ordered(h: np.ndarray) -> np.ndarray:
    """fp16 bit patterns as integers whose difference counts ulps (+0 and -0 both 0)."""
    u = h.view(np.uint16).astype(np.int32)
    return np.where(u & 0x8000, 0x8000 - u, u)


CASES = [(2, "mul1"), (3, "mul1"), (4, "mul1"), (2.5, "mul1"), (3, "mcg"), (3, "3inst")]


@pytest.mark.parametrize(("bits", "codebook"), CASES)
def test_inner_weight_equals_exllamav3_reconstruct_bit_for_bit(ext, device, bits, codebook):
    lin = random_linear(bits, codebook, seed=int(bits * 10))
    packed = torch.from_numpy(lin.trellis).to(device)
    unpacked = torch.empty((K_IN, N_OUT), dtype=torch.float16, device=device)
    ext.reconstruct(unpacked, packed, float(bits), codebook == "mcg", codebook == "mul1")
    theirs = unpacked.cpu().numpy().view(np.uint16)
    ours = lin.inner_weight().view(np.uint16)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize(("bits", "codebook"), CASES[:3])
def test_weight_matches_get_weight_tensor(device, bits, codebook):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    lin = random_linear(bits, codebook, seed=int(bits * 10) + 1)
    t = {
        k: torch.from_numpy(v).to(device)
        for k, v in (("trellis", lin.trellis), ("suh", lin.suh), ("svh", lin.svh))
    }
    marker = torch.tensor(0, dtype=torch.int32, device=device)
    theirs = LinearEXL3(None, K_IN, N_OUT, mul1=marker, **t).get_weight_tensor().cpu().numpy()
    ulps = np.abs(ordered(lin.weight()) - ordered(theirs))
    assert ulps.max() <= 1
    assert (ulps > 0).mean() < 1e-3
