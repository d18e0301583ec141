"""Issue 8 mechanics on the fake backend and a fake CPU topology: one wake-up per step for all
streams, and the n_threads default chosen from the machine."""
from __future__ import annotations

import asyncio

import cllm
from cllm.backends.llama_cpp.threads import default_n_threads, physical_cores, usable_cpus
from tests.unit.fakes import FakeBackend, fake_config


def test_one_event_loop_wake_up_per_step_for_all_streams():
    async def main() -> tuple[int, int, list[list[int]]]:
        backend = FakeBackend(slots=8)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        async def one(i: int) -> list[int]:
            toks: list[int] = []
            async for out in engine.generate([i + 1], cllm.SamplingParams(max_tokens=10, temperature=0)):
                toks += out.outputs[0].token_ids_delta
            return toks
        try:
            results = await asyncio.gather(*(one(i) for i in range(8)))
        finally:
            await engine.shutdown()
        return calls, len(backend.batches), results

    calls, steps, results = asyncio.run(main())
    assert all(len(r) == 10 for r in results)
    # 8 streams x 10 tokens: per-request delivery would take >= 80 wake-ups; per-step takes one a
    # step (plus one per request and for shutdown, from asyncio.to_thread work done off the loop).
    assert calls <= steps + len(results) + 3, (calls, steps)


def test_physical_cores_counts_smt_siblings_once(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1  # pinned to one core's two hyper-threads
    assert physical_cores([0, 7], tmp_path) == 2  # topology unknown for cpu7: every CPU counts


def test_default_n_threads_never_exceeds_the_usable_cpus():
    assert 1 <= default_n_threads() <= len(usable_cpus())
