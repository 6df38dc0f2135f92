"""tests/gpu/groups.txt, which tools/gpu-check.sh reads for GLM53_GPU_GROUP: every GPU test file
is in exactly one group, each group synthesizes the checkpoints its files name, and the script
reads the manifest the way this test does."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "tests" / "gpu"
PRESETS = {"demo", "slice", "slice-resharded", "deep", "store"}
ENV_PRESET = {"DEMO": "demo", "SLICE": "slice", "SLICE_RESHARDED": "slice-resharded"}


def _entries():
    for line in (GPU / "groups.txt").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            yield line, words


def groups() -> dict[str, dict[str, list[str]]]:
    out: dict[str, dict[str, list[str]]] = {}
    for line, words in _entries():
        if words[0] == "call":
            continue
        group, kind, *values = words
        assert kind in ("synth", "test"), line
        out.setdefault(group, {"synth": [], "test": []})[kind] += values
    return out


def calls() -> dict[str, list[str]]:
    """call N GROUP...: the groups one device call runs side by side."""
    return {w[1]: w[2:] for _, w in _entries() if w[0] == "call"}


def test_every_gpu_test_file_is_in_exactly_one_group():
    listed = [f for g in groups().values() for f in g["test"]]
    files = sorted(p.name for p in GPU.glob("test_*.py"))
    assert sorted(listed) == files, "each tests/gpu/test_*.py once in tests/gpu/groups.txt"
    assert len(set(listed)) == len(listed)


def test_seven_groups_each_with_presets_gpu_check_knows():
    g = groups()
    assert sorted(g) == ["a", "b", "c", "d", "e", "f", "g"]
    for name, entry in g.items():
        assert entry["synth"] and set(entry["synth"]) <= PRESETS, name
        assert entry["test"], name


def test_each_group_synthesizes_the_checkpoints_its_files_name():
    for name, entry in groups().items():
        for f in entry["test"]:
            named = re.findall(r"GLM53_TEST_(SLICE_RESHARDED|SLICE|DEMO)\b", (GPU / f).read_text())
            missing = {ENV_PRESET[n] for n in named} - set(entry["synth"])
            assert not missing, f"group {name}: {f} names {missing}, not synthesized"
            if "slice_store" in (GPU / f).read_text():  # conftest.py's fixture: the call's store
                assert "store" in entry["synth"], f"group {name}: {f} reads the store"


def test_two_calls_run_every_group_once_and_a_store_writer_shares_its_store_with_no_one():
    """groups.txt's calls partition the groups; a group whose files write store bytes (the
    verify test's flip_byte) is the only group of its call on the call's one store: another
    group's engines would read the flipped bytes."""
    c, g = calls(), groups()
    listed = [x for members in c.values() for x in members]
    assert len(c) == 2 and sorted(listed) == sorted(g), c
    for members in c.values():
        on_store = [x for x in members if "store" in g[x]["synth"]]
        writers = [
            x for x in on_store if any("flip_byte(" in (GPU / f).read_text() for f in g[x]["test"])
        ]
        assert not writers or on_store == writers[:1], (members, on_store, writers)


def test_gpu_check_reads_the_same_groups():
    """The script's own parsing (its group_entries function, run by bash) agrees with this
    test's."""
    script = (REPO / "tools" / "gpu-check.sh").read_text()
    func = re.search(r"^group_entries\(\) \{.*?^\}", script, re.S | re.M).group(0)
    for name, entry in groups().items():
        for kind in ("synth", "test"):
            got = subprocess.run(
                ["bash", "-c", f'{func}\ngroup_entries "$1"', "bash", kind],
                env={"REPO": str(REPO), "GROUP": name, "PATH": "/usr/bin:/bin"},
                capture_output=True, text=True, check=True,
            ).stdout.split()  # fmt: skip
            assert got == entry[kind], (name, kind)


