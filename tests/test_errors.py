"""Every exception class glm53 defines derives from glm53.errors.Glm53Error (issue #25: one
error root), beside the built-in class it always had. Every glm53 module that imports here is
read; a module that needs what this machine lacks (a CUDA build, exllamav3) is named, not
silently passed over."""

import importlib
import pkgutil

import glm53
from glm53.errors import Glm53Error

# modules that import only with the GPU stack (exllamav3, the CUDA extension)
NEEDS_GPU_STACK = ("exllamav3", "glm53._cuda")


def _modules():
    for info in pkgutil.walk_packages(glm53.__path__, "glm53."):
        try:
            yield importlib.import_module(info.name)
        except ImportError as exc:
            assert exc.name and exc.name.startswith(NEEDS_GPU_STACK), (info.name, exc)


def test_every_exception_glm53_defines_derives_from_glm53error():
    found, outside = [], []
    for module in _modules():
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found.append(value.__qualname__)
                if not issubclass(value, Glm53Error):
                    outside.append(f"{module.__name__}.{value.__qualname__}")
    assert not outside, f"exception classes outside glm53.errors.Glm53Error: {outside}"
    assert len(found) >= 25, found  # the classes of 2026-12-04 at least


def test_the_root_keeps_each_class_builtin_base():
    from glm53.config import ConfigurationError
    from glm53.engine.base import EngineError, PromptTooLong
    from glm53.store.direct_io import ExpertReadError

    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(PromptTooLong, ValueError) and issubclass(EngineError, RuntimeError)
    assert issubclass(ExpertReadError, OSError)
    assert all(issubclass(c, Glm53Error) for c in (ConfigurationError, EngineError))


# the pure-Python twins of the native CLOCK table (glm53._clock: plain and policy="freq") raise
# what it raises (tests/test_clock.py and tests/test_freq_clock.py compare them call by call)
MIRRORS_NATIVE = {"glm53/tiers/clock_ref.py", "glm53/tiers/freq_clock_ref.py"}


def _message_text(node) -> str:
    """The literal parts of an exception's message: a string, an f-string or a concatenation."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_message_text(v) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _message_text(node.left) + _message_text(node.right)
    return ""


def test_a_bare_runtime_error_is_an_internal_error():
    """What a user causes or can fix raises a Glm53Error subclass whose message names the fix;
    a bare RuntimeError is left only for an invariant of glm53's own, and says so."""
    import ast
    from pathlib import Path

    root = Path(glm53.__file__).parent
    bare = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel in MIRRORS_NATIVE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            exc = node.exc if isinstance(node, ast.Raise) else None
            if not (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name)):
                continue
            if exc.func.id != "RuntimeError":
                continue
            text = _message_text(exc.args[0]) if exc.args else ""
            if not text.startswith("internal error"):
                bare.append(f"{rel}:{node.lineno}: {text[:60]!r}")
    assert not bare, "user-facing RuntimeErrors (use a Glm53Error subclass):\n" + "\n".join(bare)
