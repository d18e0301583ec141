"""ProcessEngine: the engine core in a child process (server.engine_process), over the NullBackend.

Each test starts a real core process (spawned, as on CUDA) and talks to it through the pipe: streamed
outputs in order, abort when the caller stops early, per-request and per-call errors from the core, a
core that dies (its streams fail, is_running goes false), shutdown with a request still running, and
the packed wire form of an output.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import threading
import time

import pytest

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.core_protocol import FrameReader, is_delta, pack_output, unpack_delta, unpack_output
from cllm.engine.process_engine import EngineProcessUnavailable, ProcessEngine, RestartPolicy, wants_engine_process
from cllm.errors import ContextLengthError, EngineDeadError
from cllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from cllm.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class DyingBackend(NullBackend):
    """A NullBackend whose forward fails fatally (not a BackendError) after ``fail_after`` calls."""

    def __init__(self, fail_after: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._fail_after = fail_after

    def forward_batch(self, *args: object, **kwargs: object) -> object:
        if self.num_forwards >= self._fail_after:
            raise MemoryError("device lost")
        return super().forward_batch(*args, **kwargs)


class UnsendableTokenizerBackend(NullBackend):
    """A NullBackend whose tokenizer holds a lock (it cannot be pickled to the API process)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._tok.lock = threading.Lock()


def _engine(backend=functools.partial(NullBackend, slots=8, step_ms=1.0), *, restart: RestartPolicy | None = None,
            join_timeout_s: float = 10.0, **overrides: object) -> ProcessEngine:
    config = load_config(None, environ={}, n_seq_max=8, max_waiting=64, engine_process="on", log_level="warning",
                         **overrides)
    return ProcessEngine(config, backend, restart=restart or RestartPolicy(max_restarts=0), join_timeout_s=join_timeout_s)


async def _collect(engine: ProcessEngine, prompt: object, params: SamplingParams = GREEDY) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params)]


def _running_ids(engine: ProcessEngine) -> list[str]:
    return [r.request_id for r in engine.running_requests()]


def test_auto_is_on_only_for_torch_on_cuda() -> None:
    def choice(**overrides: object) -> bool:
        return wants_engine_process(load_config(None, environ={}, **overrides))
    assert choice(backend="torch", device="cuda")
    assert not choice(backend="torch", device="cpu")
    assert not choice(backend="llama_cpp")
    assert choice(backend="llama_cpp", engine_process="on")
    assert not choice(backend="torch", device="cuda", engine_process="off")


def test_streams_every_token_in_order_for_60_concurrent_requests() -> None:
    engine = _engine()

    async def run() -> list[list[RequestOutput]]:
        try:
            return await asyncio.gather(*(_collect(engine, [300 + i, 301, 302]) for i in range(60)))
        finally:
            await engine.shutdown()
    results = asyncio.run(run())
    for outs in results:
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        tokens = [t for o in outs for t in o.outputs[0].token_ids_delta]
        assert len(tokens) == 12
        assert outs[-1].outputs[0].token_ids == tokens  # the final output carries the whole list
        assert outs[-1].outputs[0].text == "".join(o.outputs[0].text_delta for o in outs)
        assert outs[0].prompt_token_ids == [outs[0].prompt_token_ids[0], 301, 302]  # put back on the API side
        assert outs[-1].usage.completion_tokens == 12
    assert engine.model_name and engine.max_model_len == 32768 and engine.max_num_seqs == 8
    assert not engine.is_running  # shut down


