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
