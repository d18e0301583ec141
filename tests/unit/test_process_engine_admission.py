"""ProcessEngine admission (issue 46 §1-2): every limit the core would refuse is checked in the API process
before anything is registered, a request that cannot be sent frees what it held, requests on their way
to the core count toward max_waiting, and the paths around the core (duplicate ids, a load that fails,
embed calls when the core dies, prompt logprobs on later outputs, the kill after the shutdown timeout,
``auto`` falling back to an in-process engine)."""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.async_llm import AsyncLLM
from cllm.engine.llm_engine import LLMEngine
from cllm.engine.process_engine import EngineProcessUnavailable, ProcessEngine, RestartPolicy
from cllm.errors import EngineDeadError, QueueFullError
from cllm.outputs import RequestOutput
from cllm.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(**overrides: object):
    settings = {"n_seq_max": 8, "max_waiting": 64, "engine_process": "on", "log_level": "warning", **overrides}
    return load_config(None, environ={}, **settings)


def _engine(backend=functools.partial(NullBackend, slots=8, step_ms=1.0), join_timeout_s: float = 10.0,
            **overrides: object) -> ProcessEngine:
    return ProcessEngine(_config(**overrides), backend, restart=RestartPolicy(max_restarts=0),
                         join_timeout_s=join_timeout_s)


async def _collect(engine: object, prompt: object, params: SamplingParams = GREEDY, **kwargs: object) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, **kwargs)]


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _assert_nothing_held(engine: ProcessEngine) -> None:
    assert engine._streams == {} and engine._pending == 0


# ------------------------------------------------------------------ the limits, both modes, every path
def test_stop_strings_are_limited_when_the_prompt_comes_as_ids() -> None:
    """The server passes prompt ids: add_request skipped validate_request, so a 5,000-character stop
    string passed a cap of 8."""
    engine = LLMEngine(_config(max_stop_string_chars=8, engine_process="off"), backend=NullBackend(slots=2))
    try:
        with pytest.raises(ValueError, match=r"invalid stop=.*max_stop_string_chars \(8\)"):
            engine.add_request([300, 301], SamplingParams(stop=["x" * 5000]), prompt_ids=[300, 301])
        deep = SamplingParams(json_schema=_deep_schema(300))
        with pytest.raises(ValueError, match="invalid json_schema=<nested"):
            engine.add_request([300, 301], deep, prompt_ids=[300, 301])
        assert not engine.has_unfinished()
    finally:
        engine.close()


def test_in_process_engine_refuses_before_registering() -> None:
    llm = AsyncLLM(config=_config(max_stop_string_chars=8, engine_process="off"), backend=NullBackend(slots=2))

    async def run() -> None:
        try:
            with pytest.raises(ValueError, match="max_stop_string_chars"):
                await _collect(llm, [300], SamplingParams(stop=["y" * 60_000]))
            assert llm._streams == {} and llm._pending == 0
        finally:
            await llm.shutdown()
    asyncio.run(run())


def test_process_engine_refuses_what_the_core_would_before_registering() -> None:
    """A schema nested 300 deep failed to pickle after its stream and pending place were registered (HTTP
    500, both leaked: after max_waiting of them every request got 429). Now it is a ValueError (400) before
    anything is held, as are a stop string over the cap and a prompt longer than the context; the engine
    serves on."""
    engine = _engine(max_waiting=4, max_stop_string_chars=8)

    async def run() -> None:
        try:
            for _ in range(3 * 4):  # three times max_waiting: a leak would fill it
                with pytest.raises(ValueError, match=r"invalid json_schema=<nested \d+ levels deep>"):
                    await _collect(engine, [300], SamplingParams(json_schema=_deep_schema(300)))
                _assert_nothing_held(engine)
            with pytest.raises(ValueError, match="max_stop_string_chars"):
                await _collect(engine, [300], SamplingParams(stop=["z" * 5000]))
            with pytest.raises(ValueError, match="context"):
                await _collect(engine, [300] * 40000, SamplingParams(max_tokens=4))
            _assert_nothing_held(engine)
            outs = await _collect(engine, [300, 301])
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_a_request_that_cannot_be_pickled_is_a_400_naming_the_field_and_holds_nothing() -> None:
    engine = _engine()

    class LocalStr(str):  # pickle looks classes up by name: a local one cannot be sent
        pass

    async def run() -> None:
        try:
            with pytest.raises(ValueError, match=r"invalid stop=<cannot be sent to the engine process"):
                await _collect(engine, [300], SamplingParams(stop=[LocalStr("end")]))
            _assert_nothing_held(engine)
            assert (await _collect(engine, [300]))[-1].finished
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_a_send_that_fails_releases_the_stream_and_the_pending_place() -> None:
    engine = _engine()

    async def run() -> None:
        try:
            engine.start()
            real = engine._commands.send_encoded

            def broken(data: bytes) -> None:
                raise OSError("the pipe broke")
            engine._commands.send_encoded = broken
            with pytest.raises(OSError, match="pipe broke"):
                await _collect(engine, [300])
            _assert_nothing_held(engine)
            engine._commands.send_encoded = real
            assert (await _collect(engine, [300]))[-1].finished
        finally:
            await engine.shutdown()
    asyncio.run(run())


