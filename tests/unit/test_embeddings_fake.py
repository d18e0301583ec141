"""Embeddings through the engine on the fake backend: packing, normalisation, validation, and
concurrent AsyncLLM.embed calls batched into one backend call."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import cllm
from cllm.backends.packing import pack_inputs
from tests.unit.fakes import FakeBackend


def test_pack_inputs_respects_both_budgets_and_order() -> None:
    assert pack_inputs([3, 3, 3, 1], max_tokens=6, max_inputs=8) == [range(0, 2), range(2, 4)]
    assert pack_inputs([1, 1, 1, 1, 1], max_tokens=100, max_inputs=2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert pack_inputs([6], max_tokens=6, max_inputs=1) == [range(0, 1)]
    with pytest.raises(ValueError, match="input 1 has 7 tokens"):
        pack_inputs([2, 7], max_tokens=6, max_inputs=4)


def test_llm_embed_normalises_and_validates() -> None:
    backend = FakeBackend()
    llm = cllm.LLM(backend=backend)
    outs = llm.embed(["abc", "abca", [1, 2]])
    vecs = np.array([o.embedding for o in outs])
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0)
    assert outs[0].prompt_token_ids == [0, 1, 2] and outs[2].prompt_token_ids == [1, 2]
    # bag of words: "abca" = 2a + b + c, normalised
    assert np.allclose(vecs[1][:3], np.array([2, 1, 1]) / np.sqrt(6))
    assert backend.embed_calls == [[[0, 1, 2], [0, 1, 2, 0], [1, 2]]]  # one call: the engine batches
    with pytest.raises(ValueError, match="input 1 has 9 tokens"):
        llm.embed(["ab", "abcdefghi"])
    with pytest.raises(ValueError, match="input 0: prompt is empty"):
        llm.embed([""])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.embed([[1, 999]])


def test_concurrent_async_embeds_share_backend_calls() -> None:
    backend = FakeBackend()

    async def main() -> list[list[cllm.EmbeddingOutput]]:
        engine = cllm.AsyncLLM(backend=backend)
        try:
            engine.start()
            # Hold the engine's state lock so the calls queue up behind it, then let them run: at most the
            # first one runs alone, the rest go through together.
            blocker = asyncio.get_running_loop().run_in_executor(None, lambda: engine._state_lock.acquire())
            await blocker
            tasks = [asyncio.ensure_future(engine.embed([f"{'abc'[i % 3]}b", "c"])) for i in range(6)]
            await asyncio.sleep(0.3)
            engine._state_lock.release()
            return await asyncio.gather(*tasks)
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    assert [len(r) for r in results] == [2] * 6
    assert results[0][0].prompt_token_ids == [0, 1] and results[1][0].prompt_token_ids == [1, 1]
    assert len(backend.embed_calls) < 6  # several callers' inputs went through one backend call
    assert sum(len(c) for c in backend.embed_calls) == 12
