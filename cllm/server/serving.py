"""What completions and chat share: running a GenerationStream into a JSON or SSE response."""
from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from cllm.outputs import RequestOutput
from cllm.server.access_log import CLIENT_CLOSED
from cllm.server.disconnect import ClientDisconnected, unless_disconnected
from cllm.server.errors import APIError, finish_error
from cllm.server.generation import GenerationStream, StreamEnd, request_status
from cllm.server.protocol import PromptTokensDetails, UsageInfo
from cllm.server.streaming import DONE, KEEPALIVE, EventStreamResponse, LastChunk, sse_json

log = logging.getLogger("cllm.server")


@dataclass(slots=True, frozen=True)
class ResponseMeta:
    """Fields every response and chunk of one request repeats."""

    id: str  # cmpl-… / chatcmpl-…
    created: int  # unix seconds
    model: str  # served model name
    system_fingerprint: str | None = None  # the server's build and settings (fingerprint.py), on OpenAI's bodies


class StreamFormatter(Protocol):
    """Turns engine outputs into one endpoint's SSE chunks."""

    def prelude(self) -> Iterable[bytes]:
        """Chunks sent before any token (chat's role chunks)."""

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        """Chunks for the news in ``out`` (normal finish reasons included, abnormal ones not)."""

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        """The final ``choices: []`` chunk carrying usage."""


@dataclass(slots=True, frozen=True)
class SSEFraming:
    """How a protocol frames the end of an SSE stream: OpenAI's chat and completions end with
    ``data: [DONE]`` and send errors as ``data: {"error": …}``; Responses and Messages name their
    events and send no ``[DONE]``."""

    error: Callable[[APIError], bytes]  # the event that replaces the rest of a failed stream
    done: bytes = DONE  # sent last, after the usage chunk (b"" for none)


def _openai_error(error: APIError) -> bytes:
    return sse_json(error.body())


OPENAI_FRAMING = SSEFraming(error=_openai_error)


def total_usage(finals: Sequence[RequestOutput]) -> UsageInfo:
    """Usage summed over the prompts of a request."""
    prompt = sum(f.usage.prompt_tokens for f in finals)
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in finals)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def output_error(out: RequestOutput) -> APIError | None:
    """The error a finished engine request ends the HTTP request with (timeout, abort, failure)."""
    return finish_error(request_status(out), out.error) if out.finished else None


async def sse_events(
    stream: GenerationStream, formatter: StreamFormatter, *, include_usage: bool, keepalive_s: float,
    framing: SSEFraming = OPENAI_FRAMING,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: chunks, optional usage chunk, ``[DONE]``; an error event replaces the rest on failure.

    Whenever ``keepalive_s`` passes without news (queued, long prefill) an SSE comment goes out, so
    proxies with a read timeout do not cut a stream that is merely waiting (issue 9 defect 15).

    The events of one output go out in one piece, and the last output's with the usage chunk and
    ``[DONE]``: each piece is a socket write, which was the largest single cost of the API process's
    event loop at 256 streams (py-spy, benchmarks/engine_overhead.py).
    """
    tail = b""  # the last outputs' events, held for the end once every prompt has its final output
    try:
        try:
            prelude = b"".join(formatter.prelude())
            if prelude:
                yield prelude
            failed = False
            while not isinstance(item := await stream.next_output(keepalive_s), StreamEnd):
                if item is None:
                    yield KEEPALIVE
                    continue
                index, out = item
                events = b"".join(formatter.chunks(index, out))
                error = output_error(out)
                if error is not None:
                    tail += events + framing.error(error)
                    failed = True
                    break
                if all(f is not None for f in stream.finals):
                    tail += events  # only the stream's end follows now
                elif events:
                    yield events
            if include_usage and not failed:
                tail += formatter.usage_chunk(total_usage([f for f in stream.finals if f is not None]))
        except APIError as exc:
            tail += framing.error(exc)
        except Exception as exc:  # a bug: the headers are out, so tell the client in-band and end cleanly
            log.error("stream failed", exc_info=exc)
            tail += framing.error(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
        if tail or framing.done:
            yield LastChunk(tail + framing.done)
    finally:
        await stream.close()


def _first_error(finals: Sequence[RequestOutput]) -> APIError | None:
    for final in finals:
        error = output_error(final)
        if error is not None:
            return error
    return None


async def respond(
    request: Request,
    stream: GenerationStream,
    *,
    meta: ResponseMeta,
    wants_stream: bool,
    formatter: Callable[[], StreamFormatter],
    build: Callable[[list[RequestOutput]], BaseModel],
    include_usage: bool,
    keepalive_s: float,
    framing: SSEFraming | None = None,
) -> Response:
    """Admit the request, then stream it or collect it into one body; the client leaving aborts it.

    A stream's headers go out once the engine has queued it, not at its first token."""
    handed_over = False
    try:
        await unless_disconnected(request, stream.start())
        if wants_stream:
            body = sse_events(stream, formatter(), include_usage=include_usage, keepalive_s=keepalive_s,
                              framing=framing or OPENAI_FRAMING)
            handed_over = True  # the response's body generator closes the stream now
            return EventStreamResponse(body, headers={"X-Request-Id": meta.id})
        finals = await unless_disconnected(request, stream.collect())
        error = _first_error(finals)
        if error is not None:
            raise error
        body_json = build(finals).model_dump_json()
        return Response(body_json, media_type="application/json", headers={"X-Request-Id": meta.id})
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)  # nobody will read it; it marks the access log
    finally:
        if not handed_over:
            await stream.close()
