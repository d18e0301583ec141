"""A stream whose reader stops (issue 27 item 2): its unread outputs merge into one pending output per
prompt, and after stream_stall_timeout_s its requests are aborted with a 408 for the reader."""
from __future__ import annotations

import asyncio

import pytest

import cllm
from cllm.server.errors import APIError
from cllm.server.generation import GenerationStream
from cllm.server.metrics import ServerMetrics
from tests.unit.fakes import FakeBackend, fake_config


def _stream(engine: cllm.AsyncLLM, prompts: list[list[int]], stall_s: float) -> GenerationStream:
    params = cllm.SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)
    return GenerationStream(engine, prompts, params, request_id="r", priority=0, metrics=ServerMetrics(list).for_model("m"),
                            record=None, prompt_param="prompt", stall_timeout_s=stall_s)


def test_unread_outputs_merge_into_one_per_prompt() -> None:
    async def main() -> tuple[int, int, dict[int, list[int]], dict[int, str]]:
        backend = FakeBackend(slots=2, forward_sleep_s=0.0005)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        stream = _stream(engine, [[1], [2]], stall_s=60.0)
        try:
            await stream.start()
            await asyncio.sleep(0.5)  # the reader takes nothing: hundreds of steps' outputs arrive
            pending = len(stream._queue)
            tokens: dict[int, list[int]] = {0: [], 1: []}
            texts: dict[int, str] = {0: "", 1: ""}
            taken = 0
            while len(stream._queue) or stream._pending:
                index, out = await stream.next_output()  # type: ignore[misc]
                tokens[index] += out.outputs[0].token_ids_delta
                texts[index] += out.outputs[0].text_delta
                taken += 1
            return pending, taken, tokens, texts
        finally:
            await stream.close()
            await engine.shutdown()

    pending, taken, tokens, texts = asyncio.run(main())
    assert pending <= 2 and taken <= 3  # one merged output per prompt (and the first, taken at start)
    tok = FakeBackend().tokenizer
    for index, prompt_next in ((0, 2), (1, 3)):  # the counting model: each next id is the last + 1
        assert len(tokens[index]) > 20
        assert tokens[index] == [(prompt_next + k) % 64 for k in range(len(tokens[index]))]
        assert tok.decode(tokens[index]).startswith(texts[index])  # text may hold back a partial character


def test_a_stalled_reader_is_aborted_after_the_timeout() -> None:
    async def main() -> tuple[int, BaseException | None]:
        backend = FakeBackend(slots=2, forward_sleep_s=0.0005)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        stream = _stream(engine, [[1]], stall_s=0.3)
        try:
            await stream.start()
            await asyncio.sleep(1.0)  # stalled well past the timeout while output waits
            for _ in range(100):
                if not engine.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            held = len(backend.held)
            error = None
            try:
                while True:
                    item = await stream.next_output()
                    if not isinstance(item, tuple):
                        break
            except APIError as exc:
                error = exc
            return held, error
        finally:
            await stream.close()
            await engine.shutdown()

    held, error = asyncio.run(main())
    assert held == 0  # the request was aborted: slot and KV back
    assert isinstance(error, APIError) and error.status == 408 and "stream_stall_timeout_s" in str(error)


def test_a_blocked_event_loop_gets_merged_outputs_and_never_stops_the_engine() -> None:
    """The loop that reads a stream is blocked for a second (a hand-over stays outstanding): the engine
    keeps stepping (after 200 ms behind it waits at most 50 ms a step), merges what the loop has not
    taken, and the reader then gets every token in a few outputs, in order."""
    import time

    async def main() -> tuple[list[int], int, int]:
        backend = FakeBackend(slots=2, forward_sleep_s=0.001)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        tokens: list[int] = []
        outputs = 0
        try:
            stream = engine.generate([1], cllm.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
            async for out in stream:
                if outputs == 0:
                    time.sleep(1.0)  # blocks this event loop: nothing handed over is taken meanwhile
                outputs += 1
                tokens += out.outputs[0].token_ids_delta
            return tokens, outputs, len(backend.batches)
        finally:
            await engine.shutdown()

    tokens, outputs, steps = asyncio.run(main())
    assert tokens == [(2 + k) % 64 for k in range(60)]  # every token, in order
    assert steps >= 60 and outputs < 10  # the engine ran on; the backlog came merged