def test_a_token_prompt_goes_to_the_core_as_one_list_a_copy_of_the_callers() -> None:
    """The AddRequest's prompt and prompt_ids are one list (pickled and unpickled once), the engine's own copy:
    the caller changing its list afterwards changes nothing."""
    from cllm.engine.core_protocol import decode

    engine = _engine()
    sent: list[object] = []

    async def run() -> list[RequestOutput]:
        try:
            writer = engine._commands
            original = writer.send_encoded
            writer.send_encoded = lambda data: (sent.append(decode(data)), original(data))[1]
            prompt = [300, 301, 302]
            outs = _collect(engine, prompt)
            task = asyncio.ensure_future(outs)
            await asyncio.sleep(0)
            prompt[0] = 999
            return await task
        finally:
            await engine.shutdown()
    outs = asyncio.run(run())
    adds = [m for m in sent if type(m).__name__ == "AddRequest"]
    assert len(adds) == 1 and adds[0].prompt is adds[0].prompt_ids and adds[0].prompt_ids == [300, 301, 302]
    assert outs[-1].finished and outs[0].prompt_token_ids == [300, 301, 302]


def test_a_caller_that_stops_early_aborts_its_request_in_the_core() -> None:
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0))

    async def run() -> tuple[list[str], dict[str, int]]:
        try:
            params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            async with contextlib.aclosing(engine.generate([300, 301], params, request_id="leaver")) as stream:
                async for _ in stream:
                    break  # the client went away (the server closes its streams the same way)
            deadline = time.monotonic() + 5
            while "abort" not in engine.stats().requests_finished:
                assert time.monotonic() < deadline, "the core never aborted the request"
                await asyncio.sleep(0.05)
            return _running_ids(engine), engine.stats().requests_finished
        finally:
            await engine.shutdown()
    running, finished = asyncio.run(run())
    assert running == [] and finished == {"abort": 1}


async def _open(engine: ProcessEngine, prompt: object, params: SamplingParams = GREEDY,
                **kwargs: object) -> tuple[list[object], asyncio.Future, object]:
    """open_stream with a sink that records its items: (items, a future set at the last one, close)."""
    items: list[object] = []
    ended = asyncio.get_running_loop().create_future()

    def sink(item: object) -> None:
        assert not ended.done(), "an item after the request ended"
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            ended.set_result(None)
    close = await engine.open_stream(prompt, params, sink=sink, **kwargs)
    return items, ended, close


def test_open_stream_hands_every_output_to_the_sink_in_order_and_close_aborts() -> None:
    """The server's path (GenerationStream): no task per request, the reader calls each request's sink;
    the last call is the finished output, after which the request holds nothing; close() of an
    unfinished request aborts it in the core, once."""
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=2.0))

    async def run() -> None:
        try:
            opened = [await _open(engine, [300 + i, 301, 302]) for i in range(20)]
            await asyncio.gather(*(ended for _, ended, _ in opened))
            for items, _, close in opened:
                assert items[-1].finished and not any(o.finished for o in items[:-1])
                tokens = [t for o in items for t in o.outputs[0].token_ids_delta]
                assert len(tokens) == 12 and items[-1].outputs[0].token_ids == tokens
                close()  # ended: nothing to abort
            assert engine._streams == {} and "abort" not in engine.stats().requests_finished
            params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
            items, ended, close = await _open(engine, [300, 301], params, request_id="leaver")
            await _wait_for(lambda: items)
            close()
            close()  # idempotent
            assert engine._streams == {}
            await _wait_for(lambda: engine.stats().requests_finished.get("abort") == 1)
            assert not ended.done() and _running_ids(engine) == []
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_open_stream_refusals_raise_and_a_dying_core_ends_each_sink_with_its_error() -> None:
    engine = _engine(backend=functools.partial(DyingBackend, 3, slots=8), restart=RestartPolicy(max_restarts=0))

    async def run() -> None:
        try:
            with pytest.raises(ContextLengthError):
                await _open(engine, [300] * 10, SamplingParams(max_tokens=40000))
            assert engine._streams == {}
            items, ended, _ = await _open(engine, [300, 301])
            await asyncio.wait_for(ended, 30)
            assert isinstance(items[-1], EngineDeadError) and "device lost" in str(items[-1])
            assert engine._streams == {}
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_bad_input_fails_before_queueing_and_core_errors_reach_the_caller() -> None:
    engine = _engine()

    async def run() -> None:
        try:
            with pytest.raises(ContextLengthError):
                await _collect(engine, [300] * 10, SamplingParams(max_tokens=40000))
            with pytest.raises(ValueError, match="cannot compute embeddings"):  # raised in the core, sent back
                await engine.embed(["hello"])
            outs = await _collect(engine, "hi")  # the engine carries on
            assert outs[-1].finished
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_a_core_that_dies_fails_its_streams_and_stops_running() -> None:
    engine = _engine(backend=functools.partial(DyingBackend, 3, slots=8), restart=RestartPolicy(max_restarts=0))

    async def run() -> None:
        try:
            with pytest.raises(EngineDeadError, match="device lost") as died:
                await _collect(engine, [300, 301])
            assert str(died.value).count("engine stopped") == 1  # was "engine stopped: engine stopped: …"
            assert not engine.is_running and not engine.restarting
            with pytest.raises(EngineDeadError) as refused:
                await _collect(engine, [300, 301])
            assert str(refused.value).count("engine stopped") == 1 and "device lost" in str(refused.value)
        finally:
            await engine.shutdown()
    asyncio.run(run())


