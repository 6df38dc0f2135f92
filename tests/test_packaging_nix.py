"""flake.nix and nix/: every file parses, and with stub inputs (no network, no nixpkgs) the flake
evaluates: its outputs, the CPU and CUDA packages (dependencies follow pyproject.toml), the
`nix run` app and the NixOS module's systemd service (in step with packaging/systemd)."""

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from glm53 import config

ROOT = Path(__file__).resolve().parents[1]
NIX_FILES = [ROOT / "flake.nix", *sorted((ROOT / "nix").glob("*.nix"))]
NIX_NAMES = {
    "huggingface_hub": "huggingface-hub"
}  # PyPI name -> nixpkgs attribute, where they differ

pytestmark = pytest.mark.skipif(
    shutil.which("nix-instantiate") is None,
    reason="nix-instantiate is not installed (Debian package `nix-bin`; .ci/run installs it)",
)

# A stand-in for nixpkgs: just the functions and packages glm53's Nix files use, shaped like
# the real ones (callPackage fails on a missing argument, mesonEnable writes -Dname=enabled).
STUBS = r"""
let
  lib = rec {
    fix = f: let x = f x; in x;
    genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
    optional = c: x: if c then [ x ] else [ ];
    optionals = c: xs: if c then xs else [ ];
    optionalAttrs = c: a: if c then a else { };
    optionalString = c: s: if c then s else "";
    concatStringsSep = builtins.concatStringsSep;
    replaceStrings = builtins.replaceStrings;
    getExe = p: "${p}/bin/${p.meta.mainProgram}";
    makeBinPath = ps: concatStringsSep ":" (map (p: "${p}/bin") ps);
    getOutput = o: p: p // { outPath = "${p}-${o}"; };
    getDev = getOutput "dev";
    getLib = getOutput "lib";
    getBin = getOutput "bin";
    mesonEnable = k: v: "-D${k}=${if v then "enabled" else "disabled"}";
    mesonOption = k: v: "-D${k}=${v}";
    licenses = { asl20 = "asl20"; mit = "mit"; };
    platforms.linux = [ "x86_64-linux" "aarch64-linux" ];
    literalExpression = text: { _type = "literalExpression"; inherit text; };
    mkOption = o: o // { _type = "option"; };
    mkEnableOption = what: mkOption { type = types.bool; default = false; description = what; };
    mkIf = condition: content: { _type = "if"; inherit condition content; };
    types = {
      bool = "bool"; str = "str"; port = "port"; path = "path"; package = "package";
      enum = vs: "enum"; nullOr = t: "nullOr"; attrsOf = t: "attrsOf"; listOf = t: "listOf";
      submodule = m: "submodule"; ints.unsigned = "ints.unsigned";
    };
  };
  stub = name: { pname = name; outPath = "/nix/store/stub-${name}"; meta.mainProgram = name; };
  stubs = names: builtins.listToAttrs (map (n: { name = n; value = stub n; }) names);

  callWith = scope: fn: overrides:
    let f = if builtins.isFunction fn then fn else import fn;
    in f (builtins.intersectAttrs (builtins.functionArgs f) scope // overrides);

  buildPythonPackage = {
    __functor = _: attrs: attrs // { outPath = "/nix/store/stub-${attrs.pname}"; };
    override = _: buildPythonPackage;
  };

  pythonScope = final: lib.fix (py:
    builtins.foldl' (prev: ext: prev // ext py prev)
      ({
        callPackage = callWith (final // py);
        inherit buildPythonPackage;
        fetchPypi = attrs: attrs;
      } // stubs [
        "numpy" "msgspec" "granian" "uvloop" "jinja2" "tokenizers" "torch" "httpx" "transformers"
        "safetensors" "rich" "huggingface-hub" "nvidia-ml-py" "meson-python" "cython" "pip"
        "pytest" "hypothesis" "openai" "typing-extensions" "ninja" "pillow" "pyyaml" "marisa-trie"
        "pydantic" "llguidance"
      ])
      final.pythonPackagesExtensions);

  nixpkgs = { system, overlays ? [ ], config ? { } }:
    lib.fix (final:
      builtins.foldl' (prev: overlay: prev // overlay final prev)
        ({
          inherit lib system config;
          stdenv.hostPlatform.system = system;
          pythonPackagesExtensions = [ ];
          python3Packages = pythonScope final;
          python3.withPackages = f: stub "python3-env" // { packages = f final.python3Packages; };
          writeShellScriptBin = name: text: builtins.trace "script ${name}: ${text}" (stub name);
          symlinkJoin = { name, paths }: stub name // { inherit paths; };
          mkShell = attrs: attrs;
          autoAddDriverRunpath = stub "auto-add-driver-runpath";
          cudaPackages = stubs [
            "cuda_nvcc" "cuda_cudart" "cuda_cccl" "libcublas" "libcurand"
          ] // { backendStdenv = { cc = stub "cc"; }; };
        } // stubs [ "meson" "ninja" "pkg-config" "ruff" ])
        overlays);
in
{ inherit lib nixpkgs; }
"""


