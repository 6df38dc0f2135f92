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
