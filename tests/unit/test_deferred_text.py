"""Deferred text work (LLMEngine.step on a backend that overlaps host work, as the torch backend on
CUDA): the same outputs as without it, one step later; stop strings are never deferred."""
from __future__ import annotations

import asyncio
import threading

import cllm
from cllm.outputs import RequestOutput
from tests.unit.fakes import FakeBackend, fake_config, run_all


def _engine(overlap: bool) -> cllm.LLM:
    backend = FakeBackend(slots=4)
    backend.overlaps_host_work = overlap
    return cllm.LLM(backend=backend, config=fake_config())


def _batches_at_detokenize(backend: FakeBackend) -> list[int]:
    """How many forward passes had run each time a token's text was made: deferred text work is done
    during the next step's forward, so a token of pass k is detokenised once pass k + 1 has run."""
    seen: list[int] = []
    token_bytes = backend.tokenizer.token_bytes

    def recording(token_id: int) -> bytes:
        seen.append(len(backend.batches))
        return token_bytes(token_id)

    backend.tokenizer.token_bytes = recording  # (an instance attribute shadows the method)
    return seen


def _streamed(engine, prompts, params) -> tuple[dict[str, RequestOutput], dict, dict, dict]:
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    texts: dict[tuple[str, int], list[str]] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    arrivals: dict[tuple[str, int], list[int]] = {}  # the step that returned each token
    final = {}
    for step in range(1000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in final, "an output after the final one"
            for o in out.outputs:
                texts.setdefault((out.request_id, o.index), []).append(o.text_delta)
                tokens.setdefault((out.request_id, o.index), []).extend(o.token_ids_delta)
                arrivals.setdefault((out.request_id, o.index), []).extend([step] * len(o.token_ids_delta))
            if out.finished:
                final[out.request_id] = out
    return final, texts, tokens, arrivals


def test_deferred_text_gives_the_same_outputs() -> None:
    prompts = [[1, 2, 3], [10, 11], [60, 61, 62, 5]]  # 60-62: the bytes of a multi-byte character
    cases = [cllm.SamplingParams(max_tokens=9, temperature=0),
             cllm.SamplingParams(max_tokens=9, temperature=0, stop=["gh"]),
             cllm.SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=2)]
    for params in cases:
        plain, deferred = _engine(False), _engine(True)
        a, ta, ka, when_a = _streamed(plain.engine, prompts, params)
        b, tb, kb, when_b = _streamed(deferred.engine, prompts, params)
        assert sorted(a) == sorted(b)
        # Deferred: each token comes one step after the plain engine's; with stop strings, never deferred.
        lag = 0 if params.stop else 1
        assert when_b == {k: [s + lag for s in steps] for k, steps in when_a.items()}
        for rid in a:
            for x, y in zip(a[rid].outputs, b[rid].outputs):
                assert (x.text, x.token_ids, x.finish_reason, x.stop_reason) == (y.text, y.token_ids, y.finish_reason, y.stop_reason)
                assert [lp.token_id for lp in x.logprobs or []] == [lp.token_id for lp in y.logprobs or []]
            for o in b[rid].outputs:  # streamed deltas add up to the final output
                assert "".join(tb[rid, o.index]) == o.text and kb[rid, o.index] == o.token_ids
        assert plain.engine.scheduler.requests == {} and deferred.engine.scheduler.requests == {}


def test_deferred_text_still_aborts_and_streams_through_asyncllm() -> None:
    async def main() -> tuple[str, int]:
        backend = FakeBackend(slots=2, forward_sleep_s=0.001)
        backend.overlaps_host_work = True
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        try:
            text = ""
            passes = _batches_at_detokenize(backend)
            async for out in engine.generate([1, 2], cllm.SamplingParams(max_tokens=12, temperature=0)):
                text += out.outputs[0].text_delta
            # The text of pass k's token was made while pass k + 1 ran; the last one's in the idle step after.
            assert passes == [*range(2, 13), 12]
            seen = 0
            released = threading.Event()
            release = backend.release

            def releasing(sequence_id: str, **kwargs) -> None:
                release(sequence_id, **kwargs)
                if not backend.held:
                    released.set()
            backend.release = releasing
            async for out in engine.generate([3], cllm.SamplingParams(max_tokens=500, temperature=0)):
                seen += len(out.outputs[0].token_ids_delta)
                if seen >= 5:
                    break  # closing the stream aborts the request
            assert await asyncio.to_thread(released.wait, 30), "the aborted request's slot was never released"
            return text, len(backend.held)
        finally:
            await engine.shutdown()

    text, held = asyncio.run(main())
    assert text == "defghijklmno"  # tokens 3..14 after [1, 2]: the counting model's next ids, as letters
    assert held == 0


def test_run_all_on_deferred_engine_finishes() -> None:
    llm = _engine(True)
    passes = _batches_at_detokenize(llm.engine.backend)
    llm.engine.add_request([1], cllm.SamplingParams(max_tokens=3, temperature=0))
    final = run_all(llm.engine)
    assert [o.outputs[0].token_ids for o in final.values()] == [[2, 3, 4]]
    assert passes == [2, 3, 3]  # each token's text made during the next pass (the last: in the step after)