def _strict_run(tmp_path, strict: bool) -> subprocess.CompletedProcess:
    """pytest on a copy of tests/gpu/conftest.py beside a file that needs a missing module."""
    import os
    import shutil
    import sys

    shutil.copy(GPU / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_needs_module.py").write_text(
        "import pytest\n\npytest.importorskip('glm53_no_such_module')\n\n\n"
        "def test_never_runs():\n    pass\n"
    )
    (tmp_path / "test_plain.py").write_text("def test_runs():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "GLM53_GPU_STRICT"}
    if strict:
        env["GLM53_GPU_STRICT"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_on_the_gpu_machine_a_file_skipped_for_a_missing_module_fails(tmp_path):
    """GLM53_GPU_STRICT=1 (tools/gpu-check.sh sets it): a tests/gpu file whose importorskip
    fails is an error that names it, and the other files are still collected and reported;
    unset (CI without a GPU), it is a skip."""
    run = _strict_run(tmp_path, strict=True)
    assert run.returncode != 0, run.stdout
    assert "GLM53_GPU_STRICT: test_needs_module.py was skipped" in run.stdout, run.stdout
    # the other file was collected and reported (passed on a GPU, skipped without one)
    assert re.search(r"1 (passed|skipped), 1 error", run.stdout), run.stdout
    assert "export GLM53_GPU_STRICT=1" in (REPO / "tools" / "gpu-check.sh").read_text()
    lax = _strict_run(tmp_path, strict=False)
    assert lax.returncode == 0 and "error" not in lax.stdout, lax.stdout


def test_gpu_check_runs_several_groups_side_by_side(tmp_path):
    """GLM53_GPU_GROUP=c,a: one pytest process a group, each with its own junit and log, the
    deadline for each; an unknown group stops the call before anything runs. Here, without a
    GPU, each process ends in seconds (its files skipped, or errors under GLM53_GPU_STRICT)."""
    import os

    dev, out = tmp_path / "dev", tmp_path / "out"
    dev.mkdir()
    (dev / "setup.sh").write_text("true\n")
    env = {**os.environ, "GLM53_GPU_WORK": str(tmp_path / "work"), "GLM53_TESTS_DEADLINE": "120"}
    subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out), "tests"],
        env={**env, "GLM53_GPU_GROUP": "c,a"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = (out / "gpu-check.log").read_text()
    for g in ("a", "c"):
        assert (out / f"gpu-tests-{g}.xml").is_file(), log
        files = " ".join(f"tests/gpu/{f}" for f in groups()[g]["test"])
        assert re.search(rf"start tests-{g}: timeout -s INT .*--junitxml=\S*gpu-tests-{g}.xml", log)
        assert all(f in log for f in files.split()), (g, log)
    assert not (out / "gpu-tests.xml").exists()
    # GLM53_GPU_TESTS_<g> narrows one group (paths or node ids); the others run whole
    narrowed = "tests/gpu/test_serve_gpu.py::test_nothing_here tests/gpu/test_exl3_gpu.py"
    out3 = tmp_path / "o3"
    subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out3), "tests"],
        env={**env, "GLM53_GPU_GROUP": "c,a", "GLM53_GPU_TESTS_c": narrowed},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = (out3 / "gpu-check.log").read_text()
    line_c = next(x for x in log.splitlines() if "start tests-c:" in x)
    assert line_c.endswith(
        f"{REPO}/tests/gpu/test_serve_gpu.py::test_nothing_here {REPO}/tests/gpu/test_exl3_gpu.py"
    ), line_c
    line_a = next(x for x in log.splitlines() if "start tests-a:" in x)
    assert all(f"tests/gpu/{f}" in line_a for f in groups()["a"]["test"]), line_a
    bad = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(tmp_path / "o2"), "tests"],
        env={**env, "GLM53_GPU_GROUP": "a,z"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "no group z in tests/gpu/groups.txt" in bad.stderr


def test_a_carried_demo_is_unpacked_while_its_synth_sources_match(tmp_path):
    """tools/carry-checkpoint.sh writes the demo here and packs it with tools/synth-stamp.sh's
    hash; gpu-check.sh's synth stage unpacks it instead of synthesizing (the same bytes as a
    fresh `glm53 synth`), and a tarball from other synth sources is refused by name and the
    demo synthesized."""
    import filecmp
    import os
    import tarfile

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "setup.sh").write_text("true\n")
    subprocess.run(["bash", str(REPO / "tools" / "carry-checkpoint.sh"), str(dev)], check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    tarball = dev / "ckpt-demo.tar.gz"
    stamp = subprocess.run(["bash", str(REPO / "tools" / "synth-stamp.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    with tarfile.open(tarball) as t:
        assert t.extractfile("demo/.glm53-synth-stamp").read().decode().strip() == stamp

    def synth_stage(work):
        out = tmp_path / f"out-{work}"
        subprocess.run(
            ["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out), "synth"],
            env={**os.environ, "GLM53_GPU_WORK": str(tmp_path / work), "GLM53_SYNTH": "demo"},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        return (out / "gpu-check.log").read_text()

    log = synth_stage("carried")
    assert f"demo: carried ({tarball}, synth sources {stamp})" in log, log
    assert "start synth-demo" not in log and (tmp_path / "carried" / ".ready-demo").exists(), log
    # what it unpacked is what `glm53 synth` writes
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "glm53", "synth", "--preset", "demo", "--out",
                    str(fresh)], check=True, capture_output=True, timeout=600)  # fmt: skip
    cmp = filecmp.dircmp(fresh, tmp_path / "carried" / "demo")
    assert not cmp.diff_files and not cmp.left_only, (cmp.diff_files, cmp.left_only)
    # a tarball from other sources: refused by name, and the demo synthesized instead
    stale = tmp_path / "stale-tarball"
    with tarfile.open(tarball) as t:
        t.extractall(stale, filter="data")
    (stale / "demo" / ".glm53-synth-stamp").write_text("0123456789abcdef\n")
    listed = (stale / "demo" / ".glm53-synth-files").read_text().splitlines()
    first = listed[0].split()[1]  # the carried list says another hash for its first file
    listed[0] = "0" * 40 + "  " + first
    (stale / "demo" / ".glm53-synth-files").write_text("\n".join(listed) + "\n")
    with tarfile.open(tarball, "w:gz") as t:
        t.add(stale / "demo", arcname="demo")
    log = synth_stage("stale")
    assert f"{tarball} was written by other synth sources (0123456789abcdef, these are " in log
    assert "synth sources that differ: 2 lines (synth-stamp-diff.txt)" in log, log
    diff = (tmp_path / "out-stale" / "synth-stamp-diff.txt").read_text()
    assert f"< {'0' * 40}  {first}" in diff and diff.count(first) == 2, diff
    assert "start synth-demo" in log and "end synth-demo rc=0" in log, log


def test_the_store_is_packed_once_and_kept_by_later_calls_while_it_is_the_slices(tmp_path):
    """A group naming `store` (GLM53_SYNTH here): gpu-check.sh packs the slice's store once,
    after the slice, with `glm53 store pack` (real O_DIRECT writes), and the tests see it as
    GLM53_TEST_SLICE_STORE, complete (its manifest written). A later call on the same machine
    compares the store with the slice (`glm53 store compare`) and keeps it, or packs it again
    when a byte differs. The slice is played by a demo checkpoint in the slice's place (the real
    one is 16 GB)."""
    import os

    dev, work, out = tmp_path / "dev", tmp_path / "work", tmp_path / "out"
    dev.mkdir()
    (dev / "setup.sh").write_text("true\n")
    subprocess.run([sys.executable, "-m", "glm53", "synth", "--preset", "demo", "--out",
                    str(work / "slice")], check=True, capture_output=True, timeout=600)  # fmt: skip
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os\nfrom pathlib import Path\n\n\ndef test_store():\n"
        "    store = Path(os.environ['GLM53_TEST_SLICE_STORE'])\n"
        f"    assert store == Path({str(work / 'store')!r})\n"
        "    assert (store / 'manifest.json').is_file()\n"
    )
    env = {**os.environ, "GLM53_GPU_WORK": str(work), "GLM53_SYNTH": "slice store",
           "GLM53_GPU_TESTS": str(probe)}  # fmt: skip
    subprocess.run(["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out), "synth tests"],
                   env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    log = (out / "gpu-check.log").read_text()
    assert "start synth-slice" not in log, log  # already there: kept
    assert re.search(rf"start pack-store: python3 -m glm53 store pack --model {work}/slice", log)
    assert "end pack-store rc=0" in log and "end tests rc=0" in log, log
    assert log.count("start pack-store") == 1, log
    # a later call on the same machine: the store is compared with the slice and kept ...
    out2, out3 = tmp_path / "out2", tmp_path / "out3"
    subprocess.run(["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out2), "synth tests"],
                   env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    log = (out2 / "gpu-check.log").read_text()
    assert "end compare-store rc=0" in log and "start pack-store" not in log, log
    assert "end tests rc=0" in log, log
    # ... unless a byte of it differs (a verify test cut between its flip and its flip back)
    from store_kit import flip_byte

    flip_byte(work / "store" / "experts.bin", 4097)  # the first record (compare reads it)
    subprocess.run(["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out3), "synth tests"],
                   env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    log = (out3 / "gpu-check.log").read_text()
    assert "end compare-store rc=1" in log and "packing again" in log, log
    assert "end pack-store rc=0" in log and "end tests rc=0" in log, log


MOCK_PYTHON3 = r"""#!/bin/bash
# MOCK of python3 for tools/gpu-check.sh's orchestration: synth, reshard, store pack and the
# warm-up only make their output (after a pause, so the chains overlap); pytest records the
# files it was given. Each call is logged with its start and end order.
log="$MOCK_LOG"
echo "start $*" >>"$log"
case "$*" in
  *"glm53 synth"*) out=${*##*--out }; out=${out%% *}; sleep 0.3; mkdir -p "$out" ;;
  *reshard_checkpoint.py*) sleep 0.2; mkdir -p "${@: -1}" ;;
  *"glm53 store pack"*) out=${*##*--out }; out=${out%% *}; sleep 0.3; mkdir -p "$out" ;;
  *exl3_warm.py*) sleep 0.2; echo "warm $2: load 0.1 s, warm-up 0.1 s" ;;
  *"-m pytest"*) sleep 0.1 ;;
esac
echo "end $*" >>"$log"
"""


def test_side_by_side_groups_start_when_their_own_checkpoints_are_ready(tmp_path):
    """gpu-check.sh's synth stage with the groups of call 1 (a, c, d, g): MOCK python3 (above)
    stands in for synth, reshard, pack, warm-up and pytest. The slices are written one after
    another and the demo beside them; each group's pytest starts only after every checkpoint it
    names is written and warmed (the store packed once, after the slice), and the call waits for
    both chains."""
    import os

    dev, out, work, bin_ = (tmp_path / d for d in ("dev", "out", "work", "bin"))
    for d in (dev, bin_):
        d.mkdir()
    (dev / "setup.sh").write_text("true\n")
    (bin_ / "python3").write_text(MOCK_PYTHON3)
    (bin_ / "python3").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "MOCK_LOG": str(log),
           "GLM53_GPU_WORK": str(work), "GLM53_GPU_GROUP": "a,c,d,g",
           "GLM53_TESTS_DEADLINE": "300"}  # fmt: skip
    run = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu-check.sh"), str(dev), str(out), "synth warm tests"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check = (out / "gpu-check.log").read_text()
    assert run.returncode == 0, check
    calls = log.read_text().splitlines()

    def at(prefix: str, what: str) -> int:
        return next(i for i, c in enumerate(calls) if c.startswith(prefix) and what in c)

    def ready(preset: str) -> int:  # the end of its warm-up, or of its writing when not warmed
        if preset in ("slice-resharded", "store"):
            what = {"slice-resharded": "reshard_checkpoint.py", "store": "store pack"}[preset]
            return at("end", what)
        return at("end", f"exl3_warm.py {work}/{preset}")

    for g in ("a", "c", "d", "g"):
        start = at("start", f"gpu-tests-{g}.xml")
        for preset in groups()[g]["synth"]:
            assert ready(preset) < start, (g, preset, calls)
    # the slices one after another, the store after the slice; the demo beside them
    assert at("end", "--preset slice --routing glm53") < at(
        "start", "--preset slice --routing uniform"
    )
    assert at("end", "reshard_checkpoint.py") < at("start", "store pack")
    assert at("start", "--preset demo") < at("end", "--preset slice --routing glm53")
    assert sum("store pack" in c for c in calls) == 2  # one start, one end: packed once
    assert "--experts 64" in calls[at("start", "--routing uniform")]
    assert check.rstrip().endswith("done, status 0"), check
