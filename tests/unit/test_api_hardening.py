"""Issue 9 defects 2, 3 and 6 (negative seed) on the fake backend."""
from __future__ import annotations

import pytest

import cllm
from cllm.engine.llm_engine import LLMEngine
from cllm.sampling.params import SamplingParams
from tests.unit.fakes import FakeBackend, fake_config

GREEDY = SamplingParams(max_tokens=3, temperature=0)


def fake_llm(**overrides) -> cllm.LLM:
    config = fake_config(**overrides)
    return cllm.LLM(backend=FakeBackend(slots=4), config=config)


def test_generate_feeds_a_batch_larger_than_the_waiting_queue():
    llm = fake_llm(max_waiting=8)
    outs = llm.generate([[i % 50] for i in range(100)], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [[(i % 50 + k) % 64 for k in (1, 2, 3)] for i in range(100)]
    assert not llm.engine.has_unfinished()


def test_invalid_prompt_leaves_nothing_queued():
    llm = fake_llm()
    bad = SamplingParams(max_tokens=3, logit_bias={10_000: 1.0})  # token id beyond the vocab
    with pytest.raises(ValueError):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY, bad])
    assert not llm.engine.has_unfinished() and llm.engine.scheduler.num_waiting == 0
    assert llm.generate([[5]], GREEDY)[0].outputs[0].token_ids == [6, 7, 8]  # nothing left over runs here


def test_request_id_clashing_with_a_child_id_is_refused():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    engine.add_request([1], SamplingParams(max_tokens=2, n=2, temperature=0), request_id="x")
    with pytest.raises(ValueError, match="x#0"):
        engine.add_request([1], GREEDY, request_id="x#0")
    engine.add_request([1], GREEDY, request_id="y#1")
    with pytest.raises(ValueError, match="y#1"):
        engine.add_request([1], SamplingParams(max_tokens=2, n=2, temperature=0), request_id="y")
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()  # no zombie group keeps the loop busy


def test_negative_int64_seed_is_accepted_and_reproducible():
    llm = fake_llm()
    p = SamplingParams(max_tokens=4, temperature=1.0, seed=-(2 ** 63))
    first = llm.generate([[1]], p)[0].outputs[0].token_ids
    assert llm.generate([[1]], p)[0].outputs[0].token_ids == first and len(first) == 4


# ---- defect 7: stop strings --------------------------------------------------------------
# The fake model counts: after token t comes t + 1; token i < 26 decodes to chr(0x61 + i).

def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final.outputs[0]


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    out = run_one(engine, [0], SamplingParams(max_tokens=3, temperature=0, stop=["cd"]))  # b c d
    assert out.finish_reason == "stop" and out.stop_reason == "cd" and out.text == "b"


def test_min_tokens_holds_stop_strings_back():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    out = run_one(engine, [0], SamplingParams(max_tokens=10, temperature=0, stop=["c"], min_tokens=4))
    assert out.token_ids[:4] == [1, 2, 3, 4] and "c" in out.text  # "c" at token 2 did not stop it
    assert out.finish_reason == "length"


def test_stop_reason_is_null_for_eos_and_the_id_for_a_stop_token():
    engine = LLMEngine(fake_config(), FakeBackend(slots=4))
    eos = run_one(engine, [61], SamplingParams(max_tokens=5, temperature=0))  # 62, then EOS 63
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    tok = run_one(engine, [0], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[2]))
    assert tok.finish_reason == "stop" and tok.stop_reason == 2


def test_stop_strings_are_capped_in_length():
    engine = LLMEngine(fake_config(max_stop_string_chars=8), FakeBackend(slots=4))
    with pytest.raises(ValueError, match="max_stop_string_chars"):
        engine.add_request([0], SamplingParams(max_tokens=3, stop=["x" * 9]))
    assert not engine.has_unfinished()


# ---- defects 4 and 5: backend switch and shutdown ------------------------------------------

import asyncio  # noqa: E402
import threading  # noqa: E402

from tests.unit.fakes import make_fake_backend  # noqa: E402,F401


class SlowClosableBackend(FakeBackend):
    """Records close(); its forward can be held inside a step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.closed = False
        self.in_step = threading.Event()
        self.release_step = threading.Event()
        self.hold = False

    def forward_batch(self, flat_ids, positions, sequence_ids, *, logits_for=None):
        if self.hold:
            self.in_step.set()
            self.release_step.wait(30)
        return super().forward_batch(flat_ids, positions, sequence_ids, logits_for=logits_for)

    def close(self) -> None:
        self.closed = True


def test_llm_switch_backend_keeps_the_old_engine_when_loading_fails():
    backend = SlowClosableBackend(slots=4)
    llm = cllm.LLM(backend=backend, config=fake_config())
    with pytest.raises(FileNotFoundError):
        llm.switch_backend("llama_cpp", model="/nonexistent/model.gguf")
    assert not backend.closed and llm.engine.backend is backend
    assert llm.generate([[5]], GREEDY)[0].outputs[0].token_ids == [6, 7, 8]


def test_shutdown_never_frees_the_backend_inside_a_running_step():
    async def main():
        backend = SlowClosableBackend(slots=2)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        engine._join_timeout_s = 0.2
        backend.hold = True

        async def consume():
            try:
                async for _ in engine.generate([1], SamplingParams(max_tokens=3, temperature=0)):
                    pass
            except Exception:
                pass
        task = asyncio.create_task(consume())
        await asyncio.to_thread(backend.in_step.wait, 10)
        await engine.shutdown(0)
        closed_during_step = backend.closed
        backend.release_step.set()
        for _ in range(500):
            if backend.closed:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(task, 10)
        return closed_during_step, backend.closed
    closed_during_step, closed_after = asyncio.run(main())
    assert not closed_during_step and closed_after


def test_async_switch_backend_drains_then_swaps_and_survives_a_failed_load():
    async def main():
        old = SlowClosableBackend(slots=2)
        engine = cllm.AsyncLLM(backend=old, config=fake_config())

        async def run(prompt):
            final = None
            async for final in engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0)):
                pass
            return final.outputs[0].token_ids
        assert await run([1]) == [2, 3, 4]
        with pytest.raises(FileNotFoundError):
            await engine.switch_backend("llama_cpp", model="/nonexistent/model.gguf")
        assert await run([2]) == [3, 4, 5] and not old.closed
        in_flight = asyncio.create_task(run([10]))
        await engine.switch_backend("llama_cpp", n_threads=1, n_seq_max=2)
        assert await in_flight == [11, 12, 13]  # finished on the old engine before the swap
        assert old.closed and engine.engine.backend.name == "llama_cpp"
        text = await run("The capital of France is")
        await engine.shutdown(0)
        return text
    assert len(asyncio.run(main())) == 3
