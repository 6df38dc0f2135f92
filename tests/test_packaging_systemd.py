"""packaging/systemd: the unit passes `systemd-analyze verify` (its examples too), keeps the
settings the server depends on, and its memory and CPU examples match the modes' figures."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from glm53 import config
from glm53.doctor.costmodel import all_ram_bytes, expert_trellis_bytes, nvme_process_bytes
from glm53.doctor.cpu import parse_cpu_list

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "packaging" / "systemd" / "glm53.service"
TEMPLATE = ROOT / "packaging" / "systemd" / "glm53@.service"
ENV_EXAMPLE = ROOT / "packaging" / "systemd" / "glm53.env.example"
GIB = 2**30
EXAMPLE = re.compile(r"^#([A-Z][A-Za-z]+=.*)$")

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian package `systemd`; .ci/run installs it)",
)


def directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every active line, in order (keys may repeat)."""
    out, section = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(text: str, key: str) -> list[str]:
    return [v for _, k, v in directives(text) if k == key]


def verify(tmp_path: Path, text: str, name: str = "glm53.service") -> str:
    # verify checks that ExecStart= exists: point it at this interpreter.
    text = text.replace(
        "ExecStart=/opt/glm53/bin/glm53 serve", f"ExecStart={sys.executable} -m glm53 serve"
    )
    unit = tmp_path / name
    unit.write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Unknown keys and bad values are only warnings (exit 0), so any line about our unit fails.
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "glm53" in line]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr
    return text


@needs_systemd_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path):
    verify(tmp_path, UNIT.read_text())


@needs_systemd_analyze
def test_unit_with_every_example_uncommented_passes_verify(tmp_path):
    lines = UNIT.read_text().splitlines()
    examples = [EXAMPLE.sub(r"\1", line) for line in lines]
    assert sum(a != b for a, b in zip(lines, examples, strict=True)) >= 7
    verify(tmp_path, "\n".join(examples) + "\n")


@needs_systemd_analyze
def test_verify_reports_a_misspelled_key(tmp_path):
    text = UNIT.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOK=infinity")
    with pytest.raises(AssertionError, match="Unknown key 'LimitMEMLOK'"):
        verify(tmp_path, text)


def test_unit_keeps_readiness_memlock_restart_and_gpu_access():
    text = UNIT.read_text()
    one = {
        key: vals[-1] for key in {k for _, k, _ in directives(text)} if (vals := values(text, key))
    }
    assert one["Type"] == "notify" and one["NotifyAccess"] == "all"
    assert one["ExecStart"].endswith("/glm53 serve")
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["Restart"] == "on-failure"
    assert one["TimeoutStartSec"] == "45min"
    assert (one["User"], one["Group"]) == ("glm53", "glm53")
    assert one["PrivateDevices"] == "no" and one["DevicePolicy"] == "closed"
    allowed = values(text, "DeviceAllow")
    for device in ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidiactl rw"):
        assert device in allowed
    assert "MemoryDenyWriteExecute" not in one
    assert values(text, "EnvironmentFile") == ["-/etc/glm53/glm53.env"]


def _example_blocks() -> list[tuple[str, dict[str, int]]]:
    """(comment above, {MemoryHigh/MemoryMax: GiB}) of each memory example block."""
    blocks: list[tuple[str, dict[str, int]]] = []
    comment = ""
    for line in UNIT.read_text().splitlines():
        if match := re.match(r"^#(MemoryHigh|MemoryMax)=(\d+)G$", line):
            if not blocks or blocks[-1][0] != comment:
                blocks.append((comment, {}))
            blocks[-1][1][match.group(1)] = int(match.group(2))
        elif line.startswith("# "):
            comment = line
    return blocks