async def _wait_for(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_killed_core_is_restarted_failing_only_its_in_flight_requests() -> None:
    """The supervisor: a core killed mid-stream fails the streams it held (the real exit, said once),
    leaves no phantom running request in the stats, answers 503 while the new core loads, and then
    serves again."""
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0),
                     restart=RestartPolicy(max_restarts=2, backoff_s=0.2))

    async def run() -> None:
        try:
            params = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
            streams = [engine.generate([300 + i], params) for i in range(3)]
            for stream in streams:
                await stream.__anext__()
            await _wait_for(lambda: engine.stats().num_running == 3)
            first_pid = engine._process.pid
            os.kill(first_pid, signal.SIGKILL)
            for stream in streams:
                with pytest.raises(EngineDeadError) as died:
                    async for _ in stream:
                        pass
                text = str(died.value)
                assert "killed by SIGKILL" in text and text.count("engine stopped") == 1 and "None" not in text
            assert engine.stats().num_running == 0 and engine.running_requests() == []  # no dead snapshot
            assert not engine.is_running and engine.restarting
            with pytest.raises(EngineDeadError, match="restarting"):
                await _collect(engine, [300])
            await _wait_for(lambda: engine.is_running)
            assert engine._process.pid != first_pid and engine.num_restarts == 1
            outs = await _collect(engine, [300, 301])
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        finally:
            await engine.shutdown()
    asyncio.run(run())
    assert not engine._process.is_alive()


def test_restarts_are_bounded_then_the_engine_stays_stopped() -> None:
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0),
                     restart=RestartPolicy(max_restarts=1, backoff_s=0.05, window_s=600))

    async def run() -> None:
        try:
            engine.start()
            os.kill(engine._process.pid, signal.SIGKILL)
            await _wait_for(lambda: not engine.is_running)
            await _wait_for(lambda: engine.is_running)  # restarted once
            os.kill(engine._process.pid, signal.SIGKILL)
            await _wait_for(lambda: not engine.is_running)
            await asyncio.sleep(0.5)  # several backoffs: no second restart comes
            assert not engine.is_running and not engine.restarting and engine.num_restarts == 1
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                await _collect(engine, [300])
        finally:
            await engine.shutdown()
    asyncio.run(run())


def test_shutdown_aborts_a_running_request_and_ends_the_process() -> None:
    engine = _engine(backend=functools.partial(NullBackend, slots=8, step_ms=5.0))

    async def run() -> None:
        outs: list[RequestOutput] = []

        async def consume() -> None:
            async for out in engine.generate([300], SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)):
                outs.append(out)
        task = asyncio.ensure_future(consume())
        while not outs:
            await asyncio.sleep(0.01)
        await engine.shutdown(grace_s=0.1)
        await task  # ends as AsyncLLM's do: the core aborts it and its final output comes out
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    asyncio.run(run())
    assert not engine._process.is_alive()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, [300]))


