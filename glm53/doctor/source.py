"""Where the doctor's raw text comes from: the live host (files under /, commands run with a
timeout) or a captured directory of the same texts (`--capture` writes one, `--replay` and the
tests read one). Parsers never touch the host; they only see what a Source returns."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from glm53.errors import Glm53Error

T = TypeVar("T")

COMMAND_TIMEOUT_S = 20.0


class Unavailable(Glm53Error):
    """A probe could not answer: missing tool, missing file, timeout. The message says which."""


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Runs fn in a daemon thread and waits at most timeout_s. A probe that hangs (a dead NFS
    mount under statvfs, a wedged driver under NVML) becomes Unavailable instead of blocking the
    doctor; the stuck thread is abandoned, and being a daemon it cannot keep the process alive."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as e:  # handed to the caller below
            box.put((False, e))

    threading.Thread(target=run, name=f"doctor-{what}", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise Unavailable(f"{what} timed out after {timeout_s:g} s") from None
    if ok:
        return value
    raise value


class Source(Protocol):
    def read(self, path: str) -> str:
        """Text of an absolute host path such as /proc/meminfo; Unavailable if missing."""

    def listdir(self, path: str) -> list[str]:
        """Entries of a host directory (sorted); Unavailable if missing."""

    def run(self, name: str, argv: list[str]) -> str:
        """stdout of a command, recorded under `name`; Unavailable if absent or failing."""

    def statvfs(self, path: str) -> tuple[int, int]:
        """(total_bytes, free_bytes for an unprivileged user) of the filesystem at path."""

    def memlock(self) -> str:
        """`ulimit -l` of this process: a number of KiB or "unlimited"."""


class LiveSource:
    """The host this process runs on. Every call may record its answer for `capture_to`."""

    def __init__(self, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.recorded: dict[str, str] = {}

    def read(self, path: str) -> str:
        try:
            text = bounded(lambda: Path(path).read_text(errors="replace"), self.timeout_s, path)
        except OSError as e:
            raise Unavailable(f"{path}: {e.strerror or e}") from None
        self.recorded["root" + path] = text
        return text

    def listdir(self, path: str) -> list[str]:
        try:
            entries = sorted(os.listdir(path))
        except OSError as e:
            raise Unavailable(f"{path}: {e.strerror or e}") from None
        return entries

    def run(self, name: str, argv: list[str]) -> str:
        try:
            text = self._run(name, argv)
        except Unavailable as e:
            self.recorded[f"cmd/{name}.error"] = str(e) + "\n"
            raise
        self.recorded[f"cmd/{name}.txt"] = text
        return text

    def _run(self, name: str, argv: list[str]) -> str:
        if shutil.which(argv[0]) is None:
            raise Unavailable(f"{argv[0]} not found")
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "LC_ALL": "C", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            )
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{name} timed out after {self.timeout_s:g} s") from None
        except OSError as e:
            raise Unavailable(f"{name}: {e.strerror or e}") from None
        if done.returncode != 0:
            err = (done.stderr or done.stdout).strip().splitlines()
            raise Unavailable(f"{name} exited {done.returncode}: {err[-1] if err else 'no output'}")
        return done.stdout

    def statvfs(self, path: str) -> tuple[int, int]:
        st = bounded(lambda: os.statvfs(path), self.timeout_s, f"statvfs {path}")
        answer = (st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)
        stat = json.loads(self.recorded.get("cmd/statvfs.json", "{}"))
        stat[path] = list(answer)
        self.recorded["cmd/statvfs.json"] = json.dumps(stat, indent=1, sort_keys=True)
        return answer

    def memlock(self) -> str:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        text = "unlimited" if soft == resource.RLIM_INFINITY else str(soft // 1024)
        self.recorded["cmd/ulimit-l.txt"] = text + "\n"
        return text

    def capture_to(self, folder: Path) -> list[Path]:
        """Writes everything read so far under folder, in the layout FixtureSource reads."""
        written = []
        for rel, text in sorted(self.recorded.items()):
            dest = folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            written.append(dest)
        return written


class FixtureSource:
    """A captured host: `root/<host path>` for files, `cmd/<name>.txt` for a command's output
    (or `cmd/<name>.error` for why it gave none), `cmd/statvfs.json` ({mount: [total, free]})
    and `cmd/ulimit-l.txt`."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"host capture {self.folder} is not a directory")

    def _file(self, rel: str) -> Path:
        return self.folder / rel

    def read(self, path: str) -> str:
        f = self._file("root" + path)
        if not f.is_file():
            raise Unavailable(f"{path}: No such file or directory")
        return f.read_text()

    def listdir(self, path: str) -> list[str]:
        d = self._file("root" + path)
        if not d.is_dir():
            raise Unavailable(f"{path}: No such file or directory")
        return sorted(p.name for p in d.iterdir())

    def run(self, name: str, argv: list[str]) -> str:
        f, failed = self._file(f"cmd/{name}.txt"), self._file(f"cmd/{name}.error")
        if f.is_file():
            return f.read_text()
        if failed.is_file():
            raise Unavailable(failed.read_text().strip())
        raise Unavailable(f"{name}: not captured")

    def statvfs(self, path: str) -> tuple[int, int]:
        f = self._file("cmd/statvfs.json")
        table = json.loads(f.read_text()) if f.is_file() else {}
        if path not in table:
            raise Unavailable(f"statvfs {path}: not captured")
        total, free = table[path]
        return int(total), int(free)

    def memlock(self) -> str:
        f = self._file("cmd/ulimit-l.txt")
        if not f.is_file():
            raise Unavailable("ulimit -l: not captured")
        return f.read_text().strip()
