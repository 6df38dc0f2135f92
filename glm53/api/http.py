"""ASGI plumbing: reading a bounded body, sending JSON and SSE, and noticing a client that left.

granian never raises from `send` to a client that is gone; the only sign is `receive()`
returning `http.disconnect`, so every generating request runs a `DisconnectWatcher`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from glm53.api.errors import ApiError
from glm53.errors import Glm53Error

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

JSON_HEADERS = ((b"content-type", b"application/json"),)
SSE_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class ClientGone(Glm53Error):
    """The client disconnected before its request was fully read."""


async def read_body(receive: Receive, limit_bytes: int, declared: int | None) -> bytes:
    if declared is not None and declared > limit_bytes:
        raise ApiError(
            413, f"the body has {declared} bytes; the limit is {limit_bytes} (--max-body-bytes)"
        )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit_bytes:
            raise ApiError(
                413, f"the body exceeds the limit of {limit_bytes} bytes (--max-body-bytes)"
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def send_bytes(send: Send, status: int, body: bytes, headers=JSON_HEADERS) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    await send_bytes(send, error.status, error.body(), JSON_HEADERS + error.headers)


class DisconnectWatcher:
    """Waits on `receive()` in a task; `gone` is set when the client disconnects, and `on_gone`
    (which may be set later) runs then. After the response is complete granian also reports a
    disconnect, so stop the watcher (`close`) before finishing the response."""

    def __init__(self, receive: Receive, on_gone: Callable[[], None] | None = None):
        self.gone = asyncio.Event()
        self.on_gone = on_gone
        self._task = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                if self.on_gone is not None:
                    self.on_gone()
                return

    def close(self) -> None:
        self._task.cancel()

    def __enter__(self) -> DisconnectWatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SseWriter:
    """A text/event-stream response: `data: <json>` events, keep-alive comments while idle."""

    def __init__(self, send: Send, keepalive_s: float = 15.0):
        self._send = send
        self._keepalive_s = keepalive_s
        self._last_send = time.monotonic()
        self._keepalive: asyncio.Task | None = None

    async def start(self) -> None:
        await self._send(
            {"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)}
        )
        self._keepalive = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        # Comments keep proxies from closing the connection during a long prefill; clients skip them.
        while True:
            await asyncio.sleep(self._keepalive_s)
            if time.monotonic() - self._last_send >= self._keepalive_s:
                await self._send(
                    {"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True}
                )

    async def event(self, data: bytes) -> None:
        self._last_send = time.monotonic()
        await self._send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )

    def stop(self) -> None:
        """Stop the keep-alive comments (the response is over, however it ended)."""
        if self._keepalive is not None:
            self._keepalive.cancel()

    async def close(self, final: bytes = b"data: [DONE]\n\n") -> None:
        self.stop()
        await self._send({"type": "http.response.body", "body": final, "more_body": False})
