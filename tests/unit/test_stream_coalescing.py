"""How the engine thread hands outputs to a caller's event loop (AsyncLLM, see COALESCE_MAX_S): a loop
busy with the previous hand-over gets the steps since then merged (several tokens an output); a loop
that keeps up gets every step's tokens as they come."""
from __future__ import annotations

import asyncio
import statistics
import threading
import time

import pytest

import cllm
from cllm.engine.async_llm import COALESCE_MAX_S, SETTLE_ITERATIONS
from tests.unit.fakes import FakeBackend, fake_config

STREAMS = 8


async def _tokens_per_output(engine: cllm.AsyncLLM, busy_s: float, tokens: int) -> list[int]:
    """Run STREAMS greedy streams at once; each reader spends ``busy_s`` of CPU (the GIL held, as
    formatting and writing an SSE event does) on every output. Tokens carried by each output."""
    params = cllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def read(prompt: int) -> list[int]:
        sizes = []
        async for out in engine.generate([prompt], params):
            sizes.append(len(out.outputs[0].token_ids_delta))
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:
                pass
        assert sum(sizes) == tokens
        return sizes

    try:
        per_stream = await asyncio.gather(*(read(1 + i) for i in range(STREAMS)))
    finally:
        await engine.shutdown()
    return [n for sizes in per_stream for n in sizes if n]


def test_a_busy_loop_gets_several_tokens_an_output() -> None:
    """Short steps that release the GIL (0.2 ms, as numpy's kernels do) and 0.2 ms of reader work an
    output (1.6 ms a hand-over, within one GIL switch interval): handing over whenever the loop had
    queued the last outputs made the two alternate, one token an output; now the engine keeps stepping
    until the loop has been free as long as it was busy, and the outputs carry several tokens."""
    backend = FakeBackend(slots=STREAMS, forward_sleep_s=0.0002)
    engine = cllm.AsyncLLM(backend=backend, config=fake_config(n_seq_max=STREAMS))
    sizes = asyncio.run(_tokens_per_output(engine, busy_s=0.0002, tokens=200))
    assert statistics.mean(sizes) >= 2.5


class _PacedBackend(FakeBackend):
    """A forward pass that starts once the readers have taken every token of the previous ones (and the
    loop has run on past the hand-over's settling), then lasts longer than any hand-over is allowed to
    count as busy (COALESCE_MAX_S): the loop keeps up by construction, however busy the machine is."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots=slots, forward_sleep_s=COALESCE_MAX_S + 0.01)
        self.turn = threading.Condition()
        self.produced = self.taken = 0
        self.held_back: list[int] = []  # forward passes that found the previous tokens still not handed over

    def forward_batch(self, flat_ids, positions, sequence_ids, **kwargs):
        with self.turn:
            if not self.held_back and not self.turn.wait_for(lambda: self.taken >= self.produced, timeout=5):
                self.held_back.append(len(self.batches))
            self.produced += len(set(sequence_ids))  # one token sampled per sequence (1-token prompts)
        return super().forward_batch(flat_ids, positions, sequence_ids, **kwargs)

    async def took(self, tokens: int) -> None:
        """On the loop: a reader got ``tokens``; counted once the loop has run past the hand-over's
        SETTLE_ITERATIONS (the engine then sees the loop free)."""
        for _ in range(SETTLE_ITERATIONS + 2):
            await asyncio.sleep(0)
        with self.turn:
            self.taken += tokens
            self.turn.notify_all()


def test_a_loop_that_keeps_up_gets_every_step_at_once() -> None:
    """Steps longer than the loop's work (the GIL released, as a real forward) and a reader that keeps
    up: no step's tokens wait for a later one."""
    backend = _PacedBackend(slots=STREAMS)
    engine = cllm.AsyncLLM(backend=backend, config=fake_config(n_seq_max=STREAMS))
    params = cllm.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    async def read(prompt: int) -> list[int]:
        sizes = []
        async for out in engine.generate([prompt], params):
            sizes.append(len(out.outputs[0].token_ids_delta))
            await backend.took(sizes[-1])
        return sizes

    async def run() -> list[list[int]]:
        try:
            return await asyncio.gather(*(read(1 + i) for i in range(STREAMS)))
        finally:
            await engine.shutdown()
    per_stream = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert backend.held_back == []
    assert [[n for n in sizes if n] for sizes in per_stream] == [[1] * 20] * STREAMS


def test_short_steps_hand_every_token_over_in_order() -> None:
    """Steps that cost nothing (under a quarter of HANDOVER_INTERVAL_S): the engine holds outputs for up
    to HANDOVER_INTERVAL_S and waits for the loop to run each hand-over; every token still arrives, in
    order, and the last output of each stream comes although no later step follows it."""
    engine = cllm.AsyncLLM(backend=FakeBackend(slots=STREAMS), config=fake_config(n_seq_max=STREAMS))
    params = cllm.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def run() -> list[list[int]]:
        async def read(prompt: int) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate([prompt], params):
                tokens += out.outputs[0].token_ids_delta
                if out.finished:
                    assert out.outputs[0].token_ids == tokens
            return tokens
        try:
            return await asyncio.gather(*(read(1 + i) for i in range(STREAMS)))
        finally:
            await engine.shutdown()
    assert [len(t) for t in asyncio.run(asyncio.wait_for(run(), timeout=60))] == [300] * STREAMS


@pytest.mark.parametrize("forward_sleep_s", [0.0, 0.0005])  # short steps (the waited hand-over) and not
def test_a_caller_loop_that_ends_mid_stream_never_holds_the_engine_up(forward_sleep_s: float) -> None:
    """A caller's loop that ends with its request still running (the settle callbacks of a hand-over in
    flight may never run there) does not hold the engine up: the next loop's request runs at full pace.
    (Whether a hand-over is in flight at that moment is up to timing, so this guards the outcome, not the
    closed-loop branch of AsyncLLM._hand_over in particular.)"""
    engine = cllm.AsyncLLM(backend=FakeBackend(slots=4, forward_sleep_s=forward_sleep_s), config=fake_config(n_seq_max=4))
    params = cllm.SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def leave_early() -> None:
        stream = engine.generate([1], params).__aiter__()
        await stream.__anext__()
        # returns with the request running and outputs on their way: asyncio.run closes the loop

    async def then_another() -> int:
        try:
            outs = [out async for out in engine.generate([2], cllm.SamplingParams(max_tokens=50, temperature=0))]
            return len(outs[-1].outputs[0].token_ids)
        finally:
            await engine.shutdown()

    asyncio.run(leave_early())
    started = time.monotonic()
    assert asyncio.run(asyncio.wait_for(then_another(), timeout=30)) == 50
    assert time.monotonic() - started < 10