# ------------------------------------------------------------------ the paths around the core
def test_requests_on_their_way_to_the_core_count_toward_max_waiting() -> None:
    """Until the core's Admitted comes back, the core's waiting queue does not show a request: the API
    side counts it (``_pending``). With the core's answers held back, the third of max_waiting=2 is refused."""
    engine = _engine(max_waiting=2)

    async def run() -> None:
        try:
            engine.start()
            loop = asyncio.get_running_loop()
            loop.remove_reader(engine._outputs.fileno())  # the core's answers wait in the pipe
            tasks = [asyncio.ensure_future(_collect(engine, [300 + i])) for i in range(2)]
            while engine._pending < 2:
                await asyncio.sleep(0.01)
            assert engine.stats().num_waiting == 0  # the core's snapshot does not know of them yet
            with pytest.raises(QueueFullError):  # refused at once (admitted, it would wait for the held answers)
                await asyncio.wait_for(_collect(engine, [400]), 10)
            loop.add_reader(engine._outputs.fileno(), engine._on_readable)
            for outs in await asyncio.gather(*tasks):
                assert outs[-1].finished
            assert engine._pending == 0
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_a_request_id_in_use_is_refused_and_the_first_runs_on() -> None:
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0))

    async def run() -> None:
        try:
            first = asyncio.ensure_future(_collect(engine, [300], GREEDY, request_id="same"))
            while "same" not in engine._streams:
                await asyncio.sleep(0.005)
            with pytest.raises(ValueError, match="request_id 'same' is already in use"):
                await _collect(engine, [301], GREEDY, request_id="same")
            outs = await first
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_prompt_logprobs_sent_once_are_on_every_later_output() -> None:
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0))

    async def run() -> list[RequestOutput]:
        try:
            return await _collect(engine, [300, 301, 302], SamplingParams(max_tokens=20, temperature=0.0,
                                                                        ignore_eos=True, prompt_logprobs=1))
        finally:
            await engine.shutdown()
    outs = asyncio.run(run())
    scored = [i for i, out in enumerate(outs) if out.prompt_logprobs is not None]
    assert scored and len(outs) - scored[0] > 1  # more than one output after the scored one
    assert scored == list(range(scored[0], len(outs)))
    assert all(out.prompt_logprobs == outs[scored[0]].prompt_logprobs for out in outs[scored[0]:])
    assert len(outs[-1].prompt_logprobs) == 3


def test_embed_calls_fail_when_the_core_dies() -> None:
    engine = _engine()

    async def run() -> None:
        try:
            engine.start()
            os.kill(engine._process.pid, signal.SIGKILL)
            engine._process.join(10)  # dead before the call is sent: only its death can answer it
            with pytest.raises(EngineDeadError, match="killed by SIGKILL.*the embedding did not run"):
                await asyncio.wait_for(engine.embed(["hello"]), 10)
            assert engine._embeds == {}
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                await engine.embed(["hello"])
        finally:
            await engine.shutdown()
    asyncio.run(run())


class FailingBackend(NullBackend):
    def __init__(self, **kwargs: object) -> None:
        raise OSError("weights file is truncated")


class ExitingBackend(NullBackend):
    def __init__(self, **kwargs: object) -> None:
        os._exit(3)


def test_a_load_that_fails_says_why() -> None:
    with pytest.raises(RuntimeError, match="could not load the model: OSError: weights file is truncated"):
        _engine(backend=FailingBackend)
    with pytest.raises(RuntimeError, match="exited with code 3 while loading the model"):
        _engine(backend=ExitingBackend)


class HangingBackend(NullBackend):
    """A forward that never returns in time (a wedged device): the core cannot read StopCore."""

    def forward_batch(self, *args: object, **kwargs: object) -> object:
        if self.num_forwards >= 2:
            time.sleep(120)
        return super().forward_batch(*args, **kwargs)


async def _drain(stream: object) -> None:
    async for _ in stream:
        pass


def test_a_core_that_does_not_exit_is_killed_after_the_join_timeout() -> None:
    # Steps of 20 ms: the core sends the first token before the second forward wedges. With steps that cost
    # nothing the core may hold that output for the next step (short steps hand over at most every
    # HANDOVER_INTERVAL_S), the second forward never returns, and the stream's first output never came:
    # the test hung in about half of its runs.
    engine = _engine(backend=functools.partial(HangingBackend, slots=8, step_ms=20.0), join_timeout_s=0.5)

    async def run() -> float:
        stream = engine.generate([300], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        await stream.__anext__()
        started = time.monotonic()
        await engine.shutdown(grace_s=0.1)
        took = time.monotonic() - started
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(stream), 20)
        return took
    took = asyncio.run(run())
    assert engine._process.exitcode == -signal.SIGKILL
    assert took < 30  # the join timeout (0.5 s) and the kill, not the 120 s forward


def test_auto_falls_back_to_an_in_process_engine_when_the_core_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    import cllm.engine.async_llm as async_llm_module
    import cllm.engine.process_engine as process_engine_module
    from cllm.server import lifecycle

    def unavailable(config: object) -> ProcessEngine:
        raise EngineProcessUnavailable("the engine cannot run in its own process: its tokenizer cannot be sent")
    monkeypatch.setattr(process_engine_module, "wants_engine_process", lambda config: True)
    monkeypatch.setattr(process_engine_module, "ProcessEngine", unavailable)
    monkeypatch.setattr(async_llm_module, "AsyncLLM", lambda config: ("in-process", config.server.engine_process))
    assert lifecycle._construct_engine(_config(engine_process="auto")) == ("in-process", "auto")
    with pytest.raises(EngineProcessUnavailable):  # forced on: said, not hidden
        lifecycle._construct_engine(_config(engine_process="on"))
