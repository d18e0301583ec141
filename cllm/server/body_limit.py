"""Refuse request bodies over ``max_body_bytes`` (413), slower than ``body_read_timeout_s`` (408), or
beyond what all requests together may hold (``max_body_bytes_in_flight``: 503) before any handler parses them."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cllm.server.errors import APIError

TEXT_BODY_BYTES = 1 << 20  # server.max_body_bytes: auto, while no loaded model takes images
IMAGE_BODY_BYTES = 32 << 20  # ... and while one does (a phone photo inline as base64 is several MiB)
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
T = TypeVar("T")


class BodyLimitMiddleware:
    """Buffers the body up to the limit, then replays it to the app.

    Checking Content-Length alone would let chunked uploads through; buffering
    here (bodies are at most ``max_bytes``) covers both and keeps the
    downstream ``receive`` intact for disconnect detection.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int], in_flight_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.limit = limit  # one body's largest size, asked per request (auto: it grows while a model takes images)
        self.in_flight_bytes = in_flight_bytes  # all bodies held at once: being received, or by requests being served
        self.held = 0  # bytes of the bodies held now
        self.timeout_s = timeout_s  # the whole body must arrive within this (a slow drip holds a socket)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _NO_BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        held = [0]  # what this request has added to self.held, given back in finally
        try:
            error = self._check_declared_length(scope, limit)
            body: bytes | None = None
            if error is None:
                try:
                    body, error = await _within(self._read_body(receive, limit, held), self.timeout_s)
                except asyncio.TimeoutError:
                    error = APIError(408, f"request body not received within {self.timeout_s:g} s", code="body_timeout",
                                     headers={"Connection": "close"})
                if error is None and body is None:
                    return  # the client left mid-upload; there is nobody to answer
            if error is not None:
                await error.response()(scope, receive, send)
                return
            await self.app(scope, _replay(body or b"", receive), send)
        finally:
            self.held -= held[0]

    def _check_declared_length(self, scope: Scope, limit: int) -> APIError | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return APIError(400, "invalid Content-Length header")
                return _too_large(limit) if declared > limit else None
        return None

    async def _read_body(self, receive: Receive, limit: int, held: list[int]) -> tuple[bytes | None, APIError | None]:
        """(body, None), or (None, the error) when it ran over a limit, or (None, None) when the client left.
        Each chunk is counted in ``self.held`` (and ``held[0]``) as it arrives."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            if held[0] + len(chunk) > limit:
                return None, _too_large(limit)
            if self.held + len(chunk) > self.in_flight_bytes:
                return None, APIError(503, f"the server holds {self.held} bytes of request bodies, its limit "
                                      f"(max_body_bytes_in_flight) is {self.in_flight_bytes}: retry shortly",
                                      code="server_busy", headers={"Retry-After": "1"})
            self.held += len(chunk)
            held[0] += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


async def _within(work: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
    """``await work``, cancelled after ``timeout_s`` (TimeoutError). In the caller's task: Python 3.11's
    ``wait_for`` ran it as a task of its own, which started an event-loop iteration later, on every
    request's critical path (an iteration was ~5-10 ms at 256 streams)."""
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(work, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await work


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the server's limit of {limit} bytes (max_body_bytes)", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands out the buffered body once, then defers to the real one."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
