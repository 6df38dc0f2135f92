"""tests/gpu/ runs only where a CUDA GPU is present; elsewhere every test in it is
reported as skipped with the reason. On the GPU machine (tools/gpu-check.sh sets
GLM53_GPU_STRICT=1) a file skipped because a module it needs cannot be imported fails instead:
a group that silently left out its server tests (openai missing there on 2026-12-04) passed
without running them.

GLM53_GPU_LIVE_LOG (tools/gpu-check.sh sets it) names a file that gets each test's outcome, and a
failure's whole report, the moment the test ends: on 2026-12-05 a group cut by its deadline died
without pytest's summary or junit, and only the progress line ("FF.FF.....F") said what failed."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_runtest_logreport(report):
    path = os.environ.get("GLM53_GPU_LIVE_LOG")
    if not path or (report.when != "call" and report.passed):
        return
    import time

    line = f"{time.strftime('%H:%M:%S')} {report.outcome.upper()} {report.when} "
    line += f"{report.duration:.1f}s {report.nodeid}\n"
    if report.failed:
        line += report.longreprtext + "\n" + "-" * 80 + "\n"
    with open(path, "a") as f:
        f.write(line)


def _have_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_finish(session):
    """Declare the stock-reference runs of every collected file (its module-level
    `reference_specs()`), so that the first reference on a checkpoint computes them all in one
    process (gpu_kit.stock_reference)."""
    if not _have_gpu():
        return
    import gpu_kit

    seen = set()
    for item in session.items:
        module = getattr(item, "module", None)
        specs = getattr(module, "reference_specs", None)
        if specs is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        for spec in specs():
            gpu_kit.declare_reference(spec)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if (
        os.environ.get("GLM53_GPU_STRICT") == "1"
        and report.skipped
        and "could not import" in str(report.longrepr)
    ):
        report.outcome = "failed"
        report.longrepr = f"GLM53_GPU_STRICT: {collector.nodeid} was skipped: {report.longrepr}"
    return report


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/)")
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def shared_exllamav3_tune_cache(tmp_path_factory):
    """One exllamav3 GEMM tune cache for the whole session, reference processes and glm53 servers
    alike (servers get their own XDG_CACHE_HOME, which would otherwise give each its own):
    exllamav3 picks kernels by timing at first use, and the rounding follows the pick, so stock
    exllamav3 is the reference under the same picks, not under picks of its own timing."""
    import os

    if os.environ.get("EXLLAMAV3_TUNE_CACHE"):
        yield os.environ["EXLLAMAV3_TUNE_CACHE"]
        return
    path = str(tmp_path_factory.mktemp("exllamav3-tune") / "coop_autotune_v1.bin")
    os.environ["EXLLAMAV3_TUNE_CACHE"] = path
    yield path
    del os.environ["EXLLAMAV3_TUNE_CACHE"]


@pytest.fixture(scope="session", autouse=True)
def references_before_engines(shared_exllamav3_tune_cache, tmp_path_factory):
    """Every declared stock reference, computed or loaded before the session's first test, so
    before any of its engines tunes a kernel (gpu_kit's docstring: a process reads exllamav3's
    tune file once; the references' picks must be in it by then)."""
    if not _have_gpu():
        yield 0
        return
    import gpu_kit

    yield gpu_kit.all_declared_references(tmp_path_factory.mktemp("references"))


@pytest.fixture(scope="session")
def slice_store(tmp_path_factory):
    """The slice's store (`glm53 store pack` of GLM53_TEST_SLICE), packed once for the session:
    GLM53_TEST_SLICE_STORE names one already packed from it. Tests that change it copy it or
    restore what they changed."""
    import os
    import shutil

    from gpu_kit import checkpoint_dir

    path = checkpoint_dir("GLM53_TEST_SLICE")
    if path is None:
        pytest.skip("no slice checkpoint (GLM53_TEST_SLICE)")
    if os.environ.get("GLM53_TEST_SLICE_STORE"):
        yield os.environ["GLM53_TEST_SLICE_STORE"]
        return
    from glm53.store.pack import pack

    store = str(tmp_path_factory.mktemp("slice-store") / "store")
    pack(path, store, include_mtp=False, io_threads=8)
    yield store
    shutil.rmtree(store, ignore_errors=True)