def test_a_tokenizer_that_cannot_be_sent_is_reported_so_the_engine_can_run_in_process() -> None:
    with pytest.raises(EngineProcessUnavailable, match="tokenizer cannot be sent"):
        _engine(backend=functools.partial(UnsendableTokenizerBackend, slots=8))


def test_packed_outputs_round_trip_with_the_prompt_put_back() -> None:
    running = CompletionOutput(0, "abc", [], None, text_delta="c", token_ids_delta=[7])
    done = CompletionOutput(1, "xyz", [1, 2], "stop", stop_reason="z", text_delta="z", token_ids_delta=[2])
    out = RequestOutput("r", "p", [5, 6], [running, done], False, Usage(2, 3, 0), RequestMetrics(1.0, 2.0, 3.0))
    back = unpack_output(pack_output(out), "p", [5, 6])
    assert back.prompt == "p" and back.prompt_token_ids == [5, 6] and back.usage == out.usage
    assert back.outputs[0].text == "" and back.outputs[0].text_delta == "c"  # a running choice's whole text stays behind
    assert back.outputs[1] == done and back.metrics == out.metrics


def test_a_plain_delta_packs_flat_after_the_first_output_and_unpacks_against_it() -> None:
    """Once a request's first output went out, a running single choice with text and token ids only packs
    as a flat tuple; anything more (logprobs, a finish, an error, several choices) keeps the full form."""
    first = unpack_output(pack_output(RequestOutput("r", "p", [5, 6], [CompletionOutput(0, "", [], None, text_delta="a",
                                                                                            token_ids_delta=[7])],
                                                    False, Usage(2, 1, 1), RequestMetrics(1.0, 2.0, 3.0, 3.0))), "p", [5, 6])
    later = RequestOutput("r", "p", [5, 6], [CompletionOutput(0, "", [], None, text_delta="bc", token_ids_delta=[8, 9])],
                          False, Usage(2, 3, 1), RequestMetrics(1.0, 2.0, 3.0, 4.5))
    assert not is_delta(pack_output(later))  # no earlier output sent: the full form
    packed = pack_output(later, continued=True)
    assert is_delta(packed)
    back = unpack_delta(packed, first)
    assert back == later  # every field, from the delta and the earlier output
    with_logprobs = RequestOutput("r", "p", [5, 6], [CompletionOutput(0, "", [], None, text_delta="b", token_ids_delta=[8],
                                                                      logprobs_delta=[])],
                                  False, Usage(2, 2, 1), RequestMetrics(1.0, 2.0, 3.0, 4.0))
    finished = RequestOutput("r", "p", [5, 6], [CompletionOutput(0, "ab", [7, 8], "length", text_delta="b",
                                                                 token_ids_delta=[8])],
                             True, Usage(2, 2, 1), RequestMetrics(1.0, 2.0, 3.0, 4.0, 4.0))
    two = RequestOutput("r", "p", [5, 6], [CompletionOutput(0, "", [], None, text_delta="b", token_ids_delta=[8]),
                                           CompletionOutput(1, "", [], None, text_delta="c", token_ids_delta=[9])],
                        False, Usage(2, 2, 1), RequestMetrics(1.0, 2.0, 3.0, 4.0))
    for out in (with_logprobs, finished, two):
        assert not is_delta(pack_output(out, continued=True))


def test_frame_reader_takes_whole_frames_only() -> None:
    import multiprocessing

    reader_end, writer_end = multiprocessing.Pipe(duplex=False)
    reader = FrameReader(reader_end.fileno())
    assert reader.read(8) == []

    def write() -> None:
        writer_end.send_bytes(b"one")
        writer_end.send_bytes(b"x" * 100_000)  # more than the pipe holds at once: arrives in pieces
    writer = threading.Thread(target=write)
    writer.start()
    got: list[bytes] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += reader.read(8)
    writer.join()
    assert got == [b"one", b"x" * 100_000] and not reader.has_frame()
    for i in range(5):
        writer_end.send_bytes(bytes([i]))
    assert reader.read(3) == [b"\x00", b"\x01", b"\x02"]
    assert reader.has_frame()  # read from the pipe already: the descriptor will not wake anyone for them
    assert reader.read(8) == [b"\x03", b"\x04"] and not reader.has_frame()
    writer_end.close()
    assert reader.read(8) == [] and reader.at_eof


