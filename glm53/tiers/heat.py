"""Heat lists: a tier's resident experts, hottest first, kept across restarts so that a server
starts warm. One file per checkpoint (by its config's sha256) and tier, under heat/ in glm53's
cache directory (--cache-dir, by default $XDG_CACHE_HOME/glm53): `{digest}.json` for the VRAM
expert cache, `{digest}-ram-{where}.json` for the RAM tier. Keys are `moe_index * experts_per_layer + expert` over the checkpoint's MoE layers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from glm53.config import default_cache_dir

log = logging.getLogger("glm53.tiers")


def heat_path(
    model_dir: str,
    tier: str = "vram",
    source: str | None = None,
    cache_dir: str | Path | None = None,
) -> str:
    """Where the heat list of a checkpoint's `tier` ("vram" or "ram") lives, under `cache_dir`
    (glm53.config.cache_dir of the settings; None: the default one). The RAM tier's is also
    keyed by where its experts come from (`source`: the store or the checkpoint directory), so
    two stores of one checkpoint keep two lists."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if tier == "vram":
        name = f"{digest}.json"
    else:
        where = hashlib.sha256(os.path.realpath(source or model_dir).encode()).hexdigest()[:12]
        name = f"{digest}-{tier}-{where}.json"
    return str(base / "heat" / name)


def write_heat(path: str, model_dir: str, keys: list[int]) -> None:
    """Write a heat list atomically (a crash leaves the old one or the new one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"model": os.path.realpath(model_dir), "keys": [int(k) for k in keys]}, f)
    os.replace(tmp, path)


def read_heat(path: str, num_keys: int) -> list[int]:
    """The keys of a heat list ([] when there is none). A file that cannot be read, or that
    names keys outside this checkpoint's range, is logged and not used."""
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            keys = [int(k) for k in json.load(f)["keys"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("heat list %s is unreadable (%s); starting cold", path, exc)
        return []
    bad = [k for k in keys if not 0 <= k < num_keys]
    if bad:
        log.warning(
            "heat list %s names %d keys outside this checkpoint's %d (first %d); starting cold",
            path, len(bad), num_keys, bad[0],
        )  # fmt: skip
        return []
    return keys
