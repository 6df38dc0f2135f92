"""`glm53 serve` start-up: exit statuses and reasons, and /health while the model loads."""

import asyncio
import importlib.util
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from serving_kit import Server, free_port, write_tokenizer_checkpoint

from glm53.api.app import App
from glm53.config import resolve
from glm53.engine import engine_kind
from glm53.engine.scripted import Script, ScriptedEngine


def serve(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "glm53", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_missing_checkpoint_exits_2_with_the_reason_and_warns_about_an_open_host():
    done = serve("--model", "/nonexistent/ckpt", "--host", "0.0.0.0", "--port", "1")
    assert done.returncode == 2
    log = done.stdout + done.stderr
    assert "--model /nonexistent/ckpt: no config.json there" in log
    assert "listening on 0.0.0.0 without --api-key" in log


def test_bad_setting_exits_2_naming_the_flag():
    done = serve("--port", "0")
    assert done.returncode == 2
    assert "glm53 serve: --port='0': Expected `int` >= 1" in done.stderr


def test_failed_model_load_exits_1_with_the_reason(tmp_path):
    checkpoint = write_tokenizer_checkpoint(tmp_path / "checkpoint")
    script = tmp_path / "script.json"
    script.write_text('{"default": 3}')
    server = Server(
        ["--engine", "scripted", "--script", str(script), "--model", str(checkpoint)],
        log_path=tmp_path / "log",
    )
    assert server.proc.wait(timeout=600) == 1
    assert "the model failed to load: ValueError: cannot use script" in server.log()
    assert "Expected `str`, got `int` - at `$.default`" in server.log()


class GatedEngine(ScriptedEngine):
    """A scripted engine whose load waits for a gate (or fails)."""

    def __init__(self, checkpoint, gate: threading.Event, error: Exception | None = None):
        super().__init__(checkpoint, Script(default="</think>ok"), context_length=1024, num_slots=2)
        self.gate, self.error = gate, error

    def load(self):
        self.gate.wait(30)
        if self.error is not None:
            raise self.error
        super().load()


async def health_while_loading(checkpoint, error=None):
    gate = threading.Event()
    settings, sources = resolve({}, {})
    app = App(settings, sources, engine_factory=lambda s: GatedEngine(checkpoint, gate, error))
    loading = asyncio.create_task(app.load())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://glm53"
    ) as client:
        before = await client.get("/health")
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "x"}]},
        )
        gate.set()
        await loading
        after = await client.get("/health")
        info = (await client.get("/server_info")).json()
    await app.close()
    return before, chat, after, info


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tokenizer_checkpoint(tmp_path_factory.mktemp("tokenizer"))


def test_health_is_503_until_the_model_is_ready(checkpoint):
    before, chat, after, info = asyncio.run(health_while_loading(checkpoint))
    assert before.status_code == 503 and before.json()["error"]["code"] == "model_loading"
    assert chat.status_code == 503
    assert after.status_code == 200 and after.json() == {"status": "ok"}
    assert info["status"] == "ready" and info["load_seconds"] >= 0


def test_health_reports_a_failed_load(checkpoint):
    _, _, after, info = asyncio.run(health_while_loading(checkpoint, RuntimeError("disk on fire")))
    assert after.status_code == 503
    assert (
        after.json()["error"]["message"] == "the model failed to load: RuntimeError: disk on fire"
    )
    assert (info["status"], info["load_error"]) == ("failed", "RuntimeError: disk on fire")


def _has_cuda_device():
    import torch

    return torch.cuda.device_count() > 0


no_gpu_host = pytest.mark.skipif(_has_cuda_device(), reason="this host has a CUDA device")


def refused_before_binding(*args):
    """Run `glm53 serve ARGS --port P` and check it stopped before granian started: exit 2, one
    line on stderr and nothing on stdout (granian logs "Listening at" once it binds), and P
    still free. Returns that line."""
    port = free_port()
    done = serve(*args, "--port", str(port))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.endswith("\n") and done.stderr.count("\n") == 1, done.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    return done.stderr.rstrip("\n")


@no_gpu_host
@pytest.mark.parametrize(
    "args",
    [
        ("--engine", "gpu"),
        ("--engine", "gpu", "--demo"),
        ("--engine", "gpu", "--mode", "fast"),
        ("--engine", "gpu", "--gpus", "0,1"),
    ],
)
def test_gpu_engine_without_a_gpu_is_refused_in_one_line_before_binding(args):
    import torch

    line = refused_before_binding(*args)
    why = (
        f"this torch ({torch.__version__}) is a CPU build"
        if torch.version.cuda is None
        else f"torch {torch.__version__} sees no CUDA device"
    )
    if importlib.util.find_spec("exllamav3") is None:
        why += " and exllamav3 is not installed"
    assert line == (
        f"glm53 serve: --engine gpu: {why}; run `glm53 serve --engine cpu` instead "
        "(`glm53 serve --demo` for the demo checkpoint), or see docs/install.md to set up a "
        "GPU host"
    )


@no_gpu_host
def test_auto_engine_picks_cpu_without_a_gpu_so_gpus_is_refused_before_binding(tmp_path):
    checkpoint = write_tokenizer_checkpoint(tmp_path / "checkpoint")
    settings, _ = resolve({"model": str(checkpoint)}, {})
    assert engine_kind(settings) == "cpu"
    line = refused_before_binding("--model", str(checkpoint), "--gpus", "0")
    assert line == (
        "glm53 serve: --gpus 0: the cpu engine runs on no GPU, so the split would do nothing; "
        "leave --gpus (GLM53_GPUS) out, or serve a real checkpoint with --engine gpu"
    )
