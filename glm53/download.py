"""`glm53 download`: fetch the pinned GLM-5.3-Flash EXL3 checkpoint with huggingface_hub
(resumable, with progress bars), after checking the disk has room, then check what arrived
and print the next command."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from glm53.errors import Glm53Error

REPO = "turboderp/GLM-5.3-Flash-exl3"
BRANCH = "3.05bpw"
REVISION = "332ab457b709b7ba30dd9a448be5de03b80a7ac9"  # the pinned commit of branch 3.05bpw
DEFAULT_DIRNAME = "GLM-5.3-Flash-exl3-3.05bpw"
SPACE_MARGIN_BYTES = 1 << 30
METADATA_TIMEOUT_S = 15.0


class DownloadError(Glm53Error):
    """Why the download cannot go on; exit_code 2 for the environment (network, disk), 1 for a
    checkpoint that arrived but is not the expected one."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_parser(sub) -> None:
    p = sub.add_parser(
        "download",
        help="download the pinned GLM-5.3-Flash EXL3 checkpoint (125.3 GB)",
        description=f"Downloads {REPO}, branch {BRANCH} at revision {REVISION}, with "
        "huggingface_hub: resumable, with progress bars, after a free-space check; then checks "
        "config.json and quantization_config.json and prints the next command.",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        default=DEFAULT_DIRNAME,
        help=f"target directory (default: ./{DEFAULT_DIRNAME})",
    )
    p.add_argument(
        "--revision",
        metavar="REV",
        default=REVISION,
        help=f"commit to download (default: the pinned {REVISION[:12]}, branch {BRANCH})",
    )
    p.set_defaults(func=run)


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged user on the filesystem that holds (or will hold) path."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def remote_files(revision: str) -> dict[str, int]:
    """{path in repo: size in bytes} of the revision; DownloadError naming the cause when the
    Hub cannot be reached or does not have it."""
    from huggingface_hub import HfApi, errors

    try:
        info = HfApi().model_info(
            REPO, revision=revision, files_metadata=True, timeout=METADATA_TIMEOUT_S
        )
    except errors.RevisionNotFoundError:
        raise DownloadError(f"{REPO} has no revision {revision}; check --revision") from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(
            f"{REPO} not found at {endpoint()} (private, moved, or a proxy)"
        ) from None
    except errors.OfflineModeIsEnabled:
        raise DownloadError("HF_HUB_OFFLINE is set: unset it to download") from None
    except Exception as e:  # the transport's own errors (connect, DNS, TLS, timeout, proxy)
        raise DownloadError(
            f"cannot reach the Hugging Face Hub at {endpoint()} ({type(e).__name__}: {e}). "
            "glm53 download needs network access to it; on a host without, run `glm53 download "
            "--dir DIR` elsewhere and copy DIR here"
        ) from None
    return {s.rfilename: int(s.size or 0) for s in info.siblings or []}


def missing_bytes(target: Path, files: dict[str, int]) -> int:
    """Bytes still to fetch: files absent or of another size (a finished file is skipped)."""
    todo = 0
    for name, size in files.items():
        local = target / name
        if not (local.is_file() and local.stat().st_size == size):
            todo += size
    return todo


def check_checkpoint(target: Path) -> str:
    """The architecture of a downloaded checkpoint; DownloadError (exit 1) unless it has
    config.json and quantization_config.json and is a glm5_next model."""
    config = target / "config.json"
    if not config.is_file():
        raise DownloadError(f"{target} has no config.json: the download is incomplete", 1)
    if not (target / "quantization_config.json").is_file():
        raise DownloadError(
            f"{target} has no quantization_config.json: not an EXL3 checkpoint, or incomplete", 1
        )
    try:
        cfg = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise DownloadError(f"{config} is not JSON ({e}): download it again", 1) from None
    if cfg.get("model_type") != "glm5_next":
        raise DownloadError(
            f"{config}: model_type {cfg.get('model_type')!r}, expected 'glm5_next' "
            "(GLM-5.3-Flash): wrong repository or revision",
            1,
        )
    return ", ".join(cfg.get("architectures") or ["glm5_next"])


def next_command(target: Path) -> list[str]:
    """The next steps: serve from RAM when every expert fits, else pack the NVMe store."""
    from glm53.doctor.costmodel import all_ram_bytes
    from glm53.doctor.inputs import memory_budget
    from glm53.doctor.memory import probe_memory
    from glm53.doctor.source import LiveSource, Unavailable

    try:
        budget = memory_budget(probe_memory(LiveSource())).bytes
    except (Unavailable, ValueError):
        budget = 0
    if budget >= all_ram_bytes():
        return [f"glm53 serve --model {target}"]
    return [
        f"glm53 store pack --model {target} --out /path/on/nvme/glm53-store",
        f"glm53 doctor --model {target}   # shows where the store fits and the mode to run",
    ]


def download(target: Path, revision: str) -> str:
    files = remote_files(revision)
    if not files:
        raise DownloadError(f"{REPO}@{revision} lists no files")
    need = missing_bytes(target, files)
    free = free_bytes(target)
    if need + SPACE_MARGIN_BYTES > free:
        raise DownloadError(
            f"{target}: {free / 1e9:.1f} GB free, the download needs {need / 1e9:.1f} GB more "
            f"(of {sum(files.values()) / 1e9:.1f} GB): free space or choose another --dir"
        )
    print(
        f"downloading {REPO} ({BRANCH} @ {revision[:12]}): {need / 1e9:.1f} GB of "
        f"{sum(files.values()) / 1e9:.1f} GB to {target} ({free / 1e9:.1f} GB free)",
        flush=True,
    )
    from huggingface_hub import snapshot_download

    target.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(REPO, revision=revision, local_dir=target, max_workers=8)
    except Exception as e:  # transport errors mid-download: a rerun resumes
        raise DownloadError(
            f"download interrupted ({type(e).__name__}: {e}); run the same command again to resume"
        ) from None
    return check_checkpoint(target)


def run(args) -> int:
    target = Path(args.dir).expanduser().absolute()
    try:
        arch = download(target, args.revision)
    except DownloadError as e:
        print(f"glm53 download: {e}", file=sys.stderr)
        return e.exit_code
    print(f"ok: {target} holds {arch} (config.json, quantization_config.json present)")
    print("next:")
    for line in next_command(target):
        print(f"  {line}")
    return 0
