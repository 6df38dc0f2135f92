"""Prints the installed Python, torch (and the CUDA it was built for), exllamav3,
huggingface_hub, nvidia-ml-py and glm53 versions as one JSON object with the fields of
glm53.doctor.host.Versions. Run by path in a child process: importing torch can be slow and
must not hang the doctor; it imports nothing from glm53."""

import json
import platform
from importlib import metadata


def _dist(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect() -> dict:
    torch_version = torch_cuda = None
    arch_list: list = []
    try:
        import torch

        torch_version = str(torch.__version__)
        torch_cuda = torch.version.cuda
        arch_list = list(torch.cuda.get_arch_list()) if torch_cuda else []
    except ImportError:
        pass  # torch stays None: "not installed" in the report
    return {
        "python": platform.python_version(),
        "torch": torch_version,
        "torch_cuda": torch_cuda,
        "torch_arch_list": arch_list,
        "exllamav3": _dist("exllamav3"),
        "huggingface_hub": _dist("huggingface_hub"),
        "nvidia_ml_py": _dist("nvidia-ml-py"),
        "glm53": _dist("glm53"),
    }


if __name__ == "__main__":
    print(json.dumps(collect()))
