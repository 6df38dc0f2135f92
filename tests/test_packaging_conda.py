"""conda-recipe/: the v1 recipe renders offline with py-rattler-build into CPU and CUDA variants
whose dependencies follow pyproject.toml, and a schema error is caught."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

rattler_build = pytest.importorskip(
    "rattler_build", reason="py-rattler-build is not installed (it is in the `test` extra)"
)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "conda-recipe" / "recipe.yaml"
VARIANTS = ROOT / "conda-recipe" / "variants.yaml"
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name, where they differ


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    recipe = rattler_build.Stage0Recipe.from_file(RECIPE)
    variants = recipe.render(rattler_build.VariantConfig.from_file(VARIANTS))
    return [v.recipe.to_dict() for v in variants]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _is_cuda(recipe: dict) -> bool:
    return recipe["build"]["string"].startswith("cuda")


def test_renders_cpu_and_cuda_variants_for_each_python(rendered):
    strings = sorted(r["build"]["string"] for r in rendered)
    assert [re.sub(r"h[0-9a-f]{7}_", "h_", s) for s in strings] == [
        "cpu_py311h_0",
        "cpu_py312h_0",
        "cuda12_py311h_200",
        "cuda12_py312h_200",
        "cuda13_py311h_200",
        "cuda13_py312h_200",
    ]
    for recipe in rendered:
        assert recipe["build"]["number"] == (200 if _is_cuda(recipe) else 0)
        assert recipe["package"] == {"name": "glm53", "version": recipe["context"]["version"]}


def test_version_is_the_meson_project_version(rendered):
    meson_version = re.search(r"version: '([^']+)'", (ROOT / "meson.build").read_text())[1]
    assert {r["package"]["version"] for r in rendered} == {meson_version}


def test_cuda_variants_build_the_cuda_library_with_nvcc_and_cpu_variants_do_not(rendered):
    for recipe in rendered:
        script, build = recipe["build"]["script"], recipe["requirements"]["build"]
        host = recipe["requirements"]["host"]
        if _is_cuda(recipe):
            major = recipe["build"]["string"][len("cuda") : recipe["build"]["string"].index("_")]
            assert "-Csetup-args=-Dcuda=enabled" in script and "-Dgpu_archs=" in script
            assert any(dep.startswith(f"cuda-nvcc_linux-64 {major}.") for dep in build)
            assert any(dep.startswith(f"cuda-version {major}.") for dep in host)
        else:
            assert "-Csetup-args=-Dcuda=disabled" in script
            assert not any("cuda" in dep for dep in build + host)


def test_run_dependencies_follow_pyproject(rendered):
    project = _pyproject()["project"]
    for recipe in rendered:
        run = recipe["requirements"]["run"]
        for text in project["dependencies"]:
            req = Requirement(text)
            name = CONDA_NAMES.get(req.name, req.name)
            wanted = f"{name} {req.specifier}".strip()
            assert any(dep == wanted or dep.startswith(wanted + " ") for dep in run), (wanted, run)


def test_cuda_variants_take_cuda_pytorch_and_the_pinned_exllamav3(rendered):
    gpu_extra = [Requirement(t) for t in _pyproject()["project"]["optional-dependencies"]["gpu"]]
    exllamav3 = next(r for r in gpu_extra if r.name == "exllamav3")
    for recipe in rendered:
        run = recipe["requirements"]["run"]
        torch = [dep for dep in run if dep.startswith("pytorch ")]
        if _is_cuda(recipe):
            major = int(
                recipe["build"]["string"][len("cuda") : recipe["build"]["string"].index("_")]
            )
            assert torch[0].endswith(" cuda*") and len(torch) == 1
            assert f"exllamav3 {exllamav3.specifier}" in run
            assert f"cuda-version >={major}.0,<{major + 1}" in run
        else:
            assert torch[0].endswith(" cpu*") and len(torch) == 1
            assert not any(dep.startswith(("exllamav3", "cuda")) for dep in run)


def _built_extension_modules() -> set[str]:
    names = set()
    for build_file in ("pyx/meson.build", "cuda/meson.build"):
        text = (ROOT / build_file).read_text()
        names |= set(re.findall(r"extension_module\(\s*'(\w+)'", text))
    return names


def test_tests_import_every_native_module_and_run_the_cli(rendered):
    for recipe in rendered:
        tests = recipe["tests"]
        imports = set(next(t["python"]["imports"] for t in tests if "python" in t))
        scripts = [t["script"] for t in tests if "script" in t]
        lines = [line for s in scripts for line in ([s] if isinstance(s, str) else s)]
        expected = {f"glm53.{m}" for m in _built_extension_modules() if m != "_cuda"}
        assert expected <= imports
        assert ('python -c "import glm53._cuda"' in lines) == _is_cuda(recipe)
        assert "glm53 --version" in lines
        assert any(line.startswith("glm53 doctor --json") for line in lines)


def test_a_misspelled_key_is_a_parse_error(tmp_path):
    bad = tmp_path / "recipe.yaml"
    bad.write_text(RECIPE.read_text().replace("\nrequirements:\n", "\nrequirement:\n"))
    with pytest.raises(
        rattler_build.RecipeParseError, match="unknown top-level field 'requirement'"
    ):
        rattler_build.Stage0Recipe.from_file(bad)
