"""docs/: reference.md is what tools/gen_reference.py makes from the code today, every message
troubleshooting.md quotes is still one the code prints, and the README's examples run against a
real server."""

import ast
import importlib.util
import json
import re
from pathlib import Path

import httpx
from serving_kit import scripted_server

from glm53 import config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "tools" / "gen_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_generated_from_the_settings_and_parsers():
    text = (DOCS / "reference.md").read_text(encoding="utf-8")
    assert text == _generator().render(), (
        "docs/reference.md is stale: run `python tools/gen_reference.py` and commit the result"
    )


def test_reference_lists_every_flag_and_variable_with_its_default():
    text = (DOCS / "reference.md").read_text(encoding="utf-8")
    for info in config.SETTINGS:
        row = next(line for line in text.splitlines() if f"| `{info.env}` |" in line)
        assert all(f"`{flag}`" in row for flag in info.flags), row
        default = "unset" if info.default is None else f"`{info.default}`"
        assert f"| {default} |" in row, row


def _printed_strings() -> list[str]:
    """Every string literal in glm53/, with each f-string placeholder as a NUL (so a quoted
    message cannot match across a value the code fills in)."""
    out = []
    for path in (ROOT / "glm53").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.append(
                    "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
                )
    return out


def test_every_quoted_message_is_still_printed_by_the_code():
    quoted = re.findall(r"^### `(.+)`$", (DOCS / "troubleshooting.md").read_text(), re.M)
    assert len(quoted) >= 30
    strings = _printed_strings()
    missing = [q for q in quoted if not any(q in s for s in strings)]
    assert not missing, f"troubleshooting.md quotes messages the code no longer prints: {missing}"


def test_install_guide_covers_every_way_to_install():
    text = (DOCS / "install.md").read_text(encoding="utf-8")
    for heading in ("## pip", "## conda", "## Nix", "## systemd"):
        assert heading in text
    for fact in ("580", "LimitMEMLOCK=infinity", "glm53 doctor", "hugepages"):
        assert fact in text


def _readme_examples() -> tuple[list[dict], list[str]]:
    """The JSON bodies of the README's curl examples and its Python examples, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    bodies = [json.loads(body) for body in re.findall(r"-d '(\{.*\})'", text)]
    python = re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)
    return bodies, python


def test_readme_examples_show_thinking_on_and_how_to_turn_it_off(tmp_path, capsys):
    bodies, python = _readme_examples()
    assert [b.get("chat_template_kwargs") for b in bodies] == [None, {"enable_thinking": False}]
    reply = "Hi! How can I help?"
    server = scripted_server(tmp_path, {"default": reply})
    try:
        thinking, plain = (
            httpx.post(server.url + "/v1/chat/completions", json=b, timeout=30).json()
            for b in bodies
        )
        example = python[0].replace("http://127.0.0.1:30000", server.url)
        exec(compile(example, "README.md", "exec"), {})
    finally:
        assert server.stop() == 0, server.log()
    message = thinking["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("", reply)
    message = plain["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (reply, None)
    assert capsys.readouterr().out == reply + "\n"


def test_readme_installs_torch_cpu_first_and_links_the_install_guide():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert (
        "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install ."
        in text
    )
    assert "[docs/install.md](docs/install.md)" in text
    install = (DOCS / "install.md").read_text(encoding="utf-8")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
