"""tests/gpu/gpu_kit.py's CPU-side logic: how a stock-reference spec splits into units (a run
with its floor is one unit), how the units' results go back to the runs that asked, and the
teacher-forced KL / top-1 measure the fast-mode tests judge against exllamav3's floor. The
reference process itself (tools/exl3_reference.py) needs a GPU; here a MOCK stands in for its
output file so that the bookkeeping around it can run."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import gpu_kit  # noqa: E402


def _spec(runs):
    return {"model": "/nowhere", "max_new_tokens": 3, "runs": runs}


def test_a_run_with_its_floor_is_one_unit_and_not_the_plain_runs_unit():
    alone = {"prompts": [[1], [2, 3]]}
    floor = dict(alone, floor=True)
    plain_units = gpu_kit._units(_spec([alone]))
    floor_units = gpu_kit._units(_spec([floor]))
    assert len(plain_units) == 2  # each prompt alone is its own unit
    assert len(floor_units) == 1 and floor_units[0][1]["prompts"] == [[1], [2, 3]]
    assert floor_units[0][1]["floor"] is True and floor_units[0][1]["together"] is False
    assert floor_units[0][0] not in {k for k, _ in plain_units}


def test_results_go_back_to_the_runs_that_asked(tmp_path, monkeypatch):
    """MOCK of the reference process: writes, per unit it was given, a result shaped as
    tools/exl3_reference.py writes it (a list per run, a dict per prompt)."""
    monkeypatch.setattr(gpu_kit, "_REFERENCE", {})
    monkeypatch.setattr(gpu_kit, "_DECLARED", [])

    def mock_reference(cmd, **kw):
        spec = json.loads(Path(cmd[2]).read_text())
        out = []
        for run in spec["runs"]:
            res = []
            for p in run["prompts"]:
                d = {"tokens": [len(p)], "logits": torch.zeros(1, 4)}
                if run.get("floor"):
                    d["floor_logits"] = torch.ones(1, 4)
                res.append(d)
            out.append(res)
        torch.save(out, cmd[3])

    monkeypatch.setattr(gpu_kit.subprocess, "run", mock_reference)
    spec = _spec([
        {"prompts": [[1], [2, 3]]},
        {"prompts": [[4, 5, 6], [7]], "floor": True},
        {"prompts": [[8], [9, 9]], "together": True},
    ])  # fmt: skip
    alone, floor, together = gpu_kit.stock_reference(spec, tmp_path)
    assert [r["tokens"] for r in alone] == [[1], [2]]
    assert [r["tokens"] for r in floor] == [[3], [1]]
    assert all(torch.equal(r["floor_logits"], torch.ones(1, 4)) for r in floor)
    assert [r["tokens"] for r in together] == [[1], [2]]
    assert "floor_logits" not in alone[0]


def test_kl_top1_is_zero_and_one_on_the_same_logits_and_counts_disagreements():
    g = torch.Generator().manual_seed(0)
    want = [torch.randn(5, 11, generator=g), torch.randn(3, 11, generator=g)]
    tokens = [w.argmax(-1).tolist() for w in want]
    kl, top1 = gpu_kit.kl_top1(want, [w.clone() for w in want], tokens)
    assert kl == 0.0 and top1 == 1.0
    worse = [w.clone() for w in want]
    worse[0][2] = -want[0][2]  # one position's distribution flipped: its argmax moves
    kl2, top1b = gpu_kit.kl_top1(want, worse, tokens)
    assert kl2 > 0.0 and top1b == 7 / 8


class StuckEngine:
    """MOCK of a GpuEngine whose job never ends (a product bug the GPU tests must report, not
    spin on): has work forever, and each iteration gives nothing."""

    def __init__(self):
        self.iterations = 0

    def start(self, key, request, n_new, return_logits=False):
        pass

    def has_work(self):
        return True

    def iterate(self):
        self.iterations += 1
        return []

    def stats(self):
        return {"iterations": self.iterations}


def test_run_engine_fails_naming_the_engine_state_instead_of_spinning_on_a_stuck_job():
    engine = StuckEngine()
    limit = gpu_kit.iteration_limit([[1] * 300], 4)
    assert limit == 2 * (300 // 256 + 2 + 256 + 4) + 100
    with pytest.raises(AssertionError, match=r"run_engine, 1 prompts: \{'iterations': \d+\}"):
        gpu_kit.run_engine(engine, [[1] * 300], 4)
    assert engine.iterations == limit


def test_bounded_ends_silently_when_the_loop_breaks_and_counts_tensor_prompts_by_length():
    for i in gpu_kit.bounded(5, "never said"):
        if i == 2:
            break
    with pytest.raises(AssertionError, match="what: not done after 3 iterations"):
        for _ in gpu_kit.bounded(3, lambda: "what"):
            pass
    tensor = torch.zeros(1, 600, dtype=torch.long)
    assert gpu_kit.iteration_limit([tensor], 8) == gpu_kit.iteration_limit([[0] * 600], 8)


def _mock_reference(log: Path):
    """MOCK of tools/exl3_reference.py: one result per prompt, each computation logged."""

    def run(cmd, **kw):
        spec = json.loads(Path(cmd[2]).read_text())
        with open(log, "a") as f:
            f.write(json.dumps([p for r in spec["runs"] for p in r["prompts"]]) + "\n")
        out = [[{"tokens": [len(p)], "logits": torch.zeros(1, 4)} for p in r["prompts"]]
               for r in spec["runs"]]  # fmt: skip
        torch.save(out, cmd[3])

    return run


def _shared_setup(tmp_path, monkeypatch):
    """A checkpoint directory (its config.json only), GLM53_REFERENCE_DIR under tmp_path, no
    declared runs, and the reference process mocked (_mock_reference): (model, its log)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "computed.log"
    monkeypatch.setenv("GLM53_REFERENCE_DIR", str(tmp_path / "shared"))
    monkeypatch.setattr(gpu_kit, "_DECLARED", [])
    monkeypatch.setattr(gpu_kit.subprocess, "run", _mock_reference(log))
    return model, log


