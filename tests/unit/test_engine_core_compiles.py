"""Grammar compiles in the engine core (issue 46 §1): they run off the core's loop, charged to the client
that caused them (server.max_compiles_per_client: the same 429 as in-process), at most MAX_COMPILING at
once; a compile that fails answers its add with the error; an abort while one compiles ends the request
(its stream gets a final "abort"), and the API side turns that answer into the stream's end.

The core runs on a thread of this process over pipes (as test_process_engine's loop tests do), with the
grammar cache's compile held on an event so that "while it compiles" is a state, not a race."""
from __future__ import annotations

import asyncio
import functools
import multiprocessing
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine import engine_core
from cllm.engine.core_protocol import AbortRequest, AddRequest, Admitted, StopCore, decode, encode
from cllm.engine.engine_core import EngineCore, Sender
from cllm.engine.llm_engine import LLMEngine
from cllm.engine.process_engine import ProcessEngine, RestartPolicy
from cllm.sampling.params import SamplingParams
from cllm.server.errors import APIError, engine_error
from cllm.structured.limits import CompileBusyError


def _schema(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=4, json_schema={"type": "object", "properties": {f"f{i}": {"type": "integer"}},
                                                     "required": [f"f{i}"]})


@dataclass
class Core:
    """An EngineCore on a thread, its compiles held until ``release`` is set."""

    engine: LLMEngine
    commands: object  # the API side's end of the command pipe
    outputs: object  # the API side's end of the output pipe
    release: threading.Event
    started: list  # grammar keys whose compile began

    def add(self, rid: str, params: SamplingParams, client: str | None = None) -> None:
        self.commands.send_bytes(encode(AddRequest(rid, [300, 301], params, 0, None, [300, 301], client)))

    def admitted(self, timeout: float = 10.0) -> dict[str, Admitted]:
        """Admitted messages until none comes for a while, by request id (others skipped)."""
        got = {}
        while self.outputs.poll(timeout):
            message = decode(self.outputs.recv_bytes())
            if isinstance(message, Admitted):
                got[message.request_id] = message
                timeout = 0.5
        return got


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> Iterator[Core]:
    config = load_config(None, environ={}, n_seq_max=4, max_waiting=64, log_level="warning", max_compiles_per_client=1)
    engine = LLMEngine(config, backend=NullBackend(slots=4, step_ms=1.0))
    release, started = threading.Event(), []
    cache = engine.structured.cache
    cache.compiler()  # the one-time vocabulary scan (seconds on a busy machine), before any timing
    real = cache._compile

    def held(key: tuple[str, str], params: SamplingParams) -> object:
        started.append(key)
        release.wait(30)
        return real(key, params)
    monkeypatch.setattr(cache, "_compile", held)
    api_commands, core_commands = multiprocessing.Pipe()
    core_outputs, api_outputs = multiprocessing.Pipe()
    thread = threading.Thread(target=EngineCore(engine, core_commands, Sender(core_outputs)).run, daemon=True)
    thread.start()
    yield Core(engine, api_commands, api_outputs, release, started)
    release.set()
    api_commands.send_bytes(encode(StopCore()))
    thread.join(10)
    engine.close()


def test_a_client_over_its_compile_share_gets_the_in_process_429(core: Core) -> None:
    core.add("a1", _schema(1), client="10.0.0.1")
    core.add("a2", _schema(2), client="10.0.0.1")  # a second cold compile while the first runs: over 1
    core.add("b1", _schema(3), client="10.0.0.2")  # another client has its own share
    refused = core.admitted(timeout=5.0)
    assert set(refused) == {"a2"}
    error = refused["a2"].error
    assert isinstance(error, APIError) and error.status == 429 and error.code == "client_compile_quota_exceeded"
    assert engine_error(error) is error and error.headers["Retry-After"]  # the server answers it as it is
    core.release.set()
    done = core.admitted()
    assert {rid: m.error for rid, m in done.items()} == {"a1": None, "b1": None}
    core.add("a3", _schema(1), client="10.0.0.1")  # cached now: no compile, no charge
    assert core.admitted()["a3"].error is None


def test_the_core_compiles_at_most_max_compiling_at_once(core: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_core, "MAX_COMPILING", 2)
    for i in range(3):
        core.add(f"r{i}", _schema(10 + i))
    refused = core.admitted(timeout=5.0)
    assert set(refused) == {"r2"} and isinstance(refused["r2"].error, CompileBusyError)
    assert engine_error(refused["r2"].error).status == 429
    core.release.set()
    assert {rid: m.error for rid, m in core.admitted().items()} == {"r0": None, "r1": None}


