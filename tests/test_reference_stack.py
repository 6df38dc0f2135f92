"""The CPU engine's reference stack (glm53.reference.REFERENCE_STACK) is pinned in one place,
pyproject.toml, and what is installed is that stack.

The CPU engine's numbers follow transformers and torch: under transformers 5.16.1 six CPU-engine
tests fail, and an unpinned `transformers>=5.16` let pip take whatever was newest. A different
stack must fail here, naming the installed and the pinned versions, before it shows up as a
top-1 agreement of 0.545 that looks like a model bug. CI installs under .ci/constraints.txt,
which must agree with the pins."""

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from glm53.reference import REFERENCE_STACK, read_panel

ROOT = Path(__file__).resolve().parents[1]
PANEL = ROOT / "reference" / "demo-panel.json"


STACK = {canonicalize_name(n) for n in REFERENCE_STACK}


def pins() -> dict[str, str]:
    """Package -> exact version: from pyproject's dependencies, and for torch from its test
    extra (the dependencies admit any torch >= 2.4, so that a GPU host keeps its CUDA build)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for where in ("dependencies", "test"):
        texts = (
            project[where] if where == "dependencies" else project["optional-dependencies"][where]
        )
        for text in texts:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name not in STACK or (name == "torch") != (where == "test"):
                continue
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", (
                f"pyproject.toml ({where}): {text!r} must pin one exact version (==): the CPU "
                "engine's numbers are checked under one stack only"
            )
            out[name] = specs[0].version
    return out


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def base(v: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (a local build label is not another release)."""
    return Version(v).base_version if v != "not installed" else v


def test_every_package_of_the_reference_stack_is_pinned_exactly():
    assert set(pins()) == STACK


def test_the_installed_reference_stack_is_the_pinned_one():
    wrong = {
        name: (installed(name), want)
        for name, want in pins().items()
        if base(installed(name)) != want
    }
    assert not wrong, (
        "the CPU engine's reference stack differs from pyproject.toml's pins, so its numbers "
        "(and the CPU fidelity tests) are not the checked ones: "
        + "; ".join(f"{n} {got} is installed, {want} is pinned" for n, (got, want) in wrong.items())
        + ". Install the pins: pip install 'torch==2.13.0' --index-url "
        "https://download.pytorch.org/whl/cpu && pip install -e '.[test]' (or run .ci/run)"
    )


def test_the_demo_panel_was_made_under_the_pinned_stack():
    recorded = {canonicalize_name(k): v for k, v in read_panel(PANEL).versions.items()}
    wrong = {
        name: (recorded.get(name, "not recorded"), want)
        for name, want in pins().items()
        if base(recorded.get(name, "not installed")) != want
    }
    assert not wrong, (
        f"{PANEL.relative_to(ROOT)} was made under another stack than pyproject.toml pins: "
        + "; ".join(f"{n} {got} made it, {want} is pinned" for n, (got, want) in wrong.items())
        + ". Regenerate it under the pins: glm53 reference make --engine cpu --model "
        "<cache>/demo-checkpoint --out reference/demo-panel.json"
    )


def test_ci_constraints_agree_with_the_pins():
    lines = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    locked = {}
    for line in lines:
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
            assert m, f".ci/constraints.txt: {line!r} is not name==version"
            locked[canonicalize_name(m[1])] = m[2]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f".ci/constraints.txt does not pin {name} (pyproject: {text!r})"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f".ci/constraints.txt pins {name}=={locked[name]}, outside pyproject's {text!r}"
        )
