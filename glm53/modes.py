"""The tier modes (`--mode`) and the one table of which engine serves which mode, and what each
mode needs. Every check of a mode against a set of modes reads `RULES` here; nothing else lists
modes (glm53.config parses `--mode` into `Mode`; the engines and the doctor ask `rule`).

A rule per (engine, mode):
- `served`: the engine runs the mode; where False, `refusal` says why and what to use instead;
- `store`: "needs" (--store required), "refuses" (--store would do nothing), or "optional";
- `lane`: the CPU lane takes part (--cpus, --cpu-threads, --ct-precision, --ct-b);
- `one_gpu`: the mode runs on one GPU (--gpus names at most one);
- `load`: the GPU engine's load under it (glm53.exl3.options.LoadMode: exact or nvme-exact; the
  lane modes add the CPU lane on top of that load);

The GPU engine maps `auto` to exact. The CPU engine runs one path for every mode (the tiers
over the store or the shards; the mode only picks the lane's precision), and the scripted
engine replays a script whatever the mode says: both serve every mode, as they always have.

What has not yet passed all of its GPU tests (never run on a GPU, run only in part, or run and
failed with the fix not yet rerun) is gated by --allow-unrun-modes, and only that: `UNRUN` names it and
`UNRUN_STATUS` says where each stands. It imports nothing from glm53.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Mode(StrEnum):
    """`--mode`: how the routed experts are tiered."""

    AUTO = "auto"
    EXACT = "exact"  # VRAM cache + pinned RAM, bit-identical to stock exllamav3
    FAST = "fast"  # exact's tiers + the CPU lane taking the coldest decode misses
    NVME = "nvme"  # NVMe store -> RAM tier -> VRAM, + the CPU lane
    NVME_EXACT = "nvme-exact"  # NVMe store -> RAM tier -> VRAM, bit-identical


# The tier modes themselves, without auto (a choice among them): what `glm53 doctor` plans and
# predicts (glm53.doctor.costmodel imports it as its Mode). Made from Mode, so the names and
# values are written once; a TierMode equals the Mode of the same value.
TierMode = StrEnum(
    "TierMode", [(m.name, m.value) for m in Mode if m is not Mode.AUTO], module=__name__
)


class ReferenceMode(StrEnum):
    """The GPU engine's reference loads (tests and benches; never a --mode)."""

    STOCK = "stock"  # exllamav3 as shipped, every expert in VRAM
    ZEROCOPY = "zerocopy"  # experts in pinned RAM read over PCIe, no cache


Engine = Literal["cpu", "gpu", "scripted"]
Store = Literal["needs", "refuses", "optional"]


@dataclass(frozen=True)
class ModeRule:
    served: bool
    store: Store = "optional"
    lane: bool = False
    one_gpu: bool = False
    load: str = ""
    name: str = ""  # the mode as messages name it
    what: str = ""  # store="refuses": what the mode keeps instead of a store
    refusal: str = ""  # served=False: why, and the fix


_EXACT_WHAT = "keeps every routed expert in pinned RAM"
_FAST_WHAT = "keeps every routed expert in pinned RAM, as exact mode does,"

RULES: dict[tuple[Engine, Mode], ModeRule] = {
    ("gpu", Mode.EXACT): ModeRule(
        True, store="refuses", load="exact", name="exact mode", what=_EXACT_WHAT
    ),
    ("gpu", Mode.FAST): ModeRule(
        True,
        store="refuses",
        lane=True,
        one_gpu=True,
        load="exact",
        name="fast mode",
        what=_FAST_WHAT,
    ),  # fmt: skip
    ("gpu", Mode.NVME_EXACT): ModeRule(
        True, store="needs", one_gpu=True, load="nvme-exact", name="nvme-exact"
    ),
    ("gpu", Mode.NVME): ModeRule(  # GPU tests passed on an H200, 2026-12-05 (6 of 6)
        True, store="needs", lane=True, one_gpu=True, load="nvme-exact", name="nvme mode"
    ),
    **{("cpu", m): ModeRule(True) for m in Mode if m is not Mode.AUTO},
    **{("scripted", m): ModeRule(True) for m in Mode if m is not Mode.AUTO},
}


