"""A rich progress bar that shows up only for work that runs longer than a second, and only
on a terminal (logs and pipes get the commands' summary lines instead)."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

DELAY_S = 1.0


class LazyBar:
    """Call it with (done, total); `unit` is "bytes" or "records"."""

    def __init__(
        self,
        description: str,
        unit: str = "bytes",
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.description, self.unit = description, unit
        self.console = console or Console(stderr=True)
        self.clock = clock
        self.started_at = clock()
        self.progress: Progress | None = None
        self.task = None

    @property
    def shown(self) -> bool:
        return self.progress is not None

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None:
            if not self.console.is_terminal or self.clock() - self.started_at < DELAY_S:
                return
            if self.unit == "bytes":
                counts = [DownloadColumn(), TransferSpeedColumn()]
            else:
                counts = [MofNCompleteColumn()]
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                *counts,
                TimeRemainingColumn(),
                console=self.console,
            )
            self.progress.start()
            self.task = self.progress.add_task(self.description, total=total)
        self.progress.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __enter__(self) -> LazyBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
