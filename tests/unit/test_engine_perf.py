"""Issue 8 mechanics on the fake backend and a fake CPU topology: one wake-up per step for all
streams, and the n_threads default chosen from the machine."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import cllm
from cllm.engine import async_llm
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


def _first_step_of_a_burst(count: int, gap_s: float, patch_engine=lambda engine: None) -> list[str]:
    """Send ``count`` requests ``gap_s`` apart to an idle engine; the request ids of its first batch."""
    async def main() -> list[str]:
        backend = FakeBackend(slots=8, forward_sleep_s=0.0005)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        patch_engine(engine)

        async def one(i: int) -> None:
            await asyncio.sleep(gap_s * i)
            async for _ in engine.generate([i + 1], cllm.SamplingParams(max_tokens=4, temperature=0),
                                           request_id=f"r{i}"):
                pass
        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        finally:
            await engine.shutdown()
        return backend.batches[0][2]

    return sorted(asyncio.run(main()))


def test_requests_arriving_at_an_idle_engine_in_a_burst_share_its_first_step(monkeypatch):
    # Clients whose previous requests ended together send their next ones a few ms apart: the first
    # step waits for the burst to end (no arrival for BURST_QUIET_S) rather than start with the first
    # request and stall its decodes with the rest's prefill one step later. Widened here (50 ms quiet,
    # arrivals 5 ms apart) so a loaded machine's late sleeps cannot split the burst.
    monkeypatch.setattr(async_llm, "BURST_QUIET_S", 0.05)
    monkeypatch.setattr(async_llm, "BURST_MAX_WAIT_S", 2.0)
    assert _first_step_of_a_burst(6, 0.005) == [f"r{i}" for i in range(6)]


def test_a_burst_waits_for_a_request_still_being_tokenised(monkeypatch):
    # The quiet window (1 ms) is shorter than this request's tokenisation (30 ms): the first step
    # still waits for it, because it is counted from its admission checks to the inbox.
    monkeypatch.setattr(async_llm, "BURST_MAX_WAIT_S", 2.0)

    def slow_tokenising_for_the_second(engine: cllm.AsyncLLM) -> None:
        tokenize = engine.engine.tokenize_prompt

        def slow(prompt):
            if prompt == [2]:
                time.sleep(0.03)
            return tokenize(prompt)
        monkeypatch.setattr(engine.engine, "tokenize_prompt", slow)

    assert _first_step_of_a_burst(2, 0.0, slow_tokenising_for_the_second) == ["r0", "r1"]


def _batches_of_rounds(rounds: list[list[float]], backend: FakeBackend | None = None) -> list[list[str]]:
    """Request ids of each forward batch when rounds of requests run one after another; a round's
    requests (ids ``r<round><i>``) start after their delays, counted from the end of the round before."""
    backend = backend or FakeBackend(slots=8, forward_sleep_s=0.0005)

    async def main() -> list:
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())
        params = cllm.SamplingParams(max_tokens=4, temperature=0)

        async def one(request_id: str, prompt: list[int], delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            async for _ in engine.generate(prompt, params, request_id=request_id):
                pass
        try:
            for r, delays in enumerate(rounds):
                await asyncio.gather(*(one(f"r{r}{i}", [10 * r + i + 1], d) for i, d in enumerate(delays)))
        finally:
            await engine.shutdown()
        return [sorted(ids) for _, _, ids in backend.batches]

    return asyncio.run(main())


def _first_batch_of_round(batches: list[list[str]], r: int) -> list[str]:
    return next(ids for ids in batches if any(i.startswith(f"r{r}") for i in ids))


def test_a_closed_loop_round_is_gathered_into_one_step(monkeypatch):
    # 4 clients whose requests ended in the same step send their next ones 20 ms apart: far longer
    # than the 1 ms quiet window, but as many arrivals as finishes are expected, so the idle engine
    # waits BURST_EXPECT_QUIET_S between them (widened to 200 ms against a loaded machine's late sleeps).
    monkeypatch.setattr(async_llm, "BURST_EXPECT_QUIET_S", 0.2)
    monkeypatch.setattr(async_llm, "BURST_MAX_WAIT_S", 2.0)
    batches = _batches_of_rounds([[0.0] * 4, [0.02 * i for i in range(4)]])
    assert batches[0] == ["r00", "r01", "r02", "r03"]  # the first round ran (and ended) together
    assert _first_batch_of_round(batches, 1) == ["r10", "r11", "r12", "r13"]


def test_a_closed_loop_round_slower_than_the_plain_wait_bound_is_still_gathered(monkeypatch):
    # On a slow machine a closed loop's follow-ups spread over more than BURST_MAX_WAIT_S (0.1 s): while
    # they are owed the gather may last BURST_EXPECT_MAX_WAIT_S (0.5 s), so 4 arrivals 60 ms apart
    # (0.18 s in all) still share one step. (Quiet window widened against a loaded machine's late sleeps.)
    monkeypatch.setattr(async_llm, "BURST_EXPECT_QUIET_S", 0.2)
    assert async_llm.BURST_MAX_WAIT_S < 0.18 < async_llm.BURST_EXPECT_MAX_WAIT_S
    batches = _batches_of_rounds([[0.0] * 4, [0.06 * i for i in range(4)]])
    assert _first_batch_of_round(batches, 1) == ["r10", "r11", "r12", "r13"]


def test_an_unannounced_burst_widens_the_quiet_window(monkeypatch):
    # Nothing owed (clients starting together): once two requests are in, the gather waits
    # BURST_EXPECT_QUIET_S (widened to 200 ms here) for more instead of BURST_QUIET_S (1 ms), so two
    # later arrivals 30 ms apart join the first step.
    monkeypatch.setattr(async_llm, "BURST_EXPECT_QUIET_S", 0.2)
    monkeypatch.setattr(async_llm, "BURST_MAX_WAIT_S", 2.0)
    assert _batches_of_rounds([[0.0, 0.0, 0.03, 0.06]])[0] == ["r00", "r01", "r02", "r03"]


class _HousekeepingBackend(FakeBackend):
    """A backend with idle work to do once a batch has run (as the llama.cpp backend saves idle slots'
    KV to its host prompt cache): ``units`` units of 1 ms, each noted with the batches run before it."""

    def __init__(self, units: int) -> None:
        super().__init__(slots=8, forward_sleep_s=0.0005)
        self.units, self.done = units, []

    def idle_work(self) -> bool:
        if not self.batches or len(self.done) >= self.units:
            return False
        time.sleep(0.001)
        self.done.append(len(self.batches))
        return True


def _note_gathering_work(monkeypatch) -> list[bool]:
    """The ``gathering`` flag of every engine idle-work call that did a unit."""
    calls: list[bool] = []
    original = async_llm.AsyncLLM._idle_work

    def noting(self, *, gathering: bool = False) -> bool:
        did = original(self, gathering=gathering)
        if did:
            calls.append(gathering)
        return did
    monkeypatch.setattr(async_llm.AsyncLLM, "_idle_work", noting)
    return calls


def test_a_gathered_burst_spends_its_wait_on_idle_work_and_is_still_one_step(monkeypatch):
    # Clients are owed (the main loop does no idle work for them), but while their follow-ups come in
    # the engine waits anyway: the units run then, between round 0's last batch and round 1's first,
    # and the round still starts in one step.
    monkeypatch.setattr(async_llm, "BURST_EXPECT_QUIET_S", 0.2)
    monkeypatch.setattr(async_llm, "BURST_MAX_WAIT_S", 2.0)
    calls = _note_gathering_work(monkeypatch)
    backend = _HousekeepingBackend(units=5)
    batches = _batches_of_rounds([[0.0] * 4, [0.02 * i for i in range(4)]], backend)
    round_1 = batches.index(_first_batch_of_round(batches, 1))
    assert batches[round_1] == ["r10", "r11", "r12", "r13"]
    assert backend.done == [round_1] * 5 and calls == [True] * 5


def test_a_lone_request_does_not_wait_behind_idle_work(monkeypatch):
    # One client: its return clears what it was owed, so the gather's window is 1 ms, with no idle work.
    calls = _note_gathering_work(monkeypatch)
    _batches_of_rounds([[0.0], [0.0], [0.0]], _HousekeepingBackend(units=5))
    assert True not in calls


def test_physical_cores_counts_smt_siblings_once(tmp_path):
    for cpu, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(siblings + "\n")
    assert physical_cores([0, 1, 2, 3], tmp_path) == 2
    assert physical_cores([0, 2], tmp_path) == 1  # pinned to one core's two hyper-threads
    assert physical_cores([0, 7], tmp_path) == 2  # topology unknown for cpu7: every CPU counts


def test_default_n_threads_follows_the_cpus_this_process_may_use():
    assert 1 <= default_n_threads() <= len(usable_cpus())
    # Pinned to one CPU (taskset, a cpuset), the default is one thread, whatever the machine has.
    code = ("import os; from cllm.backends.llama_cpp.threads import default_n_threads, usable_cpus; "
            "os.sched_setaffinity(0, usable_cpus()[:1]); print(default_n_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1", out.stderr


class _HeldBackend(FakeBackend):
    """Its second forward pass (a decode step, the request running) lasts until the test lets it end;
    the first lasts past async_llm.PUBLISH_EVERY_S, so the snapshot after it is published for sure."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.in_step = threading.Event()  # the held forward has begun
        self.end_step = threading.Event()  # let it end

    def forward_batch(self, flat_ids, positions, sequence_ids, *, logits_for=None):
        if not self.batches:
            time.sleep(async_llm.PUBLISH_EVERY_S * 1.5)  # (a lower bound: late wake-ups only add to it)
        elif len(self.batches) == 1:
            self.in_step.set()
            self.end_step.wait(STEP_HELD_S)
        return super().forward_batch(flat_ids, positions, sequence_ids, logits_for=logits_for)


