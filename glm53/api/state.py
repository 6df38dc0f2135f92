"""What the request handlers share: settings, the engine and its scheduler, counters, load state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from glm53.api.errors import ApiError
from glm53.api.metrics import Metrics
from glm53.api.offload import Offload
from glm53.config import Settings, Source
from glm53.engine.base import Engine
from glm53.engine.scheduler import Scheduler
from glm53.tiers.thread_pins import ThreadPin


class ServerStatus(enum.StrEnum):
    """Where the server is in its life (/health, /stats and /server_info show it as a string)."""

    LOADING = "loading"  # the model loads in the background
    READY = "ready"  # serving
    DRAINING = "draining"  # SIGTERM: finishing what it has, taking nothing new
    FAILED = "failed"  # the model failed to load
    STOPPING = "stopping"  # the lifespan is shutting down


@dataclass
class ServerState:
    """Owned by the event loop of the one worker process."""

    settings: Settings
    sources: dict[str, Source]
    metrics: Metrics = field(default_factory=Metrics)
    offload: Offload = field(default_factory=Offload)
    engine: Engine | None = None
    scheduler: Scheduler | None = None
    status: ServerStatus = ServerStatus.LOADING
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)
    load_seconds: float | None = None
    frozen_objects: int = 0  # objects the load left out of later collections (app.freeze_heap)
    thread_pins: dict[str, ThreadPin] = field(default_factory=dict)  # fast mode: role -> pin
    checkpoint: str | None = None

    def ready_scheduler(self) -> Scheduler:
        """The scheduler, or a 503 saying why there is none yet."""
        if self.status == ServerStatus.READY and self.scheduler is not None:
            return self.scheduler
        if self.status == ServerStatus.FAILED:
            raise ApiError(
                503, f"the model failed to load: {self.load_error}", code="model_load_failed"
            )
        if self.status == ServerStatus.DRAINING:
            # A router takes the 503 as "try another replica"; Retry-After is for a lone client.
            raise ApiError(
                503,
                "the server is draining before it stops (SIGTERM): it finishes the requests it "
                "has and takes no new ones; send this one to another replica",
                code="draining",
                headers=((b"retry-after", b"1"),),
            )
        if self.status == ServerStatus.STOPPING:
            raise ApiError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers=((b"retry-after", b"1"),),
            )
        raise ApiError(503, "the model is still loading; retry shortly", code="model_loading")