def test_a_compile_that_fails_answers_its_add_with_the_error(core: Core) -> None:
    core.release.set()
    core.add("bad", SamplingParams(max_tokens=4, grammar="root ::= undefined_rule"))
    error = core.admitted()["bad"].error
    assert isinstance(error, ValueError) and "invalid grammar=" in str(error)
    assert engine_error(error).status == 400


def test_an_abort_while_compiling_answers_the_add_as_aborted(core: Core) -> None:
    core.add("r", _schema(20))
    while not core.started:
        threading.Event().wait(0.01)
    core.commands.send_bytes(encode(AbortRequest("r")))
    answer = core.admitted()["r"]
    assert answer.aborted and answer.error is None and answer.num_sequences == 1
    assert not core.engine.has_unfinished()


def test_the_api_side_ends_a_stream_whose_request_was_aborted_while_compiling() -> None:
    """It was read as "queued": the stream then waited forever."""
    config = load_config(None, environ={}, n_seq_max=4, engine_process="on", log_level="warning")
    engine = ProcessEngine(config, functools.partial(NullBackend, slots=4), restart=RestartPolicy(max_restarts=0))

    async def run() -> None:
        try:
            engine.start()
            loop = asyncio.get_running_loop()
            loop.remove_reader(engine._outputs.fileno())  # this test answers the add itself
            params = SamplingParams(max_tokens=4, n=2)
            task = asyncio.ensure_future(_outputs(engine.generate([300], params, request_id="r")))
            while "r" not in engine._streams:
                await asyncio.sleep(0.005)
            engine._handle(Admitted("r", 2, None, aborted=True))
            outs = await asyncio.wait_for(task, 5)
            assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]
            assert engine._pending == 0  # the add's two places were counted and given back
        finally:
            await engine.shutdown()
    asyncio.run(run())


async def _outputs(stream: object) -> list:
    return [out async for out in stream]


def test_the_api_side_names_the_paying_client_to_the_core() -> None:
    """The server charges a request's compiles to its client (ClientQuota.admit sets the payer in the
    request's context); in process mode the core compiles, so the add names that client."""
    from cllm.engine.core_protocol import AddRequest
    from cllm.server.client_quota import AdmissionPolicy, ClientQuota
    from cllm.structured.limits import charge_compiles_to

    config = load_config(None, environ={}, n_seq_max=4, engine_process="on", log_level="warning")
    engine = ProcessEngine(config, functools.partial(NullBackend, slots=4), restart=RestartPolicy(max_restarts=0))
    sent: list[AddRequest] = []

    async def run() -> None:
        try:
            engine.start()
            real = engine._commands.send_encoded

            def spy(data: bytes) -> None:
                message = decode(data)
                if isinstance(message, AddRequest):
                    sent.append(message)
                real(data)
            engine._commands.send_encoded = spy
            quota = ClientQuota(AdmissionPolicy(max_sequences_per_request=8, max_sequences_per_client=None,
                                                allow_client_priority=False))
            charge_compiles_to(quota.payer("10.1.2.3"))
            await _outputs(engine.generate([300], SamplingParams(max_tokens=2)))
            charge_compiles_to(None)  # the Python API: nobody pays
            await _outputs(engine.generate([300], SamplingParams(max_tokens=2)))
        finally:
            await engine.shutdown()
    asyncio.run(run())
    assert [m.client for m in sent] == ["10.1.2.3", None]


def test_in_process_an_abort_while_compiling_ends_the_request_before_it_runs() -> None:
    """In-process the request is not in the engine while its grammar compiles: an abort then was lost and
    the request ran to max_tokens once the compile returned."""
    from cllm.engine.async_llm import AsyncLLM
    from tests.unit.fakes import FakeBackend, fake_config

    llm = AsyncLLM(backend=FakeBackend(slots=2), config=fake_config())
    compile_started, release = threading.Event(), threading.Event()
    real_compile = llm.engine.structured.compile

    def held_compile(params: SamplingParams) -> None:
        compile_started.set()
        release.wait(10)
        real_compile(params)
    llm.engine.structured.compile = held_compile

    async def run() -> None:
        try:
            params = SamplingParams(max_tokens=50, n=2, temperature=0, choice=["abc", "abd"])
            task = asyncio.ensure_future(_outputs(llm.generate("a", params, request_id="r")))
            await asyncio.to_thread(compile_started.wait, 10)
            await llm.abort("r")
            release.set()
            outs = await asyncio.wait_for(task, 10)
            assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]
            assert [c.token_ids for c in outs[-1].outputs] == [[], []]
            assert not llm.engine.has_unfinished() and llm._pending == 0 and not llm._compiling
        finally:
            await llm.shutdown()
    asyncio.run(run())