def test_a_unit_saved_in_the_shared_directory_is_loaded_not_computed_again(tmp_path, monkeypatch):
    """GLM53_REFERENCE_DIR: what one process computed, another (here: the same module with its
    memory cleared) loads; only a unit nobody computed yet runs, and a checkpoint written again
    (its config.json newer) is computed again."""
    import os

    model, log = _shared_setup(tmp_path, monkeypatch)
    spec = {"model": str(model), "max_new_tokens": 3, "runs": [{"prompts": [[1], [2, 3]]}]}
    monkeypatch.setattr(gpu_kit, "_REFERENCE", {})
    (first,) = gpu_kit.stock_reference(spec, tmp_path)
    monkeypatch.setattr(gpu_kit, "_REFERENCE", {})  # another process
    (again,) = gpu_kit.stock_reference(spec, tmp_path)
    assert [r["tokens"] for r in again] == [[1], [2]] == [r["tokens"] for r in first]
    more = dict(spec, runs=[{"prompts": [[1], [4, 5, 6]]}])
    (third,) = gpu_kit.stock_reference(more, tmp_path)
    assert [r["tokens"] for r in third] == [[1], [3]]
    assert log.read_text().splitlines() == ["[[1], [2, 3]]", "[[4, 5, 6]]"]
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    monkeypatch.setattr(gpu_kit, "_REFERENCE", {})
    gpu_kit.stock_reference(spec, tmp_path)
    assert log.read_text().splitlines()[-1] == "[[1], [2, 3]]"


def test_two_processes_on_one_checkpoint_take_turns_and_the_second_computes_nothing(tmp_path):
    """Two real processes ask for the same units at the same moment (each waits for the other's
    start mark first); the per-checkpoint lock makes the second wait for the first and then
    load its units: one computation in all."""
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    log = tmp_path / "computed.log"
    script = tmp_path / "ask.py"
    script.write_text(f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(gpu_kit.__file__).parent)!r})
