"""The streamed response's cheap paths (issue 41, the API process at 256 streams): SSE events spliced
from a template are byte for byte the pydantic chunk's dump; the ITL histogram observed n tokens at a
time exposes what n observes did; an output's events go out in one write and the last with the usage
and [DONE]; the response notices a client leaving without Starlette's task group, and only while it sends."""
from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from cllm.server.chat import ChatFormatter
from cllm.server.completions import CompletionFormatter
from cllm.server.disconnect import ClientDisconnected, unless_disconnected
from cllm.server.generation import STREAM_END
from cllm.server.metrics import _ITL_BUCKETS, TokenGapHistogram
from cllm.server.protocol import ChatCompletionChunk, ChatStreamChoice, CompletionChoice, CompletionResponse, DeltaMessage
from cllm.server.serving import ResponseMeta, sse_events
from cllm.server.streaming import DONE, EventStreamResponse, LastChunk, TextEventTemplate, sse_model

import pytest

_NAMES = st.text(min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=40), model=_NAMES, fingerprint=st.none() | _NAMES, index=st.integers(0, 7))
def test_a_text_event_spliced_from_its_template_is_the_chunks_own_dump(text: str, model: str, fingerprint: str | None,
                                                                         index: int) -> None:
    def completion(t: str) -> CompletionResponse:
        return CompletionResponse(id="cmpl-1", created=7, model=model, system_fingerprint=fingerprint,
                                  choices=[CompletionChoice(index=index, text=t)])

    def chat(t: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model=model, system_fingerprint=fingerprint,
                                   choices=[ChatStreamChoice(index=index, delta=DeltaMessage(content=t))])

    for make in (completion, chat):
        assert TextEventTemplate(make).render(text) == sse_model(make(text))


def test_a_template_whose_marker_is_not_in_one_place_is_refused() -> None:
    def twice(t: str) -> CompletionResponse:
        return CompletionResponse(id="cmpl-1", created=7, model=t, choices=[CompletionChoice(index=0, text=t)])

    with pytest.raises(ValueError, match="exactly once"):
        TextEventTemplate(twice)


def test_the_token_gap_histogram_exposes_what_one_observe_per_token_did() -> None:
    rng = random.Random(0)
    plain_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("cllm_inter_token_latency_seconds", "Gap between streamed tokens", ["model"],
                      buckets=_ITL_BUCKETS, registry=plain_registry)
    ours = TokenGapHistogram("cllm_inter_token_latency_seconds", "Gap between streamed tokens", _ITL_BUCKETS)
    ours_registry.register(ours)
    values = [*_ITL_BUCKETS, 0.0, 7.0] + [rng.random() / 5 for _ in range(200)]  # bounds fall in their own bucket
    for value in values:
        n = rng.randint(1, 5)
        for model in ("a", "b"):
            for _ in range(n):
                plain.labels(model=model).observe(value)
            ours.labels(model).observe(value, n)

    def samples(registry: CollectorRegistry) -> dict[tuple, float]:
        text = generate_latest(registry).decode()
        (family,) = [f for f in text_string_to_metric_families(text) if f.name == "cllm_inter_token_latency_seconds"]
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples if not s.name.endswith("_created")}

    expected, got = samples(plain_registry), samples(ours_registry)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        if key[0].endswith("_sum"):  # the same additions, grouped differently
            assert math.isclose(got[key], value, rel_tol=1e-12)
        else:
            assert got[key] == value, key


# ------------------------------------------------------------------------------- one write per output
class _Outputs:
    """A GenerationStream's consumer side over a fixed list of outputs (one prompt)."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = list(outputs)
        self.finals: list[RequestOutput | None] = [None]
        self.closed = False

    async def next_output(self, timeout: float | None = None) -> Any:
        if not self._outputs:
            return STREAM_END
        out = self._outputs.pop(0)
        if out.finished:
            self.finals[0] = out
        return 0, out

    async def close(self) -> None:
        self.closed = True


def _output(text: str, reason: str | None, tokens: int) -> RequestOutput:
    choice = CompletionOutput(0, text, list(range(tokens)), reason, None, None, text, list(range(tokens)), None)
    return RequestOutput("r", "p", [1], [choice], reason is not None, Usage(1, tokens, 0), RequestMetrics(0.0))


@pytest.mark.parametrize("make_formatter", [
    lambda meta: CompletionFormatter(meta, n=1, logprobs=False, include_usage=True),
    lambda meta: ChatFormatter(meta, n=1, logprobs=False, include_usage=True),
])
def test_each_output_is_one_write_and_the_last_comes_with_the_usage_and_done(make_formatter) -> None:
    meta = ResponseMeta(id="cmpl-1", created=7, model="m")
    stream = _Outputs([_output("a", None, 1), _output("bc", None, 2), _output("d", "length", 1)])

    async def body() -> list[bytes]:
        return [piece async for piece in sse_events(stream, make_formatter(meta), include_usage=True, keepalive_s=60)]

    pieces = asyncio.run(body())
    prelude = 1 if isinstance(make_formatter(meta), ChatFormatter) else 0  # chat's role chunk
    assert len(pieces) == prelude + 3 and all(pieces) and stream.closed
    for piece in pieces[prelude:prelude + 2]:
        assert piece.count(b"data: ") == 1
    last = pieces[-1]
    assert isinstance(last, LastChunk)  # sent with the response's end (below)
    assert last.count(b"data: ") == 4 and last.endswith(DONE)  # the text, the finish, the usage, [DONE]
    assert b'"finish_reason":"length"' in last and b'"completion_tokens":1' in last


# ---------------------------------------------------------------------------- the client leaving
class _Client:
    """The ASGI side of one connection: what was sent, and a disconnect to deliver when told."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)


