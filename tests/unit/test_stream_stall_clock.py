"""The stall clock of a request's engine streams (issue 46 item 2): only a reader that leaves output
untaken for stream_stall_timeout_s is stalled, never one that waited that long for the output."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

import cllm
from cllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from cllm.server import generation
from cllm.server.client_quota import AdmissionPolicy, ClientLease, ClientQuota
from cllm.server.errors import APIError
from cllm.server.generation import GenerationStream
from cllm.server.metrics import ServerMetrics
from tests.unit.fakes import fake_config
from tests.unit.live_server import SlowFakeBackend, live_server

STALL_S = 5.0


class _Clock:
    """generation's time.monotonic, moved by the test: the stall clock without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _LateEngine:
    """An engine whose requests are queued at once and give their one (final) output when released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def generate(self, prompt: list[int], params: cllm.SamplingParams, *, request_id: str, priority: int,
                       on_queued: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        on_queued()
        await self.release.wait()
        yield RequestOutput(request_id, None, list(prompt),
                            [CompletionOutput(0, "ok", [7], "stop", text_delta="ok", token_ids_delta=[7])],
                            True, Usage(len(prompt), 1, 0), RequestMetrics(arrival_time=0.0))


@pytest.fixture()
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(generation, "time", fake)
    return fake


def _stream(engine: object, prompts: int, lease: ClientLease | None = None) -> GenerationStream:
    return GenerationStream(engine, [[1, 2]] * prompts, cllm.SamplingParams(max_tokens=1), request_id="r", priority=0,
                            metrics=ServerMetrics(list).for_model("m"), record=None, prompt_param="prompt",
                            stall_timeout_s=STALL_S, lease=lease)


@pytest.mark.parametrize("prompts", [2, 4])
def test_a_collector_whose_outputs_come_after_the_stall_timeout_gets_them(clock, prompts):
    """Several prompts (a list of prompts, or n > 1 on the server), non-streamed: the collector waits
    longer than stream_stall_timeout_s for the first outputs, which then come in the same moment.
    The second one found the first still queued (its reader had not run yet) and the stall clock,
    counted from the last take, read a stall: 408 stream_stalled and the finished work dropped."""
    async def main() -> list[RequestOutput]:
        engine = _LateEngine()
        stream = _stream(engine, prompts)
        try:
            await stream.start()  # every prompt queued: the collector begins to wait
            collected = asyncio.ensure_future(stream.collect())
            await asyncio.sleep(0)  # (one turn: the collector is now waiting in the queue)
            clock.now += 10 * STALL_S  # a long queue or prefill
            engine.release.set()
            return await collected
        finally:
            await stream.close()

    finals = asyncio.run(main())
    assert [f.outputs[0].text for f in finals] == ["ok"] * prompts


def test_output_left_untaken_past_the_timeout_is_still_a_stall(clock):
    """The other side: output queued and not taken for longer than the timeout, and more output
    coming, is a stall (408 for the reader), and the aborted request's sequences no longer count
    against its client's share (issue 46 item 3), though its response may stay blocked in a send."""
    quota = ClientQuota(AdmissionPolicy(max_sequences_per_request=8, max_sequences_per_client=8,
                                        allow_client_priority=False))

    async def main() -> BaseException | None:
        engine = _SteppedEngine()
        stream = _stream(engine, 1, quota._acquire("client", 1))
        try:
            await stream.start()
            await engine.emit()  # queued; the reader takes nothing
            clock.now += 2 * STALL_S
            assert quota.in_flight("client") == 1
            await engine.emit()  # the pump finds the first output waiting for longer than the timeout
            assert quota.in_flight("client") == 0
            try:
                while isinstance(await stream.next_output(), tuple):
                    pass
            except APIError as exc:
                return exc
            return None
        finally:
            await stream.close()

    error = asyncio.run(main())
    assert isinstance(error, APIError) and error.status == 408, error


class _SteppedEngine:
    """An engine whose request gives one unfinished output each time the test calls ``emit``."""

    def __init__(self) -> None:
        self._go: asyncio.Queue[None] = asyncio.Queue()
        self._done: asyncio.Queue[None] = asyncio.Queue()

    async def emit(self) -> None:
        self._go.put_nowait(None)
        await self._done.get()

    async def generate(self, prompt: list[int], params: cllm.SamplingParams, *, request_id: str, priority: int,
                       on_queued: Callable[[], None]) -> AsyncIterator[RequestOutput]:
        on_queued()
        try:
            while True:
                await self._go.get()
                yield RequestOutput(request_id, None, list(prompt),
                                    [CompletionOutput(0, "", [], None, text_delta="x", token_ids_delta=[7])],
                                    False, Usage(len(prompt), 1, 0), RequestMetrics(arrival_time=0.0))
                self._done.put_nowait(None)
        finally:
            self._done.put_nowait(None)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}),
], ids=["prompt-list", "chat-n2"])
def test_a_non_streamed_request_slower_than_the_stall_timeout_is_answered(path, body):
    """The same through the real server: every step of the model takes longer than the stall timeout
    (a busy server's queue or a long prefill), and the non-streamed answer is still a 200."""
    config = fake_config(stream_stall_timeout_s=0.5)
    with live_server(config, SlowFakeBackend(slots=4, step_s=1.0)) as url:
        response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2
