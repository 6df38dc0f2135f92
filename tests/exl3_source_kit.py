"""exllamav3 1.6.5's own Python source, read with ast and never imported (importing exllamav3
builds its CUDA extension). From an installed exllamav3 of that version (found with find_spec,
which does not run it), else from the PyPI wheel, downloaded once into ~/.cache/glm53-tests and
checked against the sha256 glm53.exl3.version records. Where the wheel cannot be had, the tests
that need it fail under CI (env CI set) and are skipped elsewhere, with the reason."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

import pytest

from glm53.exl3.version import EXLLAMAV3_VERSION, WHEEL_SHA256, installed_version

WHEEL = f"exllamav3-{EXLLAMAV3_VERSION}-py3-none-any.whl"
CACHE = Path.home() / ".cache" / "glm53-tests" / f"exllamav3-{EXLLAMAV3_VERSION}"


class Source:
    """exllamav3's modules by dotted name: `tree("exllamav3.model.model")` is its ast."""

    def __init__(self, read, origin: str, paths: list[str]):
        self._read, self.origin, self.paths = read, origin, paths
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            base = module.replace(".", "/")
            for path in (f"{base}.py", f"{base}/__init__.py"):
                text = self._read(path)
                if text is not None:
                    self._trees[module] = ast.parse(text, path)
                    break
            else:
                raise KeyError(f"{module}: not in exllamav3 {EXLLAMAV3_VERSION} ({self.origin})")
        return self._trees[module]

    def python_files(self) -> list[str]:
        return [p for p in self.paths if p.endswith(".py")]

    def is_package(self, module: str) -> bool:
        return self._read(module.replace(".", "/") + "/__init__.py") is not None

    def text(self, path: str) -> str | None:
        return self._read(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _installed() -> Source | None:
    spec = importlib.util.find_spec("exllamav3")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    if installed_version() != EXLLAMAV3_VERSION:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent

    def read(path: str) -> str | None:
        p = root / path
        return p.read_text(encoding="utf-8") if p.is_file() else None

    files = sorted(str(p.relative_to(root)) for p in (root / "exllamav3").rglob("*.py"))
    return Source(read, f"installed at {root}", files)


def _unavailable(why: str):
    message = (
        f"exllamav3 {EXLLAMAV3_VERSION}'s source is needed to check glm53.exl3's patch points, "
        f"and {why}"
    )
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _wheel() -> Source:
    path = CACHE / WHEEL
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"exllamav3=={EXLLAMAV3_VERSION}",
               "--no-deps", "--only-binary", ":all:", "-d", str(CACHE)]  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _unavailable(f"`{' '.join(cmd)}` did not finish: {exc}")
        if out.returncode != 0 or not path.is_file():
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            _unavailable(f"`{' '.join(cmd)}` failed: {tail[0]}")
    got = _sha256(path)
    assert got == WHEEL_SHA256, (
        f"{path}: sha256 {got}, but glm53.exl3.version.WHEEL_SHA256 is {WHEEL_SHA256}: the "
        "cached wheel is not PyPI's exllamav3 1.6.5; delete it and run again"
    )
    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())

    def read(name: str) -> str | None:
        return archive.read(name).decode("utf-8") if name in names else None

    return Source(read, str(path), sorted(names))


@cache
def exllamav3_source() -> Source:
    return _installed() or _wheel()