def test_llama_cpp_forced_on_tokenizes_with_its_own_vocabulary_and_matches_in_process_greedy() -> None:
    import cllm

    config = load_config(None, environ={}, engine_process="on", n_seq_max=2, n_ctx=1024, log_level="warning")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with cllm.LLM(config=config) as llm:
        expected = llm.generate(["The capital of France is"], params)[0].outputs[0].text
    engine = ProcessEngine(config)

    async def run() -> str:
        try:
            outs = await _collect(engine, "The capital of France is", params)
            return outs[-1].outputs[0].text
        finally:
            await engine.shutdown()
    assert engine.device_text.startswith("llama_cpp on CPU")
    assert asyncio.run(run()) == expected


@pytest.mark.parametrize("running", [False, True])
def test_the_core_loop_ends_when_the_api_process_is_gone(running: bool) -> None:
    """The core waits for commands on its own poll object; when the API process's end of the command pipe
    closes (the parent died), the loop sees the hang-up, stops, and returns: idle, or mid-request."""
    import multiprocessing

    from cllm.engine.core_protocol import AddRequest, encode
    from cllm.engine.engine_core import EngineCore, Sender
    from cllm.engine.llm_engine import LLMEngine

    config = load_config(None, environ={}, n_seq_max=2, max_waiting=8, log_level="warning")
    engine = LLMEngine(config, backend=NullBackend(slots=2, step_ms=1.0))
    api_commands, core_commands = multiprocessing.Pipe()
    core_outputs, api_outputs = multiprocessing.Pipe()
    sender = Sender(core_outputs)
    if running:
        params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        api_commands.send_bytes(encode(AddRequest("r", [300, 301], params, 0, None, [300, 301])))
    core = threading.Thread(target=EngineCore(engine, core_commands, sender).run, daemon=True)
    core.start()
    time.sleep(0.3)
    assert core.is_alive()
    api_commands.close()
    core.join(10)
    assert not core.is_alive()
    api_outputs.close()


class _CoreOnAThread:
    """An EngineCore on a thread of this process over real pipes, read as the API process reads it."""

    def __init__(self, slots: int = 2, keyed: bool = False) -> None:
        import multiprocessing

        from cllm.engine.engine_core import EngineCore, Sender
        from cllm.engine.llm_engine import LLMEngine

        config = load_config(None, environ={}, n_seq_max=slots, max_waiting=8, log_level="warning")
        self.backend = NullBackend(slots=slots, step_ms=1.0, keyed=keyed)
        self.engine = LLMEngine(config, backend=self.backend)
        self._commands, core_commands = multiprocessing.Pipe()
        core_outputs, self._outputs = multiprocessing.Pipe()
        self._core = threading.Thread(target=EngineCore(self.engine, core_commands, Sender(core_outputs)).run, daemon=True)
        self._core.start()

    def send(self, message: object) -> None:
        from cllm.engine.core_protocol import encode

        self._commands.send_bytes(encode(message))

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        from cllm.engine.core_protocol import AddRequest

        self.send(AddRequest(request_id, prompt, params, 0, None, prompt))

    def next_step_outputs(self, timeout: float) -> object | None:
        """The next StepOutputs with outputs; a stats-only one is settled at once, as the API process does."""
        from cllm.engine.core_protocol import Admitted, Settled, StepOutputs, decode

        while self._outputs.poll(timeout):
            message = decode(self._outputs.recv_bytes())
            if isinstance(message, StepOutputs) and message.outputs:
                return message
            if isinstance(message, StepOutputs):
                self.send(Settled())
            else:
                assert isinstance(message, Admitted) and message.error is None
        return None

    def close(self) -> None:
        from cllm.engine.core_protocol import StopCore

        self.send(StopCore())
        self._core.join(10)
        self.engine.close()