sys.path.insert(0, {str(Path(__file__).parent)!r})
import gpu_kit, test_gpu_kit
real = test_gpu_kit._mock_reference(Path({str(log)!r}))
def slow(cmd, **kw):
    time.sleep(2)  # long enough for the other process to reach the lock
    real(cmd, **kw)
gpu_kit.subprocess.run = slow
me, other = Path(sys.argv[1]), Path(sys.argv[2])
me.touch()
for _ in range(6000):  # at most a minute for the other process to start
    if other.exists():
        break
    time.sleep(0.01)
else:
    sys.exit("the other process never started")
spec = {{"model": {str(model)!r}, "max_new_tokens": 3, "runs": [{{"prompts": [[7], [8, 9]]}}]}}
(got,) = gpu_kit.stock_reference(spec, Path(sys.argv[3]))
assert [r["tokens"] for r in got] == [[1], [2]], got
""")
    env = {**__import__("os").environ, "GLM53_REFERENCE_DIR": str(tmp_path / "shared")}
    procs = []
    for me, other in (("a", "b"), ("b", "a")):
        work = tmp_path / f"work-{me}"
        work.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / me), str(tmp_path / other), str(work)],
            env=env,
        ))  # fmt: skip
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    assert log.read_text().splitlines() == ["[[7], [8, 9]]"]


def test_a_unit_computed_under_another_tune_file_is_computed_again(tmp_path, monkeypatch):
    """Shared units are keyed by EXLLAMAV3_TUNE_CACHE: under another tune file exllamav3 may pick
    other kernels (other rounding), so what was computed there is not this process's reference;
    under the same file it is loaded."""
    model, log = _shared_setup(tmp_path, monkeypatch)
    spec = {"model": str(model), "max_new_tokens": 3, "runs": [{"prompts": [[1]]}]}
    for tune in ("a.bin", "b.bin", "a.bin"):
        monkeypatch.setenv("EXLLAMAV3_TUNE_CACHE", str(tmp_path / tune))
        monkeypatch.setattr(gpu_kit, "_REFERENCE", {})  # another process
        gpu_kit.stock_reference(spec, tmp_path)
    assert log.read_text().splitlines() == ["[[1]]", "[[1]]"]  # a, b; a again loaded


def test_every_declared_run_is_fetched_at_once_before_any_test_asks(tmp_path, monkeypatch):
    """all_declared_references (conftest.py's references_before_engines) computes every declared
    spec's runs in one reference process per checkpoint, before any test asks; a test's
    stock_reference then computes nothing."""
    models = []
    for name in ("m1", "m2"):
        m = tmp_path / name
        m.mkdir()
        (m / "config.json").write_text("{}")
        models.append(str(m))
    log = tmp_path / "computed.log"
    monkeypatch.delenv("GLM53_REFERENCE_DIR", raising=False)
    monkeypatch.setattr(gpu_kit, "_DECLARED", [])
    monkeypatch.setattr(gpu_kit, "_REFERENCE", {})
    monkeypatch.setattr(gpu_kit.subprocess, "run", _mock_reference(log))
    specs = [
        {"model": models[0], "max_new_tokens": 3, "runs": [{"prompts": [[1], [2, 3]]}]},
        {"model": models[0], "max_new_tokens": 3, "runs": [{"prompts": [[4, 5, 6]]}]},
        {"model": models[1], "max_new_tokens": 3, "runs": [{"prompts": [[7]]}]},
    ]
    for s in specs:
        gpu_kit.declare_reference(s)
    assert gpu_kit.all_declared_references(tmp_path) == 3
    assert log.read_text().splitlines() == ["[[1], [2, 3], [4, 5, 6]]", "[[7]]"]
    (got,) = gpu_kit.stock_reference(specs[1], tmp_path)
    assert [r["tokens"] for r in got] == [[3]]
    assert len(log.read_text().splitlines()) == 2
