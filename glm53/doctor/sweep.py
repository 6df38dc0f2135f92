"""Reads a `bench/sweep.py --json` result so the doctor can show a measurement beside its
prediction. The result is the bench contract's object ({"bench", "figures", "ratios",
"config"}), alone in the file or as its last line. From `figures` it takes the decode rate at
concurrency 1 (`decode_c1_tok_s`; also `c1_tok_s`, `decode_tok_s_c1`) and the prefill rate of
the shortest prompt (`prefill_8192_tok_s`; also `prefill_8k_tok_s`, `prefill_tok_s_8192`), and
the mode from `config.mode` when present."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec

_DECODE_C1 = re.compile(r"^(decode_)?(agg_)?c1(_agg)?(_decode)?_tok_s$|^decode(_agg)?_tok_s_c1$")
_PREFILL = re.compile(r"^prefill_(\d+)(k?)_tok_s$|^prefill_tok_s_(\d+)(k?)$")


class SweepResult(msgspec.Struct, frozen=True):
    mode: str | None
    decode_c1_tok_s: float | None
    prefill_tokens: int | None
    prefill_tok_s: float | None


def parse_sweep(text: str, where: str = "sweep result") -> SweepResult:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    doc = None
    for candidate in (text, lines[-1] if lines else ""):
        try:
            doc = json.loads(candidate)
            break
        except json.JSONDecodeError:
            continue
    if not isinstance(doc, dict) or not isinstance(doc.get("figures"), dict):
        raise ValueError(
            f"{where}: not a bench result; expected the JSON object bench/sweep.py --json prints "
            'last ({"bench": "sweep", "figures": {...}, "config": {...}})'
        )
    figures = doc["figures"]
    decode = next((float(v) for k, v in figures.items() if _DECODE_C1.match(k)), None)
    prefills = []
    for key, value in figures.items():
        m = _PREFILL.match(key)
        if m and value is not None:
            n = int(m.group(1) or m.group(3))
            prefills.append((n * 1024 if (m.group(2) or m.group(4)) else n, float(value)))
    if decode is None and not prefills:
        raise ValueError(
            f"{where}: no decode_c1_tok_s or prefill_<N>_tok_s among its figures "
            f"({', '.join(sorted(figures)) or 'none'})"
        )
    tokens, prefill = min(prefills) if prefills else (None, None)
    mode = (doc.get("config") or {}).get("mode")
    return SweepResult(
        mode=str(mode) if mode else None,
        decode_c1_tok_s=decode,
        prefill_tokens=tokens,
        prefill_tok_s=prefill,
    )


def read_sweep(path: str) -> SweepResult:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--compare {path}: no such file (a bench/sweep.py --json result)")
    return parse_sweep(p.read_text(), f"--compare {path}")