def _token_deltas(packed: tuple) -> list[int]:
    """The new token ids of a packed output, in either of pack_output's forms."""
    return packed[2] if is_delta(packed) else [t for choice in packed[1] for t in choice[7]]


def test_the_core_holds_outputs_until_the_api_process_settled_the_last_and_merges_them() -> None:
    """One StepOutputs in flight (engine_core.MAX_UNSETTLED): until the API process answers Settled the
    core sends no more outputs (but a first or last one: see the tests below), while it keeps stepping and merges each request's; the next message
    then carries every token made meanwhile, in order, and nothing is lost."""
    from cllm.engine.core_protocol import Settled

    core = _CoreOnAThread()
    try:
        core.add("r", [300, 301], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        first = core.next_step_outputs(5.0)
        assert first is not None
        tokens = [t for packed in first.outputs for t in _token_deltas(packed)]
        while not first.settle:  # a first output sent while a stats message was owed (see the test below)
            first = core.next_step_outputs(5.0)
            assert first is not None
            tokens += [t for packed in first.outputs for t in _token_deltas(packed)]
        steps_then = core.backend.num_forwards
        assert core.next_step_outputs(0.2) is None  # unsettled: nothing more is sent ...
        assert core.backend.num_forwards > steps_then + 5  # ... while the engine steps on
        finished = False
        messages = 1
        while not finished:
            core.send(Settled())
            message = core.next_step_outputs(5.0)
            assert message is not None
            messages += 1
            (packed,) = message.outputs
            tokens += _token_deltas(packed)  # the choice's token_ids_delta: merged over the steps it was held
            finished = not is_delta(packed) and packed[2]
        assert len(tokens) == 1000 and messages < 1000  # every token once, in fewer messages than steps
        assert packed[1][0][2] == tokens  # the final output's whole token_ids: the deltas, in order
    finally:
        core.close()


def test_a_requests_first_output_is_sent_at_once_while_the_others_wait_for_settled() -> None:
    """While the API process owes a Settled, the core holds outputs (see the test above), except a
    request's first one: the first token's latency is what its client waits on. That message asks for
    no Settled, so the outputs held for the other request still wait for the one owed."""
    from cllm.engine.core_protocol import Settled

    core = _CoreOnAThread()
    try:
        params = SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
        core.add("a", [300, 301], params)
        first = core.next_step_outputs(5.0)
        while first is not None and not first.settle:  # a's first output, sent while a stats message was owed
            first = core.next_step_outputs(5.0)
        assert first is not None and [p[0] for p in first.outputs] == ["a"]
        assert core.next_step_outputs(0.2) is None  # "a" is held: a Settled is owed
        core.add("b", [300, 302], params)
        message = core.next_step_outputs(5.0)
        assert message is not None and [p[0] for p in message.outputs] == ["b"] and not message.settle
        steps_then = core.backend.num_forwards
        assert core.next_step_outputs(0.2) is None  # b's later outputs and a's wait for the Settled still owed
        assert core.backend.num_forwards > steps_then + 5
        core.send(Settled())
        message = core.next_step_outputs(5.0)
        assert message is not None and message.settle and sorted(p[0] for p in message.outputs) == ["a", "b"]
        held = {p[0]: _token_deltas(p) for p in message.outputs}  # each one's token_ids_delta, merged while held
        assert len(held["a"]) > 5 and len(held["b"]) > 5
    finally:
        core.close()


def test_a_requests_last_output_is_sent_at_once_while_the_others_wait_for_settled() -> None:
    """A request's end is not held for a Settled either: a closed-loop client sends its next request
    only after it, and a non-streamed response is written only then. Its tokens held meanwhile come
    with it, merged; the other request's outputs still wait for the Settled owed."""
    from cllm.engine.core_protocol import Settled

    core = _CoreOnAThread()
    try:
        core.add("a", [300, 301], SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True))
        first = core.next_step_outputs(5.0)
        while first is not None and not first.settle:
            first = core.next_step_outputs(5.0)
        assert first is not None and [p[0] for p in first.outputs] == ["a"]  # a Settled is owed from now on
        core.add("b", [300, 302], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        tokens: list[int] = []
        finished = False
        while not finished:  # b's first output, then its last: neither waits for the Settled owed
            message = core.next_step_outputs(5.0)
            assert message is not None and not message.settle and [p[0] for p in message.outputs] == ["b"]
            (packed,) = message.outputs
            tokens += _token_deltas(packed)
            finished = not is_delta(packed) and packed[2]
        assert len(tokens) == 12 and packed[1][0][2] == tokens  # every token once, in order
        assert core.next_step_outputs(0.2) is None  # a's outputs are still held
        core.send(Settled())
        message = core.next_step_outputs(5.0)
        assert message is not None and message.settle and [p[0] for p in message.outputs] == ["a"]
    finally:
        core.close()


def _mixed_requests(engine_stop: str) -> list[tuple[str, list[int], SamplingParams]]:
    """A plain greedy request (the core packs its held news straight from its group), a seeded top-p one
    with logprobs, and n=2 with a stop string (both made into outputs, then packed)."""
    return [("g", [300, 301], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)),
            ("p", [302, 303], SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, logprobs=2,
                                             ignore_eos=True)),
            ("n", [304], SamplingParams(max_tokens=30, temperature=1.0, seed=3, n=2, stop=[engine_stop], ignore_eos=True))]


