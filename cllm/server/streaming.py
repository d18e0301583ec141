"""Server-sent events: framing, and a response that always closes its generator."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
# An SSE comment: clients ignore it, proxies see bytes flowing (sent while a stream waits).
KEEPALIVE = b": keep-alive\n\n"


def sse_model(model: BaseModel) -> bytes:
    """One ``data:`` event holding a chunk. Null fields are sent as null (``finish_reason`` and
    ``logprobs`` in every chunk, as OpenAI's); the models leave out only the fields the spec makes
    optional (protocol.py ``_optional``)."""
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def sse_json(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding a plain JSON object (used for error events)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose body generator is closed however the response ends.

    Starlette cancels the body when the client disconnects; when that happens
    while the generator is suspended at a ``yield`` (not inside an await) the
    generator is merely abandoned, and its ``finally`` — the one that aborts the
    engine request — would wait for garbage collection. Closing it here, shielded
    from the cancellation in progress, frees the slot at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        merged = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, headers=merged)
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._generator.aclose()
