"""Anthropic's error shape for the Messages routes.

Everything else in the server answers errors OpenAI's way (``{"error": {"message", "type", …}}``);
Anthropic's SDKs expect ``{"type": "error", "error": {"type", "message"}}`` with their own type
names. Errors come from many places (validation, the handlers, the API key, body limit, client
quota, host guard), so one middleware rewrites any JSON error body on the Messages paths instead
of teaching each of them a second shape.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PREFIX = "/v1/messages"

# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
          415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
          503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _message_of(body: bytes) -> str | None:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        param = error.get("param")
        message = error["message"]
        # Anthropic's messages name the field; ours carry it apart, so put it in when it is missing.
        return f"{param}: {message}" if isinstance(param, str) and param and param not in message else message
    return None


class AnthropicErrorMiddleware:
    """Rewrites JSON error responses (status >= 400) under /v1/messages into Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PREFIX):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=message["headers"])
                if message["status"] >= 400 and headers.get("content-type", "").startswith("application/json"):
                    start = message  # held until the whole (small) error body is here
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            text = _message_of(body)
            if text is not None:
                body = json.dumps(anthropic_error_body(start["status"], text), ensure_ascii=False).encode()
            headers = MutableHeaders(raw=list(start["headers"]))
            headers["content-length"] = str(len(body))
            await send({**start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)
