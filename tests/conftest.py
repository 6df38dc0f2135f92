"""Fixtures shared by test modules: one `glm53 serve --demo` on the CPU engine per session
(writing the demo checkpoint takes a minute or more on a CI-sized host, so it is written once)."""

import shutil
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


# The stand-in-routing demo checkpoint and its packed store, shared by the tier check and the
# fault tests (written and packed once per session; tests that damage a store take `store`).
@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    from glm53.synth.shapes import preset
    from glm53.synth.writer import write_checkpoint

    out = tmp_path_factory.mktemp("stand-in") / "demo"
    write_checkpoint(preset("demo"), out, seed=0, routing_source="stand-in")
    return out


@pytest.fixture(scope="session")
def small_store(tmp_path_factory):
    """store_kit's small checkpoint (16 records) packed once, in a directory that takes
    O_DIRECT; for tests that read it and leave it as it is."""
    from store_kit import direct_dir, make_checkpoint

    from glm53.store.pack import pack

    ckpt = make_checkpoint(tmp_path_factory.mktemp("small") / "ckpt")
    out = direct_dir(tmp_path_factory.mktemp("small-store")) / "store"
    pack(ckpt, out, threads=2, io_threads=2)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def good_store(demo, tmp_path_factory):
    from store_kit import direct_dir

    from glm53.store.pack import pack

    out = direct_dir(tmp_path_factory.mktemp("stand-in-store")) / "store"
    pack(demo, out, include_mtp=False, threads=1, io_threads=2)
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def store(good_store, tmp_path):
    """A private copy of the good store, to damage."""
    from store_kit import direct_dir

    dst = direct_dir(tmp_path) / "store"
    shutil.copytree(good_store, dst)
    yield dst
    shutil.rmtree(dst, ignore_errors=True)
