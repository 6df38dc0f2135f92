import enum
import os
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Self

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

FIX: str
MEMORY_FILESYSTEMS: frozenset[str]
SHA256_LANES: int

class ODirectError(OSError):
    offset: int | None
    def __init__(self, errno_: int, message: str, offset: int | None = None) -> None: ...

class Priority(enum.IntEnum):
    DEMAND = 0
    PREFETCH = 1

class DoneFlag(enum.IntEnum):
    PENDING = 0
    OK = 1
    FAILED = 2

class Completion:
    tag: Any
    status: int
    error: ODirectError | None
    @property
    def ok(self) -> bool: ...
    def check(self) -> None: ...

def filesystem_of(
    path: str | os.PathLike[str], mounts_text: str | None = None
) -> tuple[str, str]: ...
def probe(path: str | os.PathLike[str]) -> None: ...
def aligned_empty(nbytes: int, alignment: int = 4096) -> npt.NDArray[np.uint8]: ...
def sha256_many(buffers: Iterable[Buffer]) -> list[bytes]: ...

class _Queue:
    path: str
    alignment: int
    piece_bytes: int
    num_threads: int
    @property
    def closed(self) -> bool: ...
    @property
    def num_in_flight(self) -> int: ...
    @property
    def handle(self) -> int: ...
    def submit(
        self,
        offset: int,
        length: int,
        buf: Buffer,
        tag: Any,
        priority: Priority = ...,
        *,
        flag: Buffer | None = None,
    ) -> None: ...
    def submit_many(self, requests: Iterable[tuple[Any, ...]]) -> None: ...
    def poll(self) -> list[Completion]: ...
    def wait(
        self, tags: Iterable[Any] | None = None, timeout: float | None = None
    ) -> list[Completion]: ...
    def close(self, cancel: bool = False) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

class Reader(_Queue):
    def __init__(
        self, path: str | os.PathLike[str], threads: int = 4, piece_bytes: int = 2097152
    ) -> None: ...

class Writer(_Queue):
    def __init__(
        self,
        path: str | os.PathLike[str],
        threads: int = 4,
        piece_bytes: int = 2097152,
        *,
        truncate: bool = False,
    ) -> None: ...
    def preallocate(self, offset: int, length: int) -> None: ...
    def sync(self) -> None: ...
