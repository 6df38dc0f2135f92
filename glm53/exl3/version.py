"""The one exllamav3 release glm53 is written against, and the check that refuses another.

glm53 patches that release's classes and reads its insides (the table in glm53/exl3/__init__.py),
so another release is refused before the server binds (glm53.engine.refuse_unservable), at load
(glm53.exl3.loader), and by `glm53 doctor`. The installed version is read without importing
exllamav3: importing it builds its CUDA extension, which fails on a host without CUDA.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib import metadata
from pathlib import Path

from glm53.errors import Glm53Error

EXLLAMAV3_VERSION = "1.6.5"
# sha256 of exllamav3-1.6.5-py3-none-any.whl on PyPI (pure Python; its CUDA extension is built at
# import): the source tests/test_exl3_patch_points.py reads the patch points from
WHEEL_SHA256 = "550c0d04c755f249840e5c1edc26b0e80c7342c33b5d99ad17479abb407e8ded"


class UnsupportedExllamaV3(RuntimeError, Glm53Error):
    pass


def source_version(package_dir: Path) -> str | None:
    """`__version__` of an exllamav3 source tree's version.py, read with ast (not run)."""
    path = Path(package_dir) / "version.py"
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    return None


def installed_version() -> str | None:
    """The installed exllamav3's version: its package metadata, else its source's version.py
    (a checkout on sys.path has no metadata); None when there is none. Nothing is imported."""
    try:
        return metadata.version("exllamav3")
    except metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or not spec.submodule_search_locations:
        return None
    return source_version(Path(next(iter(spec.submodule_search_locations))))


def version_problem(found: str | None) -> str | None:
    """Why exllamav3 `found` (None: not installed) cannot run the GPU engine; None when it can."""
    if found is None:
        return "exllamav3 is not installed"
    if found != EXLLAMAV3_VERSION:
        return (
            f"exllamav3 {found} is installed, and the GPU engine hooks exllamav3 "
            f"{EXLLAMAV3_VERSION}'s insides, exactly that release"
        )
    return None


def check_version(allow_unsupported: bool = False) -> str:
    """The installed exllamav3 version; UnsupportedExllamaV3 (one line with the fix) for any
    other than EXLLAMAV3_VERSION, unless `allow_unsupported` (GpuEngine's argument of that name,
    for trying a new release by hand)."""
    found = installed_version()
    if found is None:
        raise UnsupportedExllamaV3(
            f"exllamav3 is not installed: the GPU engine needs exllamav3=={EXLLAMAV3_VERSION} "
            "(pip install 'glm53[gpu]')"
        )
    if found != EXLLAMAV3_VERSION and not allow_unsupported:
        raise UnsupportedExllamaV3(
            f"exllamav3 {found} is installed; glm53's hooks are checked against "
            f"{EXLLAMAV3_VERSION} only: install exllamav3=={EXLLAMAV3_VERSION}"
        )
    return found
