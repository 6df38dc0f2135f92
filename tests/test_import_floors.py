"""Imports run one way (DESIGN.md section 2, STYLE.md habit 1): every glm53 module's imports,
read with ast (function-level and TYPE_CHECKING imports included, and importlib.import_module of
a literal name), form no circle, and none runs from a lower floor to a higher one. A new arrow
the wrong way fails here with the file, the line and both floors: move the shared part down a
floor, or pass a callback up, rather than adding it to KNOWN_WRONG_WAY."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm53"

# The floors, from the ground up. A module may import modules of its own floor and of the floors
# below it. An entry holds that module and, for a package, every module under it ("glm53.plan");
# "glm53" is the package's face alone; "glm53._*" the native modules and the generated _buildinfo.
# Where entries overlap the longest decides.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # imports nothing above: the package face, native modules, settings, modes, units, sd_notify
    (
        "ground",
        (
            "glm53",
            "glm53._*",
            "glm53.config",
            "glm53.errors",
            "glm53.modes",
            "glm53.units",
            "glm53.notify",
        ),
    ),
    # checkpoint reading and the reference-panel format: plain data, no tiers or engines
    ("models", ("glm53.models", "glm53.reference")),
    # torch-free planning, shared by the engines and the doctor
    ("plan", ("glm53.plan",)),
    # the packed expert store and the O_DIRECT reads both expert sources share
    ("store", ("glm53.store",)),
    # the synthetic checkpoint writer (the engine writes the demo checkpoint with it)
    ("synth", ("glm53.synth",)),
    # the expert tier system (knows no exllamav3)
    ("tiers", ("glm53.tiers",)),
    # the one adapter over exllamav3: load, hooks, fast lane and nvme glue, prefix reuse, the
    # samplers, the layer split and layer-major prefill (the only importer of exllamav3)
    ("exl3", ("glm53.exl3",)),
    # request types, the scheduler, the CPU and GPU engines (the GPU one over glm53.exl3)
    ("engine", ("glm53.engine",)),
    # prompt rendering and output parsing
    ("chat", ("glm53.chat",)),
    # the HTTP API over an engine
    ("api", ("glm53.api",)),
    # `glm53 doctor`: host probe and planner (reads the GPU engine's page size and served modes)
    ("doctor", ("glm53.doctor",)),
    # the other subcommands
    ("commands", ("glm53.serve", "glm53.download", "glm53.reference_cli")),
    # the `glm53` entry point, which lists every subcommand
    ("entry", ("glm53.cli", "glm53.__main__")),
]

# Arrows the wrong way that this step could not remove: (importer, imported) -> why. Empty: every
# arrow runs down. An entry that no longer runs the wrong way fails test_known_exceptions_are_live.
KNOWN_WRONG_WAY: dict[tuple[str, str], str] = {}


class Arrow(NamedTuple):
    importer: str
    imported: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES or name.startswith("glm53._")  # native: a .pyi here, built elsewhere


def _target(name: str) -> str:
    """The module an imported name lives in: the name itself when it is a module, else the
    nearest enclosing one (a name defined in a module or a package's face)."""
    if _is_module(name):
        return name
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported_names(node: ast.AST, module: str, path: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = _package_of(module, path).split(".")
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def arrows() -> list[Arrow]:
    out = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _imported_names(node, module, path):
                if name == "glm53" or name.startswith("glm53."):
                    target = _target(name)
                    if target != module:
                        out.add(Arrow(module, target, path, node.lineno))
    return sorted(out)


def _holds(entry: str, module: str) -> bool:
    if entry.endswith("*"):
        return module.startswith(entry[:-1])
    return module == entry or (entry != "glm53" and module.startswith(entry + "."))


def floor_of(module: str) -> int:
    best, floor = "", None
    for i, (_, entries) in enumerate(FLOORS):
        for entry in entries:
            if _holds(entry, module) and len(entry) > len(best):
                best, floor = entry, i
    assert floor is not None, f"{module} is on no floor: add it to FLOORS"
    return floor


def _wrong_way(arrow: Arrow) -> bool:
    return floor_of(arrow.importer) < floor_of(arrow.imported)


def _circles(found: list[Arrow]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan, iteratively)."""
    graph = defaultdict(set)
    for a in found:
        graph[a.importer].add(a.imported)
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_import_circles():
    found = arrows()
    problems = []
    for circle in _circles(found):
        ties = [
            f"{a.where()} {a.importer} -> {a.imported}"
            for a in found
            if a.importer in circle and a.imported in circle
        ]
        problems.append(f"circle of {', '.join(circle)}:\n    " + "\n    ".join(ties))
    assert not problems, "\n".join(problems)


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    problems = [
        f"{a.where()}: {a.importer} (floor {FLOORS[floor_of(a.importer)][0]}) imports "
        f"{a.imported} (floor {FLOORS[floor_of(a.imported)][0]}, higher)"
        for a in arrows()
        if _wrong_way(a) and (a.importer, a.imported) not in KNOWN_WRONG_WAY
    ]
    assert not problems, "\n".join(problems)


def test_known_exceptions_are_live():
    live = {(a.importer, a.imported) for a in arrows() if _wrong_way(a)}
    stale = [f"{a} -> {b}" for a, b in KNOWN_WRONG_WAY if (a, b) not in live]
    assert not stale, f"KNOWN_WRONG_WAY lists arrows that no longer run the wrong way: {stale}"


def test_the_floors_catch_an_arrow_the_wrong_way():
    """The checks themselves: an import added to a plan module, up into the engine, is read
    (inside a function too) and named with its file, line and both floors."""
    tree = ast.parse("def f():\n    from glm53.engine import gpu\n")
    node = tree.body[0].body[0]
    path = PACKAGE / "plan" / "vram.py"
    (name,) = _imported_names(node, "glm53.plan.vram", path)
    arrow = Arrow("glm53.plan.vram", _target(name), path, node.lineno)
    assert arrow == Arrow("glm53.plan.vram", "glm53.engine.gpu", path, 2)
    assert _wrong_way(arrow) and arrow.where() == "glm53/plan/vram.py:2"
    assert [FLOORS[floor_of(m)][0] for m in arrow[:2]] == ["plan", "engine"]
    assert _circles([Arrow("a", "b", path, 1), Arrow("b", "a", path, 1)]) == [["a", "b"]]


def test_planning_imports_without_torch():
    code = (
        "import pkgutil, sys, importlib, glm53.plan; "
        "[importlib.import_module(m.name) for m in pkgutil.iter_modules(glm53.plan.__path__, "
        "'glm53.plan.')]; print(sorted(m for m in sys.modules if m.startswith('glm53.plan.'))); "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "glm53.plan.vram" in out.stdout and "glm53.plan.split" in out.stdout
