# Types of the compiled glm53._gemv (pyx/_gemv.pyx); the math and layouts are in pyx/gemv.h.
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

MAX_ROWS: int
MAX_PICKS: int
SCALAR: int
AVX2: int
AVX512: int
AVX512_FP16: int
VARIANTS: tuple[int, ...]
BEST: int
CALLER_WAITS: int
CALLER_HELPS: int
CALLER_RUNS_ALL: int

Matrix = tuple[npt.NDArray[np.int16], npt.NDArray[np.float16], npt.NDArray[np.float16]]

def variant_name(variant: int) -> str: ...
def variant_supported(variant: int) -> bool: ...
def best_variant() -> int: ...

class ExpertTable:
    num_experts: int
    hidden: int
    inter: int
    k2: int
    def __init__(self, num_experts: int, hidden: int, inter: int, k2: int) -> None: ...
    def set(self, index: int, gate: Matrix, up: Matrix, down: Matrix) -> None: ...
    def addresses(self, index: int) -> tuple[int, ...]: ...
    @property
    def handle(self) -> int: ...

class Job:
    out: npt.NDArray[np.float32]
    def wait(self) -> npt.NDArray[np.float32]: ...
    @property
    def done(self) -> int: ...
    @property
    def seq(self) -> int: ...

class Pool:
    threads: int
    cpus: tuple[int, ...] | None
    def __init__(self, threads: int, cpus: Sequence[int] | None = None) -> None: ...
    @property
    def handle(self) -> int: ...
    idle_spin_ns: int
    def submit(
        self,
        table: ExpertTable,
        x: npt.NDArray[np.float32],
        rows: Sequence[int] | npt.NDArray[np.integer],
        experts: Sequence[int] | npt.NDArray[np.integer],
        weights: Sequence[float] | npt.NDArray[np.floating],
        out: npt.NDArray[np.float32] | None = None,
        *,
        variant: int = ...,
        act_limit: float = 10.0,
        done: npt.NDArray[np.uint32] | None = None,
    ) -> Job: ...
    def run(
        self,
        table: ExpertTable,
        x: npt.NDArray[np.float32],
        rows: Sequence[int] | npt.NDArray[np.integer],
        experts: Sequence[int] | npt.NDArray[np.integer],
        weights: Sequence[float] | npt.NDArray[np.floating],
        out: npt.NDArray[np.float32] | None = None,
        *,
        variant: int = ...,
        act_limit: float = 10.0,
    ) -> npt.NDArray[np.float32]: ...
    def run_picks(
        self,
        table: ExpertTable,
        x: npt.NDArray[np.float32],
        rows: npt.NDArray[np.int64],
        experts: npt.NDArray[np.int32],
        weights: npt.NDArray[np.float32],
        dest: npt.NDArray[np.int64],
        out: npt.NDArray[np.float32],
        *,
        variant: int = ...,
        act_limit: float = 10.0,
        caller: int = ...,
    ) -> int: ...

def tiles(
    variant: int,
    trellis: npt.NDArray[np.int16],
    xh: npt.NDArray[np.float32],
    kt0: int = 0,
    kt1: int | None = None,
) -> npt.NDArray[np.float32]: ...
