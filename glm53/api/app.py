"""The ASGI application: lifespan (the model loads in the background, /health says 503 until it
is ready), routing, authentication, body limits, and OpenAI-shaped errors for every failure."""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import signal
import time
from collections.abc import Callable

from glm53 import notify
from glm53.api import admin, chat, completions, info, native
from glm53.api.errors import ApiError
from glm53.api.http import ClientGone, Receive, Send, read_body, send_error
from glm53.api.state import ServerState, ServerStatus
from glm53.config import ConfigurationError, Settings, Source
from glm53.engine import checkpoint_dir, create_engine
from glm53.engine.base import Engine, EngineUnavailable
from glm53.engine.scheduler import Scheduler
from glm53.tiers.thread_pins import pin_server_threads

log = logging.getLogger("glm53.server")

ROUTES = {
    ("POST", "/v1/chat/completions"): chat.chat_completions,
    ("POST", "/v1/completions"): completions.completions,
    ("GET", "/v1/models"): info.models,
    ("GET", "/health"): info.health,
    ("GET", "/stats"): info.stats,
    ("GET", "/server_info"): info.server_info,
    ("GET", "/metrics"): info.metrics,
    ("GET", "/dashboard"): info.dashboard,
    ("GET", "/openapi.json"): info.openapi,
    ("POST", "/admin/save_heat"): info.save_heat,
    ("POST", "/generate"): native.generate,
    ("POST", "/tokenize"): native.tokenize,
}
# Routes whose handlers take the query string: (state, query, send).
QUERY_ROUTES = {("GET", "/admin/verify"): admin.verify}
_PATHS = {path for _, path in ROUTES} | {path for _, path in QUERY_ROUTES}
# The dashboard page holds no data (it polls /stats, sending the key from its URL's #key=).
_OPEN_PATHS = {"/health", "/dashboard"}
# After a drain timeout, how long the open responses get to send their error before the stop.
_ANSWER_ERRORS_S = 5.0


class _TrackedSend:
    """Wraps ASGI send to know whether a response has started and ended."""

    __slots__ = ("_send", "ended", "is_sse", "started")

    def __init__(self, send: Send):
        self._send = send
        self.started = self.ended = self.is_sse = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.is_sse = any(
                k == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message["headers"]
            )
        elif not message.get("more_body", False):
            self.ended = True
        await self._send(message)


def _bearer_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    expected = b"bearer " + api_key.encode()
    for name, value in headers:
        if name == b"authorization":
            return hmac.compare_digest(value[:7].lower() + value[7:], expected)
    return False


