"""tests/gpu/ runs only where a CUDA GPU is present; elsewhere every test in it is
reported as skipped with the reason."""

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _have_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/)")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def shared_exllamav3_tune_cache(tmp_path_factory):
    """One exllamav3 GEMM tune cache for the whole session, reference processes and glm53 servers
    alike (servers get their own XDG_CACHE_HOME, which would otherwise give each its own):
    exllamav3 picks kernels by timing at first use, and the rounding follows the pick, so stock
    exllamav3 is the reference under the same picks, not under picks of its own timing."""
    import os

    if os.environ.get("EXLLAMAV3_TUNE_CACHE"):
        yield os.environ["EXLLAMAV3_TUNE_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("exllamav3-tune") / "coop_autotune_v1.bin")
    os.environ["EXLLAMAV3_TUNE_CACHE"] = path
    yield path
    del os.environ["EXLLAMAV3_TUNE_CACHE"]
