"""Fixtures shared by test modules: one `glm53 serve --demo` on the CPU engine per session
(writing the demo checkpoint takes a minute or more on a CI-sized host, so it is written once)."""

from pathlib import Path

import pytest
from serving_kit import Server

import glm53

CPU_ENGINE = Path(glm53.__file__).parent / "engine" / "cpu.py"


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`glm53 serve --demo --engine cpu` with a fresh cache directory, 2048-token context and
    16-token prefill chunks (so that a prompt of a few dozen tokens spans several steps)."""
    if not CPU_ENGINE.exists():
        pytest.skip("the CPU engine (glm53/engine/cpu.py) has not landed yet")
    tmp = tmp_path_factory.mktemp("cpu")
    server = Server(
        [
            "--demo",
            "--engine",
            "cpu",
            "--cache-dir",
            str(tmp / "cache"),
            "-cs",
            "2048",
            "--chunk-size",
            "16",
        ],
        log_path=tmp / "log",
    )
    server.wait_ready(timeout_s=900)
    server.cache_dir = tmp / "cache"
    yield server
    assert server.stop() == 0, server.log()