def test_memory_examples_cover_what_each_mode_keeps_in_ram():
    nvme_32g = nvme_process_bytes(32 * GIB // expert_trellis_bytes(3))
    needs = {
        "# exact, fast": all_ram_bytes(),  # fast keeps no swizzled second copy (--ct-swz is off)
        "# nvme, nvme-exact with GLM53_RAM_CAP=32G": nvme_32g,
    }
    for (comment, limits), (prefix, need) in zip(_example_blocks(), needs.items(), strict=True):
        assert comment.startswith(prefix), comment
        assert f"{need / GIB:.1f} GiB" in comment, (comment, need / GIB)
        # MemoryHigh above the need (no throttling in steady state), MemoryMax above MemoryHigh,
        # and neither more than a fifth above the need.
        assert need < limits["MemoryHigh"] * GIB < limits["MemoryMax"] * GIB <= 1.2 * need


def test_cpu_affinity_example_holds_the_cpu_lane_and_spares_two_cores():
    affinity = set(parse_cpu_list(re.search(r"^#CPUAffinity=(\S+)$", UNIT.read_text(), re.M)[1]))
    lane = re.search(r"^#GLM53_CT_CPUS=(\S+)$", ENV_EXAMPLE.read_text(), re.M)[1]
    assert f"GLM53_CT_CPUS={lane}" in UNIT.read_text()
    lane_cpus = set(parse_cpu_list(lane))
    assert lane_cpus < affinity and len(affinity - lane_cpus) >= 2


def _env_lines(text: str, with_examples: bool) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if with_examples and line.startswith("#GLM53_"):
            line = line[1:]
        if line.startswith("GLM53_"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_env_example_uses_only_real_settings_and_resolves():
    names = {info.env for info in config.SETTINGS}
    text = ENV_EXAMPLE.read_text()
    every = _env_lines(text, with_examples=True)
    assert set(every) <= names, set(every) - names
    for environ in (_env_lines(text, with_examples=False), every):
        settings, sources = config.resolve({}, environ)
        assert all(sources[i.name] == "env" for i in config.SETTINGS if i.env in environ)
    assert settings.ram_cap == 32 * GIB and settings.host == "127.0.0.1"


# --- glm53@.service: one instance per GPU --------------------------------------------------------
# What the template may change of glm53.service: the per-GPU lines.
_PER_INSTANCE = {"Description", "ExecStartPre", "Environment", "EnvironmentFile"}


@needs_systemd_analyze
def test_template_instance_passes_systemd_analyze_verify(tmp_path):
    verify(tmp_path, TEMPLATE.read_text(), name="glm53@1.service")


@needs_systemd_analyze
def test_template_instance_with_every_example_uncommented_passes_verify(tmp_path):
    lines = TEMPLATE.read_text().splitlines()
    examples = [EXAMPLE.sub(r"\1", line) for line in lines]
    verify(tmp_path, "\n".join(examples) + "\n", name="glm53@1.service")


@needs_systemd_analyze
def test_template_verify_reports_a_misspelled_key(tmp_path):
    text = TEMPLATE.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOK=infinity")
    with pytest.raises(AssertionError, match="Unknown key 'LimitMEMLOK'"):
        verify(tmp_path, text, name="glm53@1.service")


def test_template_is_the_single_unit_but_for_the_gpu_port_and_env_files():
    single, template = directives(UNIT.read_text()), directives(TEMPLATE.read_text())
    assert [d for d in template if d[1] not in _PER_INSTANCE] == [
        d for d in single if d[1] not in _PER_INSTANCE
    ]
    assert "CUDA_VISIBLE_DEVICES=%i" in values(TEMPLATE.read_text(), "Environment")
    assert values(TEMPLATE.read_text(), "EnvironmentFile") == [
        "-/etc/glm53/glm53.env",
        "-/etc/glm53/glm53@%i.env",
    ]
    assert values(TEMPLATE.read_text(), "ExecStartPre") == ["-+/usr/bin/nvidia-modprobe -u -c=%i"]


def test_template_gives_each_gpu_its_own_valid_port():
    port = next(
        v.partition("=")[2]
        for v in values(TEMPLATE.read_text(), "Environment")
        if v.startswith("GLM53_PORT=")
    )
    ports = set()
    for gpu in range(10):
        settings, sources = config.resolve({}, {"GLM53_PORT": port.replace("%i", str(gpu))})
        assert sources["port"] == "env"
        ports.add(settings.port)
    assert ports == set(range(31000, 31010))


def test_template_affinity_example_holds_the_lane_on_one_numa_node():
    text = TEMPLATE.read_text()
    affinity = set(parse_cpu_list(re.search(r"^#CPUAffinity=(\S+)$", text, re.M)[1]))
    lane = set(parse_cpu_list(re.search(r"GLM53_CT_CPUS=(\S+) in /etc/glm53/glm53@1", text)[1]))
    assert lane < affinity and len(affinity - lane) >= 2
    assert re.search(r"^#NUMAMask=1$", text, re.M)
