"""Read-only endpoints (/v1/models, /health, /stats, /server_info, /metrics, /dashboard,
/openapi.json) and POST /admin/save_heat."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import msgspec

from glm53 import __version__
from glm53.api.errors import ApiError
from glm53.api.http import Receive, Send, send_bytes
from glm53.api.openapi import openapi_document
from glm53.api.schemas import Health, ModelCard, ModelList
from glm53.api.state import ServerState, ServerStatus
from glm53.config import effective

_encoder = msgspec.json.Encoder()


def _context_length(state: ServerState) -> int:
    return (
        state.scheduler.context_length
        if state.status == ServerStatus.READY
        else state.settings.context
    )


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.settings.served_name,
        created=int(state.started_at),
        max_model_len=_context_length(state),
        root=state.checkpoint,
    )


async def models(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    await send_bytes(send, 200, _encoder.encode(ModelList([_model_card(state)])))
    return 200


async def model(state: ServerState, name: str, send: Send) -> int:
    if name != state.settings.served_name:
        raise ApiError(
            404, f"the model {name!r} does not exist", param="model", code="model_not_found"
        )
    await send_bytes(send, 200, _encoder.encode(_model_card(state)))
    return 200


async def health(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    if state.status != ServerStatus.READY:
        state.ready_scheduler()  # raises the 503 that says why
    await send_bytes(send, 200, _encoder.encode(Health("ok")))
    return 200


def _is_serving(state: ServerState) -> bool:
    """Loaded and running: ready, or draining the requests it has."""
    return (
        state.status in (ServerStatus.READY, ServerStatus.DRAINING) and state.scheduler is not None
    )


def _engine_stats(state: ServerState) -> dict:
    return state.engine.stats() if _is_serving(state) else {}


async def stats(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    scheduler = state.scheduler.stats() if _is_serving(state) else {}
    payload = {
        "status": state.status,
        **state.metrics.summary(),
        "queue": scheduler,
        "engine": _engine_stats(state),
        "frozen_objects": state.frozen_objects,
        "thread_pins": {role: msgspec.to_builtins(pin) for role, pin in state.thread_pins.items()},
    }
    await send_bytes(send, 200, _encoder.encode(payload))
    return 200


async def save_heat(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    """Write the VRAM expert cache's keys as the warm-start heat list now (it is also written
    at shutdown), so a crash or a kill -9 later does not lose a long run's warm cache."""
    state.ready_scheduler()
    path = await asyncio.to_thread(state.engine.save_heat)
    if path is None:
        raise ApiError(
            409,
            f"the {state.engine.name} engine keeps no VRAM expert cache, so there is no heat list "
            "to save; heat lists belong to the GPU engine (--engine gpu)",
            code="no_expert_cache",
        )
    await send_bytes(send, 200, _encoder.encode({"heat_file": path}))
    return 200


async def server_info(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    engine = state.engine
    payload = {
        "version": __version__,
        "status": state.status,
        "load_error": state.load_error,
        "engine": engine.name if engine else None,
        "engine_description": engine.description if engine else None,
        "is_model": engine.is_model if engine else None,
        "checkpoint": state.checkpoint,
        "context_length": _context_length(state),
        "vocab_size": engine.tokenizer.vocab_size if state.status == ServerStatus.READY else None,
        "max_running_requests": state.scheduler.num_slots
        if state.status == ServerStatus.READY
        else state.settings.max_batch,
        "load_seconds": state.load_seconds,
        "uptime_seconds": round(time.time() - state.started_at, 3),
        "settings": effective(state.settings, state.sources),
    }
    await send_bytes(send, 200, _encoder.encode(payload))
    return 200


async def metrics(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    scheduler = state.scheduler.stats() if _is_serving(state) else {}
    text = state.metrics.prometheus(scheduler, _engine_stats(state))
    await send_bytes(
        send, 200, text, ((b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),)
    )
    return 200


_DASHBOARD = Path(__file__).with_name("dashboard.html")


@functools.cache
def _dashboard_page() -> bytes:
    return _DASHBOARD.read_bytes()


async def dashboard(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    """The live tier page: static HTML that polls /stats every second."""
    await send_bytes(
        send,
        200,
        _dashboard_page(),
        ((b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-cache")),
    )
    return 200


async def openapi(state: ServerState, body: bytes, receive: Receive, send: Send) -> int:
    await send_bytes(send, 200, openapi_document())
    return 200