def resolved(engine: Engine, mode: Mode | str) -> Mode:
    """The mode an engine runs for `mode`: the GPU engine runs auto as exact; the other engines
    read auto as it is (the CPU lane's precision follows it)."""
    mode = Mode(mode)
    return Mode.EXACT if mode is Mode.AUTO and engine == "gpu" else mode


def rule(engine: Engine, mode: Mode | str) -> ModeRule:
    """The rule for `mode` (auto resolved) on `engine`."""
    mode = resolved(engine, mode)
    if mode is Mode.AUTO:  # the CPU and scripted engines: every mode is one path there
        return ModeRule(True)
    return RULES[engine, mode]


def served(engine: Engine) -> tuple[Mode, ...]:
    """The tier modes `engine` serves."""
    return tuple(m for (e, m), r in RULES.items() if e == engine and r.served)


def lane_runs_beside_gpu(engine: str, mode: Mode | str) -> bool:
    """Whether the CPU lane runs beside the GPU: the GPU engine's lane modes (fast, nvme)."""
    return engine == "gpu" and Mode(mode) is not Mode.AUTO and RULES["gpu", Mode(mode)].lane


# --nvme-prefetch: the store modes' decode prefetch (glm53.tiers.decode_prefetch); next-layer
# only where the load is nvme-exact (nvme-exact and nvme)
NVME_PREFETCH = ("off", "next-layer")


# What has not yet passed all of its GPU tests: never run on a GPU, run only in part, or run and
# failed with the fix not yet rerun. Served only with --allow-unrun-modes (for those tests).
# key -> what it is, for the refusal; UNRUN_STATUS: key -> where it stands (the results:
# bench/results/README.md). fast and nvme-exact passed theirs (H200, 2026-12-02), nvme mode,
# the staging loan in exact mode and --prefill layer-major theirs (2026-12-05, layer-major 6 of 6
# on an H200), and in the whole GPU suite on an H100 on 2026-12-05 prefill staging from the
# store, --prefill layer-major in the store modes, decode prefetch (--nvme-prefetch next-layer)
# and the split with every --gpus entry on one device (0,0): not here. Still here: the loan
# beside fast's lane, the split over two or more distinct devices and the store modes' pass
# staging each layer once (none has run; without the flag that pass reads zero-copy, unrefused).
UNRUN = {
    "split": "the layer split over two or more distinct GPUs (docs/multi-gpu.md)",
    "stage-loan": "the staging loan in fast mode (--ec-stage-loan: the prefill staging buffers "
    "serve as expert-cache slots between prefills, glm53.tiers.vram_cache.StagingLoan)",
    "store-pass-staging": "the store modes' layer-major pass staging each layer once (--prefill "
    "layer-major in nvme-exact or nvme with staging on: the layer's resident experts copied into "
    "a staging buffer at its first chunk, glm53.exl3.nvme_device)",
}
UNRUN_STATUS = {
    "store-pass-staging": "was written on 2026-12-05 after layer-major's unstaged store path "
    "passed its GPU test, and has not yet run on a GPU; without --allow-unrun-modes the pass "
    "reads each chunk's picks zero-copy (the tested path)",
    "stage-loan": "passed its GPU tests in exact mode (H200, 2026-12-05: torch.equal to stock "
    "exllamav3's Generator); with fast mode's lane it has not yet run on a GPU",
    "split": "has run only with every --gpus entry on one GPU (--gpus 0,0: both layer ranges on "
    "that GPU, equal to one GPU and to stock exllamav3 in-process and through the server, on an "
    "H200 and on an H100 on 2026-12-05), never over two distinct devices",
}


def recommended(engine: Engine) -> tuple[Mode, ...]:
    """The tier modes `glm53 doctor` may recommend on `engine`: those it serves without
    --allow-unrun-modes (a mode named in UNRUN has not yet passed its GPU tests)."""
    return tuple(m for m in served(engine) if m.value not in UNRUN)
