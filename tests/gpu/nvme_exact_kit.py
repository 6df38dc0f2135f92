"""What the two nvme-exact files share (test_nvme_exact_gpu.py in-process,
test_nvme_exact_store_gpu.py served, the store's verify and its read faults): the prompts, the
RAM caps, the stock runs and the case (the slice, its store, the reference tokens and logits)."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_kit import (
    batch_prompts,
    checkpoint_dir,
    expert_slots,
    num_records,
    reference_spec,
    single_prompts,
    singles_spec,
    stock_reference,
    text_config,
    together_generator,
)

LENGTHS = (1, 9, 257, 2049, 5000)
CONTEXT = 8192
VRAM_SHARE = 0.114  # the 24 GB RTX 3090's share of the experts
RAM_SHARES = (0.4, 0.7)


def singles(path):
    return singles_spec(path, LENGTHS)


def together(path):
    """The shared set's prompts admitted together (test_generator_parity.py's batch run: the
    same reference unit, computed once): decode forwards of several rows."""
    prompts = batch_prompts(text_config(path)["vocab_size"])
    return reference_spec(
        path, [{"prompts": prompts, "together": True, "generator": together_generator()}]
    )


def ram(e) -> dict:
    """The RAM tier's stats (staging's and prefetch's counters included), for the messages."""
    return e.stats()["tiers"]["ram"]


def make_case(path: str, store: str, tmp: Path) -> dict:
    prompts = single_prompts(text_config(path)["vocab_size"], LENGTHS)
    (ref,) = stock_reference(singles(path), tmp)
    record = json.loads(Path(store, "manifest.json").read_text())["record_bytes"]
    return {
        "path": path,
        "store": store,
        "tmp": tmp,
        "prompts": prompts,
        "ref": dict(zip(LENGTHS, ref, strict=True)),
        "slots": expert_slots(path, VRAM_SHARE),
        "cap": {s: int(s * num_records(path)) * record for s in RAM_SHARES},
        "record": record,
    }


def slice_path() -> str | None:
    return checkpoint_dir("GLM53_TEST_SLICE")
