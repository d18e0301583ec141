"""One access-log line per HTTP request, written when the response is complete.

The middleware puts an ``AccessRecord`` in the ASGI scope; generation
endpoints fill in the request id, token counts and TTFT, so a streamed
response is logged once, after its last byte, with its real totals.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("cllm.server.access")

SCOPE_KEY = "cllm.access"
# Status logged when the client went away before any response was sent (nginx's convention).
CLIENT_CLOSED = 499
# Polled endpoints: logged at DEBUG so scrapers do not drown the log.
_QUIET_PATHS = frozenset({"/health", "/metrics"})


@dataclass(slots=True)
class AccessRecord:
    """What one request did; generation endpoints fill the optional fields."""

    method: str  # HTTP method
    path: str  # URL path
    client: str  # peer address
    start: float = field(default_factory=time.monotonic)  # when the request arrived
    status: int | None = None  # HTTP status sent; None = nothing sent (client gone)
    request_id: str | None = None  # cmpl-… / chatcmpl-…
    prompt_tokens: int | None = None  # summed over prompts
    completion_tokens: int | None = None  # summed over choices
    ttft_s: float | None = None  # arrival to first token, server side
    finish: str | None = None  # final status of the generation

    def line(self) -> str:
        total = time.monotonic() - self.start
        parts = [f'{self.client} "{self.method} {self.path}" {self.status or CLIENT_CLOSED}']
        if self.request_id:
            parts.append(f"id={self.request_id}")
        if self.prompt_tokens is not None:
            parts.append(f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens or 0}")
        if self.ttft_s is not None:
            parts.append(f"ttft={self.ttft_s * 1000:.1f}ms")
        if self.finish:
            parts.append(f"finish={self.finish}")
        parts.append(f"total={total * 1000:.1f}ms")
        return " ".join(parts)


def access_record(request: Request) -> AccessRecord | None:
    """The record of the current request (None when the middleware is not installed)."""
    record = request.scope.get(SCOPE_KEY)
    return record if isinstance(record, AccessRecord) else None


class AccessLogMiddleware:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, on_done: Callable[[AccessRecord], None] | None = None) -> None:
        self.app = app
        self.on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("-", 0)
        record = AccessRecord(method=scope["method"], path=scope["path"], client=f"{client[0]}:{client[1]}")
        scope[SCOPE_KEY] = record

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except BaseException:
            # The outermost error handler turns it into a 500 after we return: count it as one,
            # not as a client that went away.
            if record.status is None:
                record.status = 500
            raise
        finally:
            level = logging.DEBUG if record.path in _QUIET_PATHS else logging.INFO
            if log.isEnabledFor(level):  # (the line is made only to be written)
                log.log(level, "%s", record.line())
            if self.on_done is not None:
                self.on_done(record)
