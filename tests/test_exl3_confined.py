"""exllamav3's insides are touched in glm53/exl3/ only (issue #25), read with ast:

- no module outside glm53/exl3/ imports exllamav3, monkeypatches what it imported (an attribute
  store or setattr onto an imported name), writes into an object's `__dict__`, or reads a
  private name exllamav3 defines or one of glm53's `_g53_*` entries on exllamav3's objects;
- inside glm53/exl3/, every write onto an exllamav3 class or instance goes through the helpers
  of glm53.exl3.patches with a point declared in POINTS (which tests/test_exl3_patch_points.py
  checks against exllamav3's source), and every declared write point is used."""

from __future__ import annotations

import ast
from pathlib import Path

from exl3_source_kit import exllamav3_source

from glm53.exl3.patches import BY_KEY, POINTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glm53"
EXL3 = PACKAGE / "exl3"
HELPERS = {"patch_class": ("class",), "shadow": ("instance", "slot"),
           "unshadow": ("instance", "slot"), "assign": ("attribute",)}  # fmt: skip
WRITE_KINDS = ("class", "instance", "slot", "attribute")
POINT_NAMES = {p.name for p in POINTS if p.kind in WRITE_KINDS}
# exllamav3's private names that glm53.exl3 reads (declared as points of kind read)
PRIVATE_READS = {p.name for p in POINTS if p.name.startswith("_") and not p.name.startswith("__")}


def _files(inside: bool) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if (EXL3 in p.parents) == inside)


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _imports_exllamav3(node: ast.AST) -> bool:
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or ""]
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ):
        names = [str(node.args[0].value)]
    return any(n == "exllamav3" or n.startswith("exllamav3.") for n in names)


def _dict_writes(tree: ast.AST) -> list[ast.AST]:
    """`x.__dict__[k] = v`, `del x.__dict__[k]` and `x.__dict__.pop/update/setdefault(...)`."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store | ast.Del)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "__dict__"
        ):
            out.append(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("pop", "update", "setdefault", "clear", "popitem")
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "__dict__"
        ):
            out.append(node)
    return out


def _imported_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def outside_problems(path: Path, tree: ast.AST) -> list[str]:
    problems = []
    imported = _imported_names(tree)
    for node in ast.walk(tree):
        if _imports_exllamav3(node):
            problems.append(f"{_where(path, node)} imports exllamav3 (only glm53/exl3/ may)")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store | ast.Del)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ):
            problems.append(f"{_where(path, node)} assigns {node.value.id}.{node.attr} (imported)")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
        ):
            problems.append(f"{_where(path, node)} calls {node.func.id} (only glm53/exl3/ may)")
        if isinstance(node, ast.Attribute) and not _is_self(node.value):
            if node.attr.startswith("_g53_") or node.attr in PRIVATE_READS:
                problems.append(f"{_where(path, node)} reads exllamav3's insides: .{node.attr}")
            elif isinstance(node.ctx, ast.Store | ast.Del) and node.attr in POINT_NAMES:
                problems.append(f"{_where(path, node)} writes .{node.attr}, a patch point")
    problems += [f"{_where(path, n)} writes into a __dict__" for n in _dict_writes(tree)]
    return problems


def test_nothing_outside_glm53_exl3_imports_or_patches_exllamav3():
    problems = []
    for path in _files(inside=False):
        problems += outside_problems(path, ast.parse(path.read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


def _private_names(tree: ast.AST) -> set[str]:
    """`_x` names (not dunders) that the classes of one module define: methods, `self._x =`."""
    out = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            name = None
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            if name and name.startswith("_") and not name.startswith("__"):
                out.add(name)
    return out


def test_nothing_outside_glm53_exl3_reads_a_private_name_of_exllamav3():
    """Every private name exllamav3 1.6.5's classes define (read from its source: needs the
    wheel, tests/exl3_source_kit.py), read off anything but self outside glm53/exl3/."""
    src = exllamav3_source()
    private: set[str] = set()
    for path in src.python_files():
        private |= _private_names(ast.parse(src.text(path) or "", path))
    assert "_get_prefetch_layers" in private  # the one glm53.exl3 reads (layer_major)
    problems = [
        f"{_where(path, node)} reads .{node.attr}, private in exllamav3"
        for path in _files(inside=False)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and node.attr in private and not _is_self(node.value)
    ]
    assert not problems, "\n".join(problems)


def _helper_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) in HELPERS
    ]


def inside_problems(path: Path, tree: ast.AST) -> list[str]:
    """Writes in a glm53/exl3/ module that bypass glm53.exl3.patches, and helper calls whose
    point is not declared with the helper's kind."""
    problems = []
    if path.name != "patches.py":
        problems += [f"{_where(path, n)} writes into a __dict__" for n in _dict_writes(tree)]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
            ):
                problems.append(
                    f"{_where(path, node)} calls {node.func.id}: use glm53.exl3.patches"
                )
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store | ast.Del)
                and node.attr in POINT_NAMES
                and not _is_self(node.value)
            ):
                problems.append(f"{_where(path, node)} writes .{node.attr}: use glm53.exl3.patches")
    for call in _helper_calls(tree):
        key = call.args[1] if len(call.args) > 1 else None
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            problems.append(f"{_where(path, call)}: {call.func.id}'s point is not a literal")
            continue
        point = BY_KEY.get(key.value)
        if point is None or point.kind not in HELPERS[call.func.id]:
            problems.append(
                f"{_where(path, call)}: {call.func.id}(..., {key.value!r}) is not declared in "
                f"POINTS as {' or '.join(HELPERS[call.func.id])}"
            )
    return problems