def _put_together(packed_outputs: list[tuple]) -> dict[str, tuple[dict, dict, list | None]]:
    """Per request, from pack_output's tuples in either form: each choice's text and token ids put
    together from the deltas, and the final output's (text, token_ids, finish_reason) per choice."""
    out: dict[str, tuple[dict, dict, list | None]] = {}
    for packed in packed_outputs:
        texts, ids, final = out.setdefault(packed[0], ({}, {}, None))
        if is_delta(packed):
            texts[0] = texts.get(0, "") + packed[1]
            ids[0] = ids.get(0, []) + list(packed[2])
            continue
        for choice in packed[1]:
            texts[choice[0]] = texts.get(choice[0], "") + choice[6]
            ids[choice[0]] = ids.get(choice[0], []) + list(choice[7])
        if packed[2]:
            out[packed[0]] = (texts, ids, [(c[1], c[2], c[3]) for c in packed[1]])
    return out


def test_news_packed_straight_from_held_groups_is_what_made_outputs_carry() -> None:
    """The core's flush packs a held plain delta straight from its group (RequestGroup.plain_delta), and
    makes every other held group's output (logprobs, n > 1, stop strings). Through the core, with Settled
    withheld for a while again and again so that outputs are held, every request's text and token ids per
    choice, and its final output, equal those of the in-process engine's outputs, one a step."""
    from cllm.engine.core_protocol import Settled, pack_output
    from cllm.engine.llm_engine import LLMEngine

    config = load_config(None, environ={}, n_seq_max=4, max_waiting=8, log_level="warning")
    engine = LLMEngine(config, backend=NullBackend(slots=4, keyed=True))
    stop = engine.tokenizer.decode([333])
    for rid, prompt, params in _mixed_requests(stop):
        engine.add_request(prompt, params, request_id=rid)
    expected: list[tuple] = []
    while engine.has_unfinished():
        expected += [pack_output(o) for o in engine.step()]
    engine.close()

    core = _CoreOnAThread(slots=4, keyed=True)
    packed: list[tuple] = []
    try:
        for rid, prompt, params in _mixed_requests(stop):
            core.add(rid, prompt, params)
        while len({p[0] for p in packed if not is_delta(p) and p[2]}) < 3:
            message = core.next_step_outputs(5.0)
            assert message is not None
            packed += message.outputs
            if message.settle:
                time.sleep(0.02)  # ~20 steps of 1 ms: the core holds meanwhile
                core.send(Settled())
    finally:
        core.close()
    assert _put_together(packed) == _put_together(expected)
    assert any(is_delta(p) and p[0] == "g" and len(p[2]) > 1 for p in packed)  # held news, packed from the group


