"""What every benchmark records beside its figures. The benchmarks run as scripts
(`python bench/NAME.py`), so their folder is on sys.path and they import this as `benchlib`."""

from __future__ import annotations

import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def host_fields() -> dict:
    """Commit, host name, CPU count, 1-minute load average and Python version, for `config`."""
    return {
        "commit": git_commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }
