import subprocess
import sys

import glm53
from glm53.cli import main


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"glm53 {glm53.__version__}"


def test_console_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "glm53", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: glm53" in out.stdout