async def _body(log: list[str], forever: asyncio.Event):
    try:
        yield b"data: 1\n\n"
        log.append("waiting")
        await forever.wait()
        yield b"data: never\n\n"
    finally:
        log.append("closed")


def test_a_client_leaving_mid_stream_closes_the_body_and_the_response_ends_normally() -> None:
    async def run() -> tuple[_Client, list[str]]:
        client, log = _Client(), []
        response = EventStreamResponse(_body(log, asyncio.Event()))
        task = asyncio.ensure_future(response({"type": "http", "asgi": {"spec_version": "2.3"}}, client.receive, client.send))
        while "waiting" not in log:
            await asyncio.sleep(0)
        client.gone.set()
        await asyncio.wait_for(task, 5)  # returns: no CancelledError escapes
        assert not task.cancelled() and task.exception() is None
        return client, log

    client, log = asyncio.run(run())
    assert log == ["waiting", "closed"]
    assert [m["type"] for m in client.sent] == ["http.response.start", "http.response.body"]


def test_a_disconnect_after_the_response_ended_cancels_nothing() -> None:
    async def run() -> None:
        client = _Client()

        async def short():
            yield b"data: 1\n\n"

        await EventStreamResponse(short())({"type": "http"}, client.receive, client.send)
        client.gone.set()  # the listener is gone with the response: nothing cancels the caller now
        await asyncio.sleep(0.01)
        assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}

    asyncio.run(run())


def test_the_last_chunk_goes_with_the_responses_end_in_one_message_and_the_body_is_closed() -> None:
    async def run() -> tuple[_Client, list[str]]:
        client, log = _Client(), []

        async def body():
            try:
                yield b"data: 1\n\n"
                yield LastChunk(b"data: 2\n\ndata: [DONE]\n\n")
                log.append("after the last")  # never: the response stops at the last chunk
            finally:
                log.append("closed")

        await EventStreamResponse(body())({"type": "http"}, client.receive, client.send)
        return client, log

    client, log = asyncio.run(run())
    assert log == ["closed"]
    assert client.sent[1:] == [{"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True},
                               {"type": "http.response.body", "body": b"data: 2\n\ndata: [DONE]\n\n", "more_body": False}]


def test_a_cancellation_from_elsewhere_is_not_swallowed_and_the_body_is_closed() -> None:
    async def run() -> list[str]:
        client, log = _Client(), []
        response = EventStreamResponse(_body(log, asyncio.Event()))
        task = asyncio.ensure_future(response({"type": "http"}, client.receive, client.send))
        while "waiting" not in log:
            await asyncio.sleep(0)
        task.cancel()  # a shutdown, not the client
        with pytest.raises(asyncio.CancelledError):
            await task
        return log

    assert asyncio.run(run()) == ["waiting", "closed"]


def test_work_awaited_unless_disconnected_is_cancelled_when_the_client_leaves_and_not_after() -> None:
    class _Request:
        def __init__(self, client: _Client) -> None:
            self.receive = client.receive

    async def run() -> None:
        client, stopped = _Client(), []

        async def work() -> str:
            try:
                await asyncio.Event().wait()
            finally:
                stopped.append("work")
            return "never"

        task = asyncio.ensure_future(unless_disconnected(_Request(client), work()))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        client.gone.set()
        with pytest.raises(ClientDisconnected):
            await task
        assert stopped == ["work"]

        later = _Client()

        async def quick() -> str:
            return "done"

        assert await unless_disconnected(_Request(later), quick()) == "done"  # type: ignore[arg-type]
        later.gone.set()  # after the work: nothing is cancelled
        await asyncio.sleep(0.01)

    asyncio.run(run())
