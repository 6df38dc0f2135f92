"""docs/agent-setup.md: the skill's front matter, and every `glm53 ...` and `bench/sweep.py`
command it names exists with the flags it uses (checked against the argparse parsers)."""

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from glm53.cli import build_parser

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "agent-setup.md").read_text()
SHELL_STOPS = {"&&", "||", "|", ";", ">", ">>", "2>&1"}


def _snippets(text: str) -> list[str]:
    """Lines of fenced code blocks (continued lines joined), and inline code spans outside them."""
    blocks = [
        b.replace("\\\n", " ") for b in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    ]
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.S | re.M)
    return [line for b in blocks for line in b.splitlines()] + re.findall(r"`([^`\n]+)`", prose)


def commands(program: str) -> list[list[str]]:
    """Each use of `program` as argv (up to the first shell operator)."""
    out = []
    for snippet in _snippets(DOC):
        words = shlex.split(snippet, comments=True)
        for i, w in enumerate(words):
            if w == program and (i == 0 or words[i - 1] not in {"pip", "install"}):
                argv = []
                for word in words[i + 1 :]:
                    if word in SHELL_STOPS:
                        break
                    argv.append(word)
                out.append(argv)
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_front_matter_has_a_name_and_a_description():
    m = re.match(r"---\nname: (\S+)\ndescription: (.+)\n---\n", DOC)
    assert m and m[1] == "glm53-setup" and len(m[2]) > 40


def test_the_doc_names_each_command_of_the_setup():
    subs = {tuple(a[:2]) if a[:1] == ["store"] else tuple(a[:1]) for a in commands("glm53")}
    assert {("doctor",), ("download",), ("store", "pack"), ("store", "verify"), ("serve",)} <= subs
    assert commands("bench/sweep.py")


GLM53 = commands("glm53")


@pytest.mark.parametrize("argv", GLM53, ids=[" ".join(a) for a in GLM53])
def test_each_glm53_command_exists_with_its_flags(argv):
    parser = build_parser()
    words = list(argv)
    while words and (subs := _subparsers(parser)) and not words[0].startswith("-"):
        assert words[0] in subs, f"glm53: no subcommand {words[0]!r} in {' '.join(argv)}"
        parser = subs[words.pop(0)]
    assert not _subparsers(parser), f"{' '.join(argv)}: names no subcommand"
    known = {s for a in parser._actions for s in a.option_strings}
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in known, f"{parser.prog}: no flag {flag} (used in {' '.join(argv)})"


def test_each_sweep_command_uses_flags_sweep_has():
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sweep.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    known = set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))
    for argv in commands("bench/sweep.py"):
        for flag in (w.split("=")[0] for w in argv if w.startswith("--")):
            assert flag in known, f"bench/sweep.py: no flag {flag}"
