"""Every point glm53.exl3 patches or reads (glm53.exl3.patches.POINTS), checked against
exllamav3 1.6.5's own source (the PyPI wheel, read with ast, never imported: exllamav3 builds its
CUDA extension at import). An exllamav3 that renames a method, changes its parameters or stops
setting an attribute fails here, in CI, rather than on a GPU."""

from __future__ import annotations

import ast
import re

import pytest
from exl3_source_kit import Source, exllamav3_source

from glm53.exl3.patches import POINTS, PatchPoint


@pytest.fixture(scope="session")
def src() -> Source:
    return exllamav3_source()


def _absolute(src: Source, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if src.is_package(module) else module.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """(module, the class) that `name` in `module` is: defined there, or imported from another
    exllamav3 module; None for a class from elsewhere (abc.ABC, torch)."""
    tree = src.tree(module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                target = _absolute(src, module, node)
                if (alias.asname or alias.name) == name and target.startswith("exllamav3."):
                    return _class(src, target, alias.name)
    return None


def _mro(src: Source, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases that exllamav3 defines, depth first, left to right."""
    found = _class(src, module, name)
    assert found is not None, f"exllamav3 {module} has no class {name}"
    out = [found]
    for base in found[1].bases:
        if isinstance(base, ast.Name) and _class(src, found[0], base.id) is not None:
            out += [c for c in _mro(src, found[0], base.id) if c not in out]
    return out


def _method(src: Source, point: PatchPoint) -> ast.FunctionDef | None:
    for _, cls in _mro(src, point.module, point.owner):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == point.name:
                return node
    return None


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs)


def _self_stores(fn: ast.AST, name: str) -> bool:
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        for node in ast.walk(fn)
    )


def _init(src: Source, point: PatchPoint) -> ast.FunctionDef:
    init = _method(src, PatchPoint(point.module, point.owner, "__init__", "read", None, "", ""))
    assert init is not None, f"{point.owner} has no __init__"
    return init


def _check_callable(src: Source, point: PatchPoint) -> None:
    if point.owner:
        fn = _method(src, point)
        assert fn is not None, f"{point.module}.{point.key}: no such method in exllamav3"
    else:
        defs = [
            n
            for n in src.tree(point.module).body
            if isinstance(n, ast.FunctionDef) and n.name == point.name
        ]
        assert defs, f"{point.module}.{point.name}: no such function in exllamav3"
        fn = defs[0]
    assert _params(fn) == point.params, (
        f"{point.module}.{point.key}: exllamav3 has parameters {_params(fn)}, glm53.exl3 expects "
        f"{point.params}"
    )


def _check_ext(src: Source, point: PatchPoint) -> None:
    text = src.text("exllamav3/exllamav3_ext/bindings.cpp") or ""
    m = re.search(rf'm\.def\("{point.name}",[^;]*;', text)
    assert m is not None, f"exllamav3_ext binds no {point.name}"
    assert tuple(re.findall(r'py::arg\("(\w+)"\)', m[0])) == point.params, m[0]


def _check(src: Source, point: PatchPoint) -> None:
    if point.kind == "ext":
        _check_ext(src, point)
    elif point.kind == "slot":  # glm53's entry in the instance dict, beside nothing of exllamav3
        for module, cls in _mro(src, point.module, point.owner):
            slots = [n for n in cls.body if isinstance(n, ast.Assign)
                     and any(getattr(t, "id", "") == "__slots__" for t in n.targets)]  # fmt: skip
            assert not slots, f"{module}.{cls.name} declares __slots__: no instance dict"
            assert not _self_stores(cls, point.name), f"exllamav3 sets {point.key} itself"
        assert _method(src, point) is None, f"exllamav3 defines {point.key} itself"
    elif point.kind == "attribute" or point.params is None:
        assert _self_stores(_init(src, point), point.name), (
            f"exllamav3's {point.owner}.__init__ no longer sets self.{point.name}"
        )
    else:
        _check_callable(src, point)


@pytest.mark.parametrize("point", POINTS, ids=[f"{p.kind}:{p.key}" for p in POINTS])
def test_each_patch_point_exists_in_exllamav3_with_the_expected_signature(src, point):
    _check(src, point)


def test_the_routing_property_wraps_a_four_argument_call(src):
    """glm53.exl3.hooks' property hands exllamav3 a `routed(bsz, cfg, z, params)`: every call
    BlockSparseMLP makes to its routing_fn passes those four."""
    cls = _class(src, "exllamav3.modules.block_sparse_mlp", "BlockSparseMLP")[1]
    calls = [
        n
        for n in ast.walk(cls)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "routing_fn"
    ]
    assert calls and all(len(c.args) == 4 and not c.keywords for c in calls), [
        ast.unparse(c) for c in calls
    ]


def test_the_samplers_copy_what_exllamav3s_sampler_sets(src):
    """glm53.exl3.sampler_classes.DeviceLogprobSampler copies its inner sampler's
    reqs_past_ids and reqs_torch_seed, which exllamav3's Sampler.__init__ sets."""
    init = _method(src, next(p for p in POINTS if p.key == "Sampler.__init__"))
    assert _self_stores(init, "reqs_past_ids") and _self_stores(init, "reqs_torch_seed")


def test_a_changed_signature_is_caught(src):
    """The checks themselves: a parameter list exllamav3 does not have fails, naming both."""
    real = next(p for p in POINTS if p.key == "Job.hash_completed_page")
    wrong = PatchPoint(real.module, real.owner, real.name, real.kind, ("self", "seq"), "", "")
    with pytest.raises(
        AssertionError, match=r"exllamav3 has parameters \('self', 'seq', 'page_idx'\)"
    ):
        _check(src, wrong)
    gone = PatchPoint(real.module, "Job", "no_such_method", "instance", ("self",), "", "")
    with pytest.raises(AssertionError, match="no such method"):
        _check(src, gone)
    unset = PatchPoint(real.module, "Job", "no_such_attribute", "attribute", None, "", "")
    with pytest.raises(AssertionError, match="no longer sets self.no_such_attribute"):
        _check(src, unset)