STEP_HELD_S = 10.0  # (the held step's bound, should the test never let it end)


def test_stats_and_running_requests_do_not_wait_for_a_running_step():
    async def main() -> tuple[float, float, int, int]:
        backend = _HeldBackend(slots=2)
        engine = cllm.AsyncLLM(backend=backend, config=fake_config())

        async def one() -> None:
            async for _ in engine.generate([1, 2], cllm.SamplingParams(max_tokens=4, temperature=0)):
                pass
        task = asyncio.ensure_future(one())
        try:
            assert await asyncio.to_thread(backend.in_step.wait, 30), "the second step never began"
            start = time.perf_counter()
            stats = engine.stats()  # the step is still running: it ends only when end_step is set below
            stats_s = time.perf_counter() - start
            start = time.perf_counter()
            running = engine.running_requests()
            running_s = time.perf_counter() - start
        finally:
            backend.end_step.set()
        await task
        done = engine.stats().requests_finished.get("length", 0)
        await engine.shutdown()
        return stats_s, running_s, stats.num_running + len(running), done

    stats_s, running_s, seen, done = asyncio.run(main())
    # Waiting for the step's lock would have lasted until the step was let go (STEP_HELD_S).
    assert stats_s < STEP_HELD_S / 2 and running_s < STEP_HELD_S / 2
    assert seen == 2  # the snapshot shows the request running
    assert done == 1  # and the final one counts it finished