def _engine_outputs(hold_on_steps: set[int], steps_between_takes: int = 3) -> tuple[list[RequestOutput], int]:
    """Every output of three requests (greedy; seeded top-p with logprobs; n=2 with a stop string) on an
    in-process LLMEngine over the keyed NullBackend, ``hold_outputs`` on at the steps numbered in
    ``hold_on_steps`` and the held outputs taken every ``steps_between_takes`` steps; and the steps run."""
    from cllm.engine.llm_engine import LLMEngine

    config = load_config(None, environ={}, n_seq_max=8, max_waiting=8, log_level="warning")
    engine = LLMEngine(config, backend=NullBackend(slots=8, keyed=True))
    engine.add_request([300, 301], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), request_id="g")
    engine.add_request([302, 303], SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, logprobs=2,
                                                  ignore_eos=True), request_id="p")
    stop = engine.tokenizer.decode([333])  # a word the keyed rows may or may not reach: checked every token
    engine.add_request([304], SamplingParams(max_tokens=25, temperature=1.0, seed=3, n=2, stop=[stop], ignore_eos=True),
                       request_id="n")
    outputs: list[RequestOutput] = []
    step = 0
    while engine.has_unfinished():
        engine.hold_outputs = step in hold_on_steps
        outputs += engine.step()
        step += 1
        if step % steps_between_takes == 0:
            outputs += engine.take_held_outputs()
    outputs += engine.take_held_outputs()
    engine.close()
    return outputs, step


def _merged(outputs: list[RequestOutput]) -> dict[str, tuple]:
    """Per request: each choice's text, token ids and logprobs put together from the deltas, the final
    output's whole fields, and whether an output followed the final one."""
    out: dict[str, tuple] = {}
    for o in outputs:
        texts, ids, logprobs, final, after_final = out.get(o.request_id, ({}, {}, {}, None, False))
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text_delta
            ids[c.index] = ids.get(c.index, []) + list(c.token_ids_delta)
            logprobs[c.index] = logprobs.get(c.index, []) + [(lp.token_id, lp.logprob) for lp in c.logprobs_delta or []]
        whole = [(c.text, c.token_ids, c.finish_reason) for c in o.outputs] if o.finished else None
        out[o.request_id] = (texts, ids, logprobs, whole or final, after_final or final is not None)
    return out


def test_held_outputs_carry_exactly_the_news_of_the_steps_they_stood_for() -> None:
    """LLMEngine.hold_outputs (the engine core sets it while the API process is behind): a running
    request's output after its first token's is not made per step; take_held_outputs() then makes one
    output per request of all its news. Put together, the outputs are the same text, token ids and
    logprobs, per choice, as with one output a step; a first token's output and an end are never held."""
    every, steps = _engine_outputs(set())
    held_steps = set(range(steps - 2)) - {7, 8}  # held from the first step on, let go twice in between
    held, held_run = _engine_outputs(held_steps)
    assert held_run == steps  # holding changes no step
    assert _merged(held) == _merged(every)
    assert all(not after for *_, after in _merged(held).values())  # nothing after a final output
    assert len(held) < len(every) // 2  # most outputs were never made
    firsts = {}
    for o in held:  # each request's first output with a token carries exactly one token per choice
        if o.request_id not in firsts and any(c.token_ids_delta for c in o.outputs):
            firsts[o.request_id] = [len(c.token_ids_delta) for c in o.outputs]
    assert firsts == {"g": [1], "p": [1], "n": [1, 1]}
