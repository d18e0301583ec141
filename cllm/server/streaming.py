"""Server-sent events: framing, and a response that always closes its generator."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cllm.server.disconnect import ClientDisconnected, cancelled_if_client_leaves

DONE = b"data: [DONE]\n\n"
# An SSE comment: clients ignore it, proxies see bytes flowing (sent while a stream waits).
KEEPALIVE = b": keep-alive\n\n"


def sse_model(model: BaseModel) -> bytes:
    """One ``data:`` event holding a chunk. Null fields are sent as null (``finish_reason`` and
    ``logprobs`` in every chunk, as OpenAI's); the models leave out only the fields the spec makes
    optional (protocol.py ``_optional``)."""
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


class TextEventTemplate:
    """The bytes of one kind of ``data:`` event whose only varying part is one string: the event
    dumped once with a marker in its place, then the JSON-encoded string spliced in per event.

    Building and dumping the pydantic chunk per event was ~5 % of the API process's event loop at
    256 streams (py-spy, benchmarks/engine_overhead.py). The string is encoded by pydantic-core
    itself (``to_json``), so an event is byte for byte what ``sse_model`` makes of the same chunk.
    """

    _MARKER = "\x00cllm-text\x00"

    def __init__(self, make: Callable[[str], BaseModel]) -> None:
        """``make(text)``: the chunk with ``text`` as its string."""
        dumped = sse_model(make(self._MARKER))
        encoded = to_json(self._MARKER)
        if dumped.count(encoded) != 1:
            raise ValueError("the template's marker must occur exactly once in the event")
        self._head, _, self._tail = dumped.partition(encoded)

    def render(self, text: str) -> bytes:
        return self._head + to_json(text) + self._tail


class TextEvents:
    """A TextEventTemplate per choice index, made on the choice's first text event."""

    def __init__(self, make: Callable[[int, str], BaseModel]) -> None:
        """``make(index, text)``: the chunk with choice ``index``'s ``text``."""
        self._make = make
        self._templates: dict[int, TextEventTemplate] = {}

    def render(self, index: int, text: str) -> bytes:
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = TextEventTemplate(lambda t: self._make(index, t))
        return template.render(text)


def sse_json(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding a plain JSON object (used for error events)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


class LastChunk(bytes):
    """A stream's last bytes: EventStreamResponse sends them with the response's end (the chunked body's
    terminator) in one socket write, where Starlette sends an empty end after them (a write of its own;
    at 256 streams the socket writes were a quarter of the event loop's time)."""


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that stops when its client leaves, and always closes its generator.

    Starlette's StreamingResponse watches for the client leaving (uvicorn's httptools protocol speaks
    ASGI 2.3, whose ``send`` to a closed socket returns quietly) with an anyio task group; here it is
    disconnect.py's one listener task (see there).

    A body generator suspended at a ``yield`` when the client leaves would merely be abandoned, and
    its ``finally`` — the one that aborts the engine request — would wait for garbage collection;
    it is closed here, shielded from the cancellation in progress, so the slot is freed at once.

    The body is streamed by a task of its own, which the request's task awaits once. In the request's
    task the stream sat ~27 coroutine frames deep (uvicorn, FastAPI's and our middlewares, the routers),
    and every token's wake-up resumed, and every wait suspended, all of them; in its own task it is
    the few frames of the stream. Cancelling the request's task (shutdown) cancels it and waits for it.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        merged = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(content, headers=merged)
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.ensure_future(self._stream(receive, send))

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            last = isinstance(chunk, LastChunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return  # (the generator is closed by _stream)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, receive: Receive, send: Send) -> None:
        try:
            async with cancelled_if_client_leaves(receive):
                await self.stream_response(send)
        except ClientDisconnected:
            pass  # the response ends normally, as Starlette's does
        finally:
            with anyio.CancelScope(shield=True):
                await self._generator.aclose()