def test_inside_glm53_exl3_every_write_goes_through_a_declared_point():
    problems = []
    for path in _files(inside=True):
        problems += inside_problems(path, ast.parse(path.read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


def test_every_declared_write_point_is_used():
    """A point declared but never written is stale: drop it (or its test checks nothing)."""
    used = set()
    for path in _files(inside=True):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used |= {c.args[1].value for c in _helper_calls(tree) if len(c.args) > 1}
    stale = [p.key for p in POINTS if p.kind in WRITE_KINDS and p.key not in used]
    assert not stale, stale


def test_every_read_and_subclass_point_is_used_where_it_says():
    """A read, ext or subclass point names the glm53.exl3 module(s) that use it: the name
    occurs there (a subclass point: a class there subclasses its owner)."""
    missing = []
    for p in POINTS:
        if p.kind in WRITE_KINDS:
            continue
        for where in p.where.split(", "):
            tree = ast.parse((EXL3 / f"{where}.py").read_text(encoding="utf-8"))
            if p.kind == "subclass":
                found = any(
                    isinstance(n, ast.ClassDef)
                    and any(getattr(b, "id", "") == p.owner for b in n.bases)
                    for n in ast.walk(tree)
                )
            else:
                found = any(
                    getattr(n, "attr", None) == p.name or getattr(n, "id", None) == p.name
                    or (isinstance(n, ast.alias) and n.name == p.name)
                    for n in ast.walk(tree)
                )  # fmt: skip
            if not found:
                missing.append(f"{p.key} in glm53/exl3/{where}.py")
    assert not missing, missing


def test_the_checks_catch_what_they_are_for():
    """The checks themselves, on code written here: each kind of bypass is named."""
    here = PACKAGE / "engine" / "example.py"
    outside = ast.parse(
        "import exllamav3\n"
        "from exllamav3.modules.block_sparse_mlp import BlockSparseMLP\n"
        "BlockSparseMLP.routing_fn = None\n"
        "setattr(job, 'prefill', f)\n"
        "job.prefill = f\n"
        "x = model._get_prefetch_layers\n"
        "mod.__dict__['_g53_cache'] = c\n"
    )
    assert [p.split(" ", 1)[1] for p in outside_problems(here, outside)] == [
        "imports exllamav3 (only glm53/exl3/ may)",
        "imports exllamav3 (only glm53/exl3/ may)",
        "assigns BlockSparseMLP.routing_fn (imported)",
        "writes .routing_fn, a patch point",
        "calls setattr (only glm53/exl3/ may)",
        "writes .prefill, a patch point",
        "reads exllamav3's insides: ._get_prefetch_layers",
        "writes into a __dict__",
    ]
    inside = ast.parse(
        "job.prefill = f\n"
        "shadow(job, 'Job.no_such', f)\n"
        "patch_class(Job, 'Job.prefill', f)\n"
        "mod.__dict__.pop('_g53_cache', None)\n"
    )
    found = [p.split(" ", 1)[1] for p in inside_problems(EXL3 / "example.py", inside)]
    assert found == [
        "writes into a __dict__",
        "writes .prefill: use glm53.exl3.patches",
        "shadow(..., 'Job.no_such') is not declared in POINTS as instance or slot",
        "patch_class(..., 'Job.prefill') is not declared in POINTS as class",
    ]


def test_the_helpers_refuse_an_undeclared_point():
    import pytest

    from glm53.exl3.patches import UndeclaredPatch, patch_class, shadow

    class Plain:
        pass

    with pytest.raises(UndeclaredPatch, match="Job.no_such: not declared"):
        shadow(Plain(), "Job.no_such", 1)
    with pytest.raises(UndeclaredPatch, match="Job.prefill: not declared .* as class"):
        patch_class(Plain, "Job.prefill", 1)
    obj = Plain()
    shadow(obj, "Job.prefill", 1)
    assert vars(obj) == {"prefill": 1}
