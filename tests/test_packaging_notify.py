"""systemd readiness (glm53.notify): the datagram protocol, and `glm53 serve` sending READY=1
once /health answers 200 and STOPPING=1 on SIGTERM, as systemd's Type=notify expects."""

import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from serving_kit import Server, write_script, write_tokenizer_checkpoint

import glm53
from glm53 import notify

CPU_ENGINE = Path(glm53.__file__).parent / "engine" / "cpu.py"


@pytest.fixture
def abstract_socket():
    name = f"glm53-notify-test-{os.getpid()}-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        yield sock, "@" + name


def test_without_notify_socket_nothing_is_sent():
    assert notify.ready("up", environ={}) is False
    assert notify.stopping(environ={"NOTIFY_SOCKET": ""}) is False


def test_ready_with_status_reaches_a_socket_path(tmp_path):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        assert notify.ready("serving x\non y", environ={"NOTIFY_SOCKET": str(path)}) is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving x on y"


def test_stopping_reaches_an_abstract_socket(abstract_socket):
    sock, value = abstract_socket
    assert notify.stopping(environ={"NOTIFY_SOCKET": value}) is True
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping"


def test_an_unusable_notify_socket_is_logged_not_raised(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="glm53.notify")
    missing = str(tmp_path / "gone")
    assert notify.status("x", environ={"NOTIFY_SOCKET": missing}) is False
    assert notify.status("x", environ={"NOTIFY_SOCKET": "vsock:2:1234"}) is False
    assert f"through NOTIFY_SOCKET={missing}: [Errno 2] No such file or directory" in caplog.text
    assert "NOTIFY_SOCKET='vsock:2:1234' is neither an absolute socket path" in caplog.text


def test_a_field_must_be_one_key_value_line():
    with pytest.raises(ValueError, match="notify field 'READY' must be one KEY=VALUE line"):
        notify.notify("READY", environ={"NOTIFY_SOCKET": "@x"})


def _serve_args(tmp_path: Path) -> list[str]:
    if CPU_ENGINE.exists():  # the demo checkpoint on the CPU engine, as a user would start it
        return ["--demo", "--engine", "cpu", "--cache-dir", str(tmp_path / "cache"), "-cs", "2048"]
    # Until the CPU engine lands: the scripted engine behind the same server and lifespan.
    checkpoint = write_tokenizer_checkpoint(tmp_path / "checkpoint")
    script = write_script(tmp_path / "script.json", {"default": "</think>ok"})
    return ["--engine", "scripted", "--script", str(script), "--model", str(checkpoint)]


def _receive_until(sock: socket.socket, wanted: str, server: Server, timeout_s: float) -> list:
    """Notification fields received until one equals `wanted` (bounded by timeout_s)."""
    fields: list[str] = []
    deadline = time.monotonic() + timeout_s
    sock.settimeout(1.0)
    while time.monotonic() < deadline:
        try:
            fields += sock.recv(4096).decode().split("\n")
        except TimeoutError:
            if server.proc.poll() is not None:
                break  # exited, and nothing more is queued on the socket
            continue
        if wanted in fields:
            return fields
    raise AssertionError(f"no {wanted} after {fields} (exit {server.proc.poll()}):\n{server.log()}")


def test_serve_sends_ready_after_load_and_stopping_on_sigterm(tmp_path, abstract_socket):
    sock, value = abstract_socket
    server = Server(_serve_args(tmp_path), env={"NOTIFY_SOCKET": value}, log_path=tmp_path / "log")
    try:
        before_ready = _receive_until(sock, "READY=1", server, timeout_s=900)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert before_ready[0] == "STATUS=loading the model"
        assert f"STATUS=serving glm-5.3-flash on 127.0.0.1:{server.port}" in before_ready
        server.proc.send_signal(signal.SIGTERM)  # what `systemctl stop` sends
        assert "STOPPING=1" in _receive_until(sock, "STOPPING=1", server, timeout_s=60)
        assert server.proc.wait(timeout=60) == 0, server.log()
    finally:
        server.stop()