def freeze_heap() -> int:
    """Collect once, then move every object alive now (modules, the engine, the tokenizer) into
    the collector's permanent generation; the number moved.

    A full collection walks every tracked object in the process while holding the GIL: with the
    engine loaded, a large request's allocations set one off that held it 194-246 ms on the
    2-vCPU VM (bench/health_under_load.py, gc.callbacks), and /health waited as long. What is
    loaded lives as long as the process, so leaving it out of later collections costs at most
    a cycle among those objects that is dropped before the process ends and never collected;
    reference counting still frees whatever is dropped without a cycle."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class App:
    """glm53's ASGI app. `on_load_failed` runs after a failed model load (serve exits there).
    `freeze_heap`: freeze the loaded heap (freeze_heap) once the engine is up; serve's worker
    process does, a test that runs the app inside pytest's process does not."""

    def __init__(
        self,
        settings: Settings,
        sources: dict[str, Source],
        *,
        engine_factory: Callable[[Settings], Engine] = create_engine,
        on_load_failed: Callable[[BaseException], None] | None = None,
        on_drained: Callable[[], None] | None = None,
        freeze_heap: bool = False,
    ):
        self.state = ServerState(settings, sources)
        self._engine_factory = engine_factory
        self._on_load_failed = on_load_failed
        self._on_drained = on_drained
        self._freeze_heap = freeze_heap
        self._load_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None
        self._num_open = 0  # POST requests being answered (what a drain waits for)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    # --- lifespan ---------------------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self._on_drained is not None:
                    # granian's worker stops serving at once on SIGTERM; this handler replaces
                    # its own for SIGTERM (SIGINT keeps it), and `on_drained` stops the worker
                    # once the requests it has are done.
                    loop = asyncio.get_running_loop()
                    loop.add_signal_handler(signal.SIGTERM, self.begin_drain)
                self._load_task = asyncio.create_task(self.load())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _make_engine(self) -> Engine:
        if self._engine_factory is create_engine:
            self.state.checkpoint = str(checkpoint_dir(self.state.settings))
        return self._engine_factory(self.state.settings)

    async def load(self) -> None:
        """Create and load the engine (off the event loop), then start taking requests."""
        state, settings = self.state, self.state.settings
        start = time.monotonic()
        notify.status("loading the model")
        try:
            state.engine = await asyncio.to_thread(self._make_engine)
            log.info("loading %s", state.engine.description)
            scheduler = Scheduler(
                state.engine,
                max_batch=settings.max_batch,
                chunk_size=settings.chunk_size,
                queue_limit=settings.queue_limit,
                prefix_cache_bytes=int(settings.prefix_cache_gb * (1 << 30)),
            )
            state.scheduler = scheduler
            await scheduler.start()
            # fast mode: the engine thread and this one on the cores the CPU lane leaves
            state.thread_pins = pin_server_threads(state.engine)
        except Exception as exc:  # noqa: BLE001 - reported in /health and by the exit status
            state.status, state.load_error = ServerStatus.FAILED, f"{type(exc).__name__}: {exc}"
            expected = isinstance(exc, EngineUnavailable | ConfigurationError)
            log.error(
                "the model failed to load: %s", state.load_error, exc_info=None if expected else exc
            )
            notify.status(f"the model failed to load: {state.load_error}")
            if self._on_load_failed is not None:
                self._on_load_failed(exc)
            return
        state.load_seconds = round(time.monotonic() - start, 3)
        for pin in state.thread_pins.values():
            log.info("the %s thread (%d) runs on cpus %s, which the CPU lane leaves (--cpus "
                     "turns this off)", pin.role, pin.native_id, list(pin.cpus))  # fmt: skip
        if self._freeze_heap:
            state.frozen_objects = freeze_heap()
        if state.status != ServerStatus.LOADING:  # a SIGTERM came during the load: stay out
            log.info("loaded in %.1f s, but the server is %s", state.load_seconds, state.status)
            return
        state.status = ServerStatus.READY
        log.info(
            "ready in %.1f s: %s, context %d, %d slots; serving %r",
            state.load_seconds,
            state.engine.name,
            scheduler.context_length,
            scheduler.num_slots,
            settings.served_name,
        )
        # /health answers 200 from here on: tell systemd (Type=notify) the service is up.
        notify.ready(f"serving {settings.served_name} on {settings.host}:{settings.port}")

    def begin_drain(self) -> None:
        """Stop taking requests (/health and new requests answer 503), let the running and
        queued ones finish for up to --drain-timeout seconds, then call `on_drained`. A second
        SIGTERM while draining changes nothing."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self.drain())

    async def drain(self) -> float:
        """Drain as `begin_drain` says; the seconds it took."""
        state, timeout_s = self.state, self.state.settings.drain_timeout
        start = time.monotonic()
        if state.status in (ServerStatus.LOADING, ServerStatus.READY):
            state.status = ServerStatus.DRAINING
        notify.stopping()
        log.info(
            "draining: %d requests running or queued; waiting up to %.1f s (--drain-timeout)",
            self._num_open,
            timeout_s,
        )
        await self._wait_open(start + timeout_s)
        if self._num_open and state.scheduler is not None:
            log.warning(
                "drain timeout: %d requests still running after %.1f s end with an error",
                self._num_open,
                timeout_s,
            )
            # Ends every job with "the server is shutting down", which each open response
            # sends in band (a stream) or as a 500 before the process goes.
            await state.scheduler.close()
            await self._wait_open(time.monotonic() + _ANSWER_ERRORS_S)
        seconds = time.monotonic() - start
        linger = state.settings.drain_grace - seconds
        if linger > 0:
            # still 503 on /health and new requests: the router's next check takes it out
            log.info(
                "drained in %.2f s; answering 503 for %.2f s more (--drain-grace) before stopping",
                seconds,
                linger,
            )
            await asyncio.sleep(linger)
            seconds = time.monotonic() - start
            log.info("stopping %.2f s after the SIGTERM", seconds)
        else:
            log.info("drained in %.2f s; stopping", seconds)
        if self._on_drained is not None:
            self._on_drained()
        return seconds

    async def _wait_open(self, deadline: float) -> None:
        while self._num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.state.status = ServerStatus.STOPPING
        self.state.offload.close()
        notify.stopping()
        if self._load_task is not None and not self._load_task.done():
            await asyncio.wait([self._load_task])
        if self.state.scheduler is not None:
            await self.state.scheduler.close()

    # --- requests ---------------------------------------------------------------------------
    def _route(self, method: str, path: str, query: bytes):
        handler = ROUTES.get((method, path))
        if handler is not None:
            return handler
        with_query = QUERY_ROUTES.get((method, path))
        if with_query is not None:
            return lambda state, body, receive, send: with_query(state, query, send)
        if method == "GET" and path.startswith("/v1/models/"):
            name = path[len("/v1/models/") :]
            return lambda state, body, receive, send: info.model(state, name, send)
        if path in _PATHS:
            raise ApiError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        raise ApiError(404, f"no route for {method} {path}", code="not_found")

    async def _http(self, scope: dict, receive: Receive, send: Send) -> None:
        state, settings = self.state, self.state.settings
        method, path = scope["method"], scope["path"]
        route = (
            path
            if path in _PATHS
            else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        )
        tracked = _TrackedSend(send)
        status = 500
        is_post = method == "POST"
        self._num_open += is_post
        try:
            if (
                settings.api_key
                and path not in _OPEN_PATHS
                and not _bearer_ok(scope["headers"], settings.api_key)
            ):
                raise ApiError(
                    401,
                    "missing or wrong API key: send Authorization: Bearer <key>",
                    code="invalid_api_key",
                )
            handler = self._route(method, path, scope.get("query_string", b""))
            body = b""
            if method == "POST":
                declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
                declared_bytes = (
                    int(declared) if declared is not None and declared.isdigit() else None
                )
                body = await read_body(receive, settings.max_body_bytes, declared_bytes)
            status = await handler(state, body, receive, tracked)
        except ApiError as exc:
            status = exc.status
            await self._fail(tracked, exc)
        except ClientGone:
            status = 499
        except Exception as exc:  # noqa: BLE001 - one request fails, the server keeps serving
            log.exception("%s %s failed", method, path)
            await self._fail(tracked, ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self._num_open -= is_post
            state.metrics.count_request(route, status)

    async def _fail(self, tracked: _TrackedSend, error: ApiError) -> None:
        if not tracked.started:
            await send_error(tracked, error)
        elif tracked.is_sse and not tracked.ended:
            # The 200 is already out: report in band, which the openai client raises as APIError.
            await tracked(
                {
                    "type": "http.response.body",
                    "body": b"data: " + error.body() + b"\n\ndata: [DONE]\n\n",
                }
            )
