"""Rewrite a checkpoint's safetensors with other shard boundaries and another tensor order.

    python tools/reshard_checkpoint.py SRC DST [--shard-mb 700]

The GPU parity tests need a checkpoint laid out differently from what `glm53 synth` writes: the
tensors go in reverse name order into shards of about --shard-mb (so a layer's experts straddle
files in other places), with a fresh `model.safetensors.index.json`; every other file is copied.
It uses only the `safetensors` library, none of glm53's writer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def reshard(src: Path, dst: Path, shard_bytes: int) -> int:
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{src}: no *.safetensors")
    dst.mkdir(parents=True, exist_ok=False)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name != ("model.safetensors.index.json")
        ):
            shutil.copy2(f, dst / f.name)
    where, nbytes = {}, {}
    for f in files:
        for k, v in _header(f).items():
            if k != "__metadata__":
                where[k], nbytes[k] = f, v["data_offsets"][1] - v["data_offsets"][0]
    shards: list[list[str]] = [[]]
    size = 0
    for k in sorted(where, reverse=True):
        if shards[-1] and size + nbytes[k] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes[k]
    weight_map = {}
    handles = {f: safe_open(f, "pt") for f in files}
    for i, keys in enumerate(shards):
        name = f"resharded-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: handles[where[k]].get_tensor(k) for k in keys}
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return len(shards)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--shard-mb", type=float, default=700)
    a = p.parse_args(argv)
    n = reshard(a.src, a.dst, int(a.shard_mb * 2**20))
    print(f"{a.dst}: {n} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
