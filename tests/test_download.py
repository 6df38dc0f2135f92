"""`glm53 download`: fail fast without network, free-space check first, post-check of what
arrived, and the next command."""

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from glm53 import download
from glm53.cli import main


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def test_without_network_it_fails_fast_with_a_clear_message(tmp_path):
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_OFFLINE": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "glm53", "download", "--dir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,  # a hang is the failure this test exists for
    )
    assert done.returncode == 2
    assert "glm53 download: cannot reach the Hugging Face Hub at http://127.0.0.1:" in done.stderr
    assert "Connect" in done.stderr and "copy DIR here" in done.stderr
    assert not (tmp_path / "w").exists()  # nothing was started


def fake_hub(monkeypatch, files: dict[str, bytes], config: dict | None):
    """A Hub that lists `files` and, when asked to download, writes them (config.json from
    `config`)."""
    calls = []

    def model_info(self, repo, revision, files_metadata, timeout):
        assert (repo, files_metadata) == (download.REPO, True)
        sizes = {**{n: len(b) for n, b in files.items()}}
        return SimpleNamespace(
            siblings=[SimpleNamespace(rfilename=n, size=s) for n, s in sizes.items()]
        )

    def snapshot_download(repo, revision, local_dir, max_workers):
        calls.append((repo, revision, str(local_dir)))
        for name, data in files.items():
            (local_dir / name).write_bytes(data)
        if config is not None:
            (local_dir / "config.json").write_text(json.dumps(config))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


GLM = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]}


def test_downloads_the_pinned_revision_checks_it_and_prints_the_next_command(
    monkeypatch, tmp_path, capsys
):
    files = {"quantization_config.json": b"{}", "model-00001-of-00002.safetensors": b"x" * 100}
    calls = fake_hub(monkeypatch, files, GLM)
    target = tmp_path / "ckpt"
    assert main(["download", "--dir", str(target)]) == 0
    assert calls == [(download.REPO, download.REVISION, str(target))]
    out = capsys.readouterr().out
    assert f"downloading {download.REPO} (3.05bpw @ 332ab457b709)" in out
    assert f"ok: {target} holds Glm5NextForConditionalGeneration" in out
    next_lines = out.split("next:\n")[1].splitlines()
    assert next_lines[0].startswith(("  glm53 serve --model ", "  glm53 store pack --model "))
    assert str(target) in next_lines[0]


def test_refuses_when_the_disk_is_too_small_before_downloading(monkeypatch, tmp_path):
    calls = fake_hub(monkeypatch, {"big.safetensors": b"x" * 10}, GLM)
    monkeypatch.setattr(download, "free_bytes", lambda path: 2 << 30)
    monkeypatch.setattr(download, "missing_bytes", lambda target, files: 125_300_000_000)
    with pytest.raises(
        download.DownloadError, match=r"2.1 GB free, the download needs 125.3 GB more"
    ):
        download.download(tmp_path / "w", download.REVISION)
    assert calls == []


def test_finished_files_are_not_counted_again(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "b.bin").write_bytes(b"x" * 3)  # partial
    assert download.missing_bytes(tmp_path, {"a.bin": 10, "b.bin": 7, "c.bin": 5}) == 12


def test_post_check_rejects_a_foreign_or_incomplete_checkpoint(monkeypatch, tmp_path, capsys):
    fake_hub(monkeypatch, {"quantization_config.json": b"{}"}, {"model_type": "llama"})
    assert main(["download", "--dir", str(tmp_path / "a")]) == 1
    assert "model_type 'llama', expected 'glm5_next'" in capsys.readouterr().err
    fake_hub(monkeypatch, {"x.safetensors": b"1"}, GLM)
    assert main(["download", "--dir", str(tmp_path / "b")]) == 1
    assert "has no quantization_config.json" in capsys.readouterr().err
    with pytest.raises(
        download.DownloadError, match="has no config.json: the download is incomplete"
    ):
        download.check_checkpoint(tmp_path / "empty")


def test_unknown_revision_is_named(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import errors

    def model_info(self, repo, revision, files_metadata, timeout):
        missing = errors.RevisionNotFoundError.__new__(errors.RevisionNotFoundError)
        Exception.__init__(missing, "404 Client Error: Revision Not Found")
        raise missing

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(download.DownloadError, match="has no revision deadbeef; check --revision"):
        download.download(tmp_path, "deadbeef")
