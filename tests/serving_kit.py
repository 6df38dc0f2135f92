"""Helpers for the server tests: a tokenizer-only checkpoint, scripts for the scripted engine,
and a real `glm53 serve` (granian) process on 127.0.0.1 and a free port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from glm53.chat.render import default_template
from glm53.models.tokenizer import write_tokenizer

VOCAB_SIZE = 2048


def write_tokenizer_checkpoint(directory: Path) -> Path:
    """A directory with the synthetic tokenizer, glm53's chat template and a config.json:
    everything the scripted engine reads (it has no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    template = default_template()
    (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    write_tokenizer(directory, VOCAB_SIZE, template, 65536)
    (directory / "config.json").write_text(
        json.dumps({"model_type": "glm5_next"}), encoding="utf-8"
    )
    return directory


def write_script(path: Path, script: dict) -> Path:
    path.write_text(json.dumps(script), encoding="utf-8")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`glm53 serve` in a subprocess; `url` is its base URL once `/health` answered 200."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        *,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, **(env or {})}
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # Its own process group, so that `kill_group` reaches granian's worker too.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glm53", "serve", "--port", str(self.port), *args],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_group(self) -> None:
        """SIGKILL granian's main process and its worker at once (a crash, or an OOM kill)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"glm53 serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"glm53 serve was not ready after {timeout_s} s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scripted_server(
    tmp: Path, script: dict, *extra: str, env: dict[str, str] | None = None
) -> Server:
    checkpoint = write_tokenizer_checkpoint(tmp / "checkpoint")
    script_path = write_script(tmp / "script.json", script)
    args = [
        "--engine",
        "scripted",
        "--script",
        str(script_path),
        "--model",
        str(checkpoint),
        *extra,
    ]
    server = Server(args, env=env, log_path=tmp / "server.log")
    server.wait_ready()
    return server
