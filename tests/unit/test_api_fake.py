"""Python API over the fake backend: entry-point backends, AsyncLLM streaming and abort."""
from __future__ import annotations

import asyncio

import pytest

import cllm
from cllm.backends.registry import backend_names, describe_backends


@pytest.fixture()
def fake_entry_point(tmp_path, monkeypatch):
    dist = tmp_path / "cllm_fake_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: cllm-fake-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[cllm.backends]\nfake = tests.unit.fakes:make_fake_backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield


def test_third_party_backend_loads_from_entry_point(fake_entry_point):
    assert "fake" in backend_names()
    assert any(i.name == "fake" and i.loadable for i in describe_backends())
    llm = cllm.LLM(backend="fake", n_seq_max=2, n_batch=64)
    out = llm.generate([[1, 2]], cllm.SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.outputs[0].token_ids == [3, 4, 5]


def test_async_streaming_concurrency_and_abort(fake_entry_point):
    async def main():
        engine = cllm.AsyncLLM(backend="fake", n_seq_max=2, n_batch=64)
        async def full(i):
            toks = []
            async for out in engine.generate([i], cllm.SamplingParams(max_tokens=6, temperature=0)):
                toks += out.outputs[0].token_ids_delta
            return toks, out.outputs[0].token_ids, out.outputs[0].finish_reason
        results = await asyncio.gather(*[full(i) for i in range(5)])
        # abort by leaving the stream: closing the generator (a bare `break` leaves the close to asyncio's
        # async-generator finalizer, which runs later)
        stream = engine.generate([1], cllm.SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True), request_id="cut")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(300):  # stats() is a snapshot published after each step/command: it may lag the abort
            await asyncio.sleep(0.01)
            snap = engine.stats()
            if snap.slots_in_use == 0 and snap.requests_finished.get("abort") == 1:
                break
        stats = engine.stats()
        with pytest.raises(ValueError, match="temperature"):
            async for _ in engine.generate([1], cllm.SamplingParams(temperature=-1)):
                pass
        await engine.shutdown(0)
        with pytest.raises(cllm.EngineDeadError):
            async for _ in engine.generate([1]):
                pass
        return results, stats
    results, stats = asyncio.run(main())
    for i, (streamed, full, reason) in enumerate(results):
        assert streamed == full == [(i + 1 + k) % 64 for k in range(6)] and reason == "length"
    assert stats.slots_in_use == 0 and stats.requests_finished.get("abort") == 1