@pytest.fixture(scope="module")
def nix_eval(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nix")
    (tmp / "stubs.nix").write_text(STUBS)
    (tmp / "nixpkgs").mkdir()
    (tmp / "nixpkgs" / "default.nix").write_text(f'(import (/. + "{tmp}/stubs.nix")).nixpkgs\n')

    def run(expr: str):
        program = f"""
          let
            stubs = import (/. + "{tmp}/stubs.nix");
            lib = stubs.lib;
            root = /. + "{ROOT}";
            nixpkgs = {{ inherit lib; outPath = /. + "{tmp}/nixpkgs"; }};
            outputs = (import (root + "/flake.nix")).outputs {{
              self = outputs // {{ outPath = root; }};
              inherit nixpkgs;
            }};
          in {expr}
        """
        done = subprocess.run(
            ["nix-instantiate", "--eval", "--strict", "--json", "-E", program],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp,
        )
        assert done.returncode == 0, done.stderr
        run.stderr = done.stderr
        return json.loads(done.stdout)

    return run


@pytest.mark.parametrize("path", NIX_FILES, ids=lambda p: p.name)
def test_nix_file_parses(path):
    done = subprocess.run(
        ["nix-instantiate", "--parse", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_flake_has_the_outputs_and_systems(nix_eval):
    assert nix_eval("builtins.attrNames outputs") == [
        "apps",
        "checks",
        "devShells",
        "nixosModules",
        "overlays",
        "packages",
    ]
    systems = ["aarch64-linux", "x86_64-linux"]
    for output in ("apps", "checks", "devShells", "packages"):
        assert nix_eval(f"builtins.attrNames outputs.{output}") == systems
    assert nix_eval("builtins.attrNames outputs.packages.x86_64-linux") == ["cuda", "default"]


def _package(nix_eval, flavour: str) -> dict:
    return nix_eval(f"""
      let p = outputs.packages.x86_64-linux.{flavour}; in {{
        inherit (p) pname version mesonFlags pythonImportsCheck makeWrapperArgs;
        build-system = map (d: d.pname) p.build-system;
        dependencies = map (d: d.pname) p.dependencies;
        mainProgram = p.meta.mainProgram;
        src = toString p.src;
      }}""")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _nix_name(requirement: str) -> str:
    name = Requirement(requirement).name
    return NIX_NAMES.get(name, name)


def _extension_modules() -> set[str]:
    names = set()
    for build_file in ("pyx/meson.build", "cuda/meson.build"):
        names |= set(re.findall(r"extension_module\(\s*'(\w+)'", (ROOT / build_file).read_text()))
    return {f"glm53.{n}" for n in names}


def test_cpu_package_builds_without_cuda_and_follows_pyproject(nix_eval):
    package = _package(nix_eval, "default")
    meson_version = re.search(r"version: '([^']+)'", (ROOT / "meson.build").read_text())[1]
    assert (package["pname"], package["version"]) == ("glm53", meson_version)
    assert package["src"] == str(ROOT)
    assert package["mesonFlags"] == ["-Dcuda=disabled", "-Dgpu_archs=86;89;90;120"]
    assert package["dependencies"] == [
        _nix_name(r) for r in _pyproject()["project"]["dependencies"]
    ]
    assert {"meson-python", "cython"} <= set(package["build-system"])
    assert set(package["pythonImportsCheck"]) >= _extension_modules() - {"glm53._cuda"}
    assert "glm53._cuda" not in package["pythonImportsCheck"]
    assert package["makeWrapperArgs"] == []
    assert package["mainProgram"] == "glm53"


def test_cuda_package_builds_the_cuda_library_and_takes_the_pinned_exllamav3(nix_eval):
    package = _package(nix_eval, "cuda")
    assert package["mesonFlags"] == ["-Dcuda=enabled", "-Dgpu_archs=86;89;90;120"]
    assert package["dependencies"][-1] == "exllamav3"
    assert "glm53._cuda" in package["pythonImportsCheck"]
    wrapper = package["makeWrapperArgs"]
    assert wrapper[wrapper.index("CUDA_HOME") + 1] == "/nix/store/stub-glm53-cuda-root"
    pin = next(
        Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["gpu"]
    ).specifier
    exllamav3 = nix_eval(
        "let p = outputs.packages.x86_64-linux.cuda.dependencies; in "
        "let e = builtins.elemAt p (builtins.length p - 1); in { inherit (e) version format; }"
    )
    assert f"=={exllamav3['version']}" == str(pin) and exllamav3["format"] == "wheel"


def test_nix_run_starts_glm53_serve(nix_eval):
    app = nix_eval("outputs.apps.x86_64-linux.default")
    assert app["type"] == "app"
    assert app["program"] == "/nix/store/stub-glm53-serve/bin/glm53-serve"
    script = 'trace: script glm53-serve: exec /nix/store/stub-glm53/bin/glm53 serve "$@"'
    assert script in nix_eval.stderr


def test_dev_shell_has_the_build_and_test_tools(nix_eval):
    shell = nix_eval("""
      let s = outputs.devShells.x86_64-linux.default; in {
        inputsFrom = map (p: p.pname) s.inputsFrom;
        python = map (p: p.pname) (builtins.head s.packages).packages;
      }""")
    assert shell["inputsFrom"] == ["glm53"]
    assert {"meson-python", "cython", "pytest", "hypothesis", "openai"} <= set(shell["python"])


MODULE = """
  let
    pkgs = {{ stdenv.hostPlatform.system = "x86_64-linux"; }};
    module = outputs.nixosModules.default;
    options = (module {{ config = {{ }}; inherit lib pkgs; }}).options.services.glm53;
    defaults = builtins.mapAttrs (n: o: o.default) options;
    cfg = defaults // {settings};
    out = (module {{ config.services.glm53 = cfg; inherit lib pkgs; }}).config;
    service = out.content.systemd.services.glm53;
  in {{
    enabled = out.condition;
    options = builtins.attrNames options;
    firewall = out.content.networking.firewall.allowedTCPPorts;
    inherit (service) environment wantedBy;
    serviceConfig = builtins.mapAttrs
      (n: v: if builtins.isList v then map toString v else toString v) service.serviceConfig;
  }}
"""


def _module(nix_eval, settings: str = "{ }") -> dict:
    return nix_eval(MODULE.format(settings=settings))


def test_module_options_and_defaults(nix_eval):
    module = _module(nix_eval, "{ enable = true; }")
    assert {"enable", "model", "mode", "host", "port", "memoryMax", "cpus"} <= set(
        module["options"]
    )
    assert module["enabled"] is True and module["firewall"] == []
    assert module["wantedBy"] == ["multi-user.target"]
    assert module["environment"]["GLM53_HOST"] == "127.0.0.1"
    assert module["environment"]["GLM53_PORT"] == "30000"
    assert "GLM53_MODEL" not in module["environment"]
    service = module["serviceConfig"]
    assert service["ExecStart"] == "/nix/store/stub-glm53/bin/glm53 serve"
    assert "MemoryMax" not in service and service["EnvironmentFile"] == []


def test_module_settings_reach_the_service_as_real_glm53_variables(nix_eval):
    module = _module(
        nix_eval,
        """{ enable = true; model = "/srv/m"; mode = "nvme"; host = "0.0.0.0"; port = 8000;
             openFirewall = true; store = "/mnt/nvme/s"; ramCap = "32G"; cpus = "2-23";
             cpuAffinity = "0-23"; memoryMax = "50G"; apiKeyFile = "/run/keys/glm53";
             environment = { GLM53_MAX_BATCH = "8"; }; }""",
    )
    env = module["environment"]
    glm53_vars = {k: v for k, v in env.items() if k.startswith("GLM53_")}
    settings, sources = config.resolve({}, glm53_vars)
    assert set(glm53_vars) <= {info.env for info in config.SETTINGS}
    assert (settings.model, settings.mode, settings.host, settings.port) == (
        "/srv/m",
        "nvme",
        "0.0.0.0",
        8000,
    )
    assert (settings.store, settings.ram_cap, settings.cpus, settings.max_batch) == (
        "/mnt/nvme/s",
        32 * 2**30,
        "2-23",
        8,
    )
    assert module["firewall"] == [8000]
    service = module["serviceConfig"]
    assert (service["MemoryMax"], service["CPUAffinity"]) == ("50G", "0-23")
    assert service["EnvironmentFile"] == ["/run/keys/glm53"]


INSTANCES = """
  let
    pkgs = {{ stdenv.hostPlatform.system = "x86_64-linux"; }};
    module = outputs.nixosModules.default;
    options = (module {{ config = {{ }}; inherit lib pkgs; }}).options.services.glm53;
    defaults = builtins.mapAttrs (n: o: o.default) options;
    out = (module {{ config.services.glm53 = defaults // {settings}; inherit lib pkgs; }}).config;
  in {{
    firewall = out.content.networking.firewall.allowedTCPPorts;
    services = builtins.mapAttrs (name: s: {{
      inherit (s) environment description;
      serviceConfig = builtins.mapAttrs (n: v: toString v) s.serviceConfig;
    }}) out.content.systemd.services;
  }}
"""


def test_module_runs_one_service_per_listed_gpu(nix_eval):
    module = nix_eval(
        INSTANCES.format(
            settings="""{ enable = true; openFirewall = true; model = "/srv/m"; instances = [
              { gpu = 0; port = 31000; cpus = "2-23"; cpuAffinity = "0-23"; numaNode = 0; }
              { gpu = 1; port = 31001; cpus = "26-47"; cpuAffinity = "24-47"; numaNode = 1; }
            ]; }"""
        )
    )
    assert sorted(module["services"]) == ["glm53-gpu0", "glm53-gpu1"]
    assert module["firewall"] == [31000, 31001]
    for gpu, (cpus, affinity) in enumerate([("2-23", "0-23"), ("26-47", "24-47")]):
        service = module["services"][f"glm53-gpu{gpu}"]
        env = service["environment"]
        assert env["CUDA_VISIBLE_DEVICES"] == str(gpu)
        glm53_vars = {k: v for k, v in env.items() if k.startswith("GLM53_")}
        settings, _ = config.resolve({}, glm53_vars)
        assert (settings.port, settings.cpus, settings.model) == (31000 + gpu, cpus, "/srv/m")
        unit = service["serviceConfig"]
        assert (unit["CPUAffinity"], unit["NUMAPolicy"], unit["NUMAMask"]) == (
            affinity,
            "bind",
            str(gpu),
        )
        assert service["description"].endswith(f"on GPU {gpu}")


def test_module_without_instances_runs_the_one_glm53_service(nix_eval):
    module = nix_eval(INSTANCES.format(settings="{ enable = true; }"))
    assert list(module["services"]) == ["glm53"]
    assert "CUDA_VISIBLE_DEVICES" not in module["services"]["glm53"]["environment"]
    assert "NUMAPolicy" not in module["services"]["glm53"]["serviceConfig"]


def _unit_directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    text = (ROOT / "packaging" / "systemd" / "glm53.service").read_text()
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_module_service_keeps_the_unit_files_readiness_limits_and_hardening(nix_eval):
    service = _module(nix_eval, "{ enable = true; }")["serviceConfig"]
    unit = _unit_directives()
    as_unit = {"1": "yes", "": "no"}  # Nix true/false after toString
    same = [
        "Type", "NotifyAccess", "TimeoutStartSec", "TimeoutStopSec", "KillMode", "Restart",
        "RestartSec", "OOMPolicy", "LimitMEMLOCK", "LimitNOFILE", "UMask", "PrivateDevices",
        "DevicePolicy", "DeviceAllow", "NoNewPrivileges", "CapabilityBoundingSet",
        "ProtectSystem", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectHostname",
        "ProtectClock", "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
        "RestrictSUIDSGID", "LockPersonality", "SystemCallArchitectures",
    ]  # fmt: skip
    for key in same:
        value = service[key]
        if isinstance(value, list):
            value = value if key == "DeviceAllow" else [" ".join(value)]
        else:
            value = [as_unit.get(value, value) if key != "CapabilityBoundingSet" else value]
        assert value == unit[key], key
    assert "MemoryDenyWriteExecute" not in service
