"""Refuse request bodies over ``max_body_bytes`` (413) or slower than ``body_read_timeout_s`` (408)
before any handler parses them."""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cllm.server.errors import APIError

_NO_BODY_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


class BodyLimitMiddleware:
    """Buffers the body up to the limit, then replays it to the app.

    Checking Content-Length alone would let chunked uploads through; buffering
    here (bodies are at most ``max_bytes``) covers both and keeps the
    downstream ``receive`` intact for disconnect detection.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s  # the whole body must arrive within this (a slow drip holds a socket)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _NO_BODY_METHODS:
            await self.app(scope, receive, send)
            return
        error = self._check_declared_length(scope)
        body: bytes | None = None
        if error is None:
            try:
                body, disconnected = await asyncio.wait_for(self._read_body(receive), self.timeout_s)
            except asyncio.TimeoutError:
                body, disconnected = None, False
                error = APIError(408, f"request body not received within {self.timeout_s:g} s", code="body_timeout",
                                 headers={"Connection": "close"})
            if disconnected:
                return  # the client left mid-upload; there is nobody to answer
            if error is None and body is None:
                error = self._too_large()
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body or b"", receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes", code="request_too_large")

    def _check_declared_length(self, scope: Scope) -> APIError | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return APIError(400, "invalid Content-Length header")
                return self._too_large() if declared > self.max_bytes else None
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, bool]:
        """(body, client_disconnected); body None when it ran over the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None, False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


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
