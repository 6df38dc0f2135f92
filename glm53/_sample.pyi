# Types of the compiled glm53._sample (pyx/_sample.pyx); the semantics are in pyx/sample.h.
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

GREEDY: int
PLAIN: int
FILTERED: int

class RowSampler(Protocol):
    mode: int
    temperature: float
    min_p: float
    def uniform(self) -> float: ...
    def draw_filtered(self, row: npt.NDArray[np.float32]) -> int: ...

def sample_rows(logits: npt.NDArray[np.floating], samplers: Sequence[RowSampler]) -> list[int]: ...
def penalize_row(
    row: npt.NDArray[np.float32],
    ids: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    n: int,
    presence: float,
    frequency: float,
    repetition: float,
) -> None: ...
