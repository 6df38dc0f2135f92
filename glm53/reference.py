"""Reference panels: prompts with a reference engine's teacher-forced top-k logprobs at every
position, the fingerprint of the checkpoint they came from and the versions that made them.
reference/README.md describes the file; `glm53 reference make` writes one; bench/score_ref_panel.py
scores a running server against one, and bench/decode_kl.py compares two servers, both with
`compare` below.

Position i of a prompt is the distribution after its tokens 0..i, which scores token i + 1, so a
prompt of n tokens has n - 1 positions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

FORMAT = "glm53-reference-panel/1"
# Files whose bytes the fingerprint hashes; the weight shards enter by name and size only (a
# real checkpoint is 125 GB: hashing it would take minutes).
_HASHED_FILES = (
    "config.json",
    "quantization_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
)


class Position(msgspec.Struct, array_like=True):
    """One position: the reference's top-k token ids and their logprobs, largest first."""

    top_ids: list[int]
    top_logprobs: list[float]


class PanelPrompt(msgspec.Struct):
    name: str
    token_ids: list[int]
    positions: list[Position]


class Panel(msgspec.Struct):
    format: str
    engine: str  # what computed the logprobs: cpu (glm53's CPU engine) or stock-exllamav3
    checkpoint_fingerprint: str
    checkpoint_name: str
    versions: dict[str, str]
    top_k: int
    prompts: list[PanelPrompt]


def fingerprint(checkpoint_dir: str | Path) -> str:
    """sha256 over the checkpoint's config and tokenizer files (their bytes) and its
    *.safetensors shards (names and sizes)."""
    directory = Path(checkpoint_dir)
    digest = hashlib.sha256()
    for name in _HASHED_FILES:
        path = directory / name
        if path.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def read_panel(path: str | Path) -> Panel:
    try:
        panel = msgspec.json.decode(Path(path).read_bytes(), type=Panel)
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"cannot read the panel {path}: {exc}") from exc
    if panel.format != FORMAT:
        raise ValueError(f"{path} is a {panel.format!r} panel; this glm53 reads {FORMAT!r}")
    return panel


def write_panel(panel: Panel, path: str | Path) -> None:
    data = msgspec.json.encode(panel)
    Path(path).write_bytes(data + b"\n")


def top_k_kl(
    ref_ids: Sequence[int],
    ref_logprobs: Sequence[float],
    test: dict[int, float],
) -> tuple[float, int]:
    """KL(reference || test) on the reference's top-k support, both renormalized over it.
    `test` is the tested side's top-k (id -> logprob); a support token missing from it gets the
    smallest logprob it has (an upper bound of its true value). Returns (KL in nats, number of
    support tokens missing from `test`)."""
    floor = min(test.values()) if test else -math.inf
    missing = sum(1 for i in ref_ids if i not in test)
    p = [math.exp(v) for v in ref_logprobs]
    q = [math.exp(test.get(i, floor)) for i in ref_ids]
    p_total, q_total = sum(p), sum(q)
    if not (p_total > 0 and q_total > 0):
        return math.inf, missing
    kl = 0.0
    for pi, qi in zip(p, q, strict=True):
        if pi > 0:
            pi, qi = pi / p_total, qi / q_total
            kl += pi * (math.log(pi) - math.log(qi)) if qi > 0 else math.inf
    return max(kl, 0.0), missing


class Comparison(msgspec.Struct):
    """A position-by-position comparison: top-1 agreement and top-k KL."""

    num_positions: int
    top1_agreement: float
    kl_mean: float
    kl_p50: float
    kl_p90: float
    kl_p99: float
    kl_max: float
    num_missing_support: int
    worst: list[dict]


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def compare(rows: list[tuple[str, int, list[int], list[float], dict[int, float]]], worst: int = 5):
    """Compare (label, position, reference top ids, reference top logprobs, test top-k) rows:
    the test's top-1 is the largest of its top-k."""
    kls, agree, missing, scored = [], 0, 0, []
    for label, pos, ref_ids, ref_lps, test in rows:
        kl, miss = top_k_kl(ref_ids, ref_lps, test)
        test_top = max(test, key=lambda i: (test[i], -i)) if test else -1
        agree += int(test_top == ref_ids[0])
        missing += miss
        kls.append(kl)
        scored.append((kl, label, pos, ref_ids[0], test_top))
    ordered = sorted(kls)
    scored.sort(key=lambda r: -r[0])
    return Comparison(
        num_positions=len(rows),
        top1_agreement=agree / len(rows) if rows else 0.0,
        kl_mean=sum(kls) / len(kls) if kls else 0.0,
        kl_p50=_quantile(ordered, 0.5),
        kl_p90=_quantile(ordered, 0.9),
        kl_p99=_quantile(ordered, 0.99),
        kl_max=ordered[-1] if ordered else 0.0,
        num_missing_support=missing,
        worst=[
            {"prompt": label, "position": pos, "kl": kl, "ref_top1": a, "test_top1": b}
            for kl, label, pos, a, b in scored[:worst]
        ],
    )


# The packages whose versions decide the CPU engine's numbers (its forward is transformers'
# glm5_next on torch; its prompts are tokenized by tokenizers, and transformers' own loading goes
# through huggingface_hub). pyproject.toml pins each of them (torch in the test extra: a GPU host
# keeps the CUDA build its exllamav3 wheel was made for), a CPU panel records them, and
# tests/test_reference_stack.py fails, naming both versions, when what is installed differs.
REFERENCE_STACK = ("torch", "transformers", "tokenizers", "huggingface_hub")


def versions(engine: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    names = ["glm53", *REFERENCE_STACK]
    if engine == "stock-exllamav3":
        names.append("exllamav3")
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out
