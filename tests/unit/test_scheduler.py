"""Scheduler and engine logic on the fake counting backend."""
from __future__ import annotations

import time

import pytest

from cllm.engine.llm_engine import LLMEngine
from cllm.sampling.params import SamplingParams
from cllm.scheduler import scheduler as scheduler_module
from cllm.scheduler.scheduler import _RefusedAdmission
from tests.unit.fakes import EOS, FakeBackend, fake_config, run_all

GREEDY = SamplingParams(max_tokens=5, temperature=0)


def make_engine(backend: FakeBackend | None = None, **overrides) -> tuple[LLMEngine, FakeBackend]:
    backend = backend or FakeBackend()
    overrides.setdefault("n_batch", backend.capacity.max_batch_tokens)
    return LLMEngine(fake_config(**overrides), backend), backend


def test_counting_model_outputs_follow_prompt():
    engine, _ = make_engine()
    engine.add_request([1, 2, 3], GREEDY, request_id="a")
    out = run_all(engine)["a"]
    assert out.outputs[0].token_ids == [4, 5, 6, 7, 8]
    assert out.outputs[0].finish_reason == "length"


def test_token_budget_and_chunked_prefill():
    engine, backend = make_engine(FakeBackend(max_batch_tokens=8))
    engine.add_request(list(range(20)), GREEDY, request_id="long")
    engine.step()
    assert [len(b[0]) for b in backend.batches] == [8]
    engine.step(); engine.step()
    # 8 + 8 + 4 prompt tokens: the prompt is done after three steps, then decode one token per step
    assert [len(b[0]) for b in backend.batches] == [8, 8, 4]
    out = run_all(engine)["long"]
    assert out.outputs[0].token_ids == [20, 21, 22, 23, 24]
    assert all(len(b[0]) <= 8 for b in backend.batches)


def test_decodes_are_not_stalled_by_a_long_prefill():
    engine, backend = make_engine(FakeBackend(max_batch_tokens=8))
    engine.add_request([1], SamplingParams(max_tokens=10, temperature=0), request_id="short")
    engine.step()
    engine.add_request(list(range(40)), GREEDY, request_id="long")
    for _ in range(4):
        engine.step()
    # every step after the first still carries the short request's decode token
    assert all("short" in b[2] for b in backend.batches[1:5])


def test_pool_exhaustion_waits_then_runs_everything():
    engine, backend = make_engine(FakeBackend(slots=2))
    for i in range(7):
        engine.add_request([i], GREEDY, request_id=f"r{i}")
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.scheduler.num_waiting == 5
    final = run_all(engine)
    assert sorted(final) == [f"r{i}" for i in range(7)]
    assert all(o.outputs[0].finish_reason == "length" for o in final.values())
    assert backend.held == {} and backend.num_free_slots() == 2


class _ClockAhead:
    """The time module, with monotonic() ``ahead_s`` seconds later: a deadline passes when the test says."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s = ahead_s

    def __getattr__(self, name: str):
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead_s


def test_slot_released_on_finish_abort_failure_and_timeout(monkeypatch: pytest.MonkeyPatch):
    engine, backend = make_engine(FakeBackend(slots=4))
    engine.add_request([1], SamplingParams(max_tokens=1, temperature=0), request_id="done")
    engine.add_request([2], SamplingParams(max_tokens=50, temperature=0), request_id="aborted")
    engine.add_request([3], SamplingParams(max_tokens=50, temperature=0), request_id="failed")
    engine.add_request([4], SamplingParams(max_tokens=50, temperature=0), request_id="late", timeout_s=3600)
    engine.step(); engine.step()
    assert "done" in backend.released
    assert engine.abort_request("aborted").outputs[0].finish_reason == "abort"
    backend.fail_when = {"failed"}
    outs = {o.request_id: o for o in engine.step()}
    assert outs["failed"].outputs[0].finish_reason == "error" and "injected" in outs["failed"].error
    backend.fail_when = set()
    assert "late" in engine.request_ids() and not outs["late"].finished  # running still: its hour has not passed
    monkeypatch.setattr(scheduler_module, "time", _ClockAhead(3601))  # now it has
    outs = {o.request_id: o for o in engine.step()}
    assert outs["late"].outputs[0].finish_reason == "timeout"
    assert backend.held == {}
    assert set(backend.released) >= {"done", "aborted", "failed", "late"}


def test_failure_only_fails_its_batch_and_engine_keeps_serving():
    engine, backend = make_engine(FakeBackend(slots=4))
    backend.fail_when = {"bad"}
    engine.add_request([1], GREEDY, request_id="bad")
    final = run_all(engine)
    assert final["bad"].outputs[0].finish_reason == "error"
    backend.fail_when = set()
    engine.add_request([1], GREEDY, request_id="good")
    assert run_all(engine)["good"].outputs[0].token_ids == [2, 3, 4, 5, 6]


def test_priority_policy_orders_waiting_requests():
    engine, backend = make_engine(FakeBackend(slots=1), policy="priority")
    engine.add_request([1], SamplingParams(max_tokens=1, temperature=0), request_id="low", priority=5)
    engine.add_request([2], SamplingParams(max_tokens=1, temperature=0), request_id="high", priority=-1)
    engine.add_request([3], SamplingParams(max_tokens=1, temperature=0), request_id="mid", priority=0)
    run_all(engine)
    order = [b[2][0] for b in backend.batches]
    assert order == ["high", "mid", "low"]


def test_fcfs_policy_orders_by_arrival():
    engine, backend = make_engine(FakeBackend(slots=1), policy="fcfs")
    for name, prio in (("a", 5), ("b", -1), ("c", 0)):
        engine.add_request([1], SamplingParams(max_tokens=1, temperature=0), request_id=name, priority=prio)
    run_all(engine)
    assert [b[2][0] for b in backend.batches] == ["a", "b", "c"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_kv_runs_out_and_resume(mode):
    # room for 24 tokens: two sequences growing to 5 + 15 tokens each cannot both fit
    engine, backend = make_engine(FakeBackend(slots=2, kv_tokens=24), preemption_mode=mode)
    params = SamplingParams(max_tokens=15, temperature=0)
    engine.add_request([1, 2, 3, 4, 5], params, request_id="first")
    engine.add_request([10, 11, 12, 13, 14], params, request_id="second")
    final = run_all(engine)
    assert engine.scheduler.num_preemptions >= 1
    # a preempted sequence's KV is valid either way: it stays prefix cache (issue 9 defect 18)
    assert backend.dropped_cache == []
    assert final["first"].outputs[0].token_ids == [(6 + i) % 64 for i in range(15)]
    assert final["second"].outputs[0].token_ids == [(15 + i) % 64 for i in range(15)]
    assert backend.held == {}


def test_eos_stops_and_ignore_eos_and_min_tokens():
    engine, _ = make_engine()
    engine.add_request([EOS - 2], SamplingParams(max_tokens=5, temperature=0), request_id="stops")
    engine.add_request([EOS - 2], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), request_id="ignores")
    engine.add_request([EOS - 1], SamplingParams(max_tokens=5, temperature=0, min_tokens=2), request_id="min")
    final = run_all(engine)
    assert final["stops"].outputs[0].token_ids == [EOS - 1, EOS]
    assert final["stops"].outputs[0].finish_reason == "stop"
    assert final["ignores"].outputs[0].token_ids == [EOS - 1, EOS, 0, 1, 2]
    # EOS suppressed for the first 2 tokens: the fake model's next-best is token 0
    assert final["min"].outputs[0].token_ids[0] != EOS


def test_stop_string_and_stop_token_ids():
    engine, _ = make_engine()
    engine.add_request([0], SamplingParams(max_tokens=20, temperature=0, stop=["de"]), request_id="s")
    engine.add_request([0], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[3]), request_id="t")
    final = run_all(engine)
    assert final["s"].outputs[0].text == "bc" and final["s"].outputs[0].stop_reason == "de"
    assert final["t"].outputs[0].token_ids == [1, 2, 3] and final["t"].outputs[0].finish_reason == "stop"


def test_queue_bound_and_bad_input():
    engine, _ = make_engine(max_waiting=2)
    engine.add_request([1], GREEDY)
    engine.add_request([1], GREEDY)
    from cllm.errors import ContextLengthError, QueueFullError
    with pytest.raises(QueueFullError):
        engine.add_request([1], GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([999], GREEDY)
    with pytest.raises(ContextLengthError):
        engine.add_request(list(range(10)) * 500, GREEDY)


def test_token_prompts_take_ints_only_int_subclasses_too_but_never_bools():
    """tokenize_prompt's fast check (the set of the items' types) and its per-item fallback agree."""
    import enum

    class Tok(enum.IntEnum):
        ONE = 1

    engine, _ = make_engine()
    assert engine.tokenize_prompt([1, 2, 3]) == [1, 2, 3]
    assert engine.tokenize_prompt((1, Tok.ONE)) == [1, 1]  # an int subclass: the per-item check takes it
    for bad in ([1, True], [False], [1, 2.0], [1, "2"], [1, None]):
        with pytest.raises(TypeError, match="a string or a list of token ids"):
            engine.tokenize_prompt(bad)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.tokenize_prompt([])


def test_n_greater_than_one_gives_n_choices():
    engine, _ = make_engine()
    engine.add_request([1], SamplingParams(max_tokens=3, temperature=0, n=3), request_id="multi")
    out = run_all(engine)["multi"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == [2, 3, 4] for c in out.outputs)
    assert out.usage.completion_tokens == 9


def test_failed_swap_restore_falls_back_to_recompute():
    # Issue 9 defect 6: a restore that always fails must not block the queue head forever.
    engine, backend = make_engine(FakeBackend(slots=2, kv_tokens=24), preemption_mode="swap")
    backend.restore_state = lambda *args, **kwargs: False
    params = SamplingParams(max_tokens=15, temperature=0)
    engine.add_request([1, 2, 3, 4, 5], params, request_id="first")
    engine.add_request([10, 11, 12, 13, 14], params, request_id="second")
    final = run_all(engine, max_steps=500)
    assert engine.scheduler.num_preemptions >= 1
    assert final["first"].outputs[0].token_ids == [(6 + i) % 64 for i in range(15)]
    assert final["second"].outputs[0].token_ids == [(15 + i) % 64 for i in range(15)]


def test_refused_admission_is_not_retried_until_a_release():
    # Issue 9 defect 6: a head request that cannot reserve KV must not re-run admission (prefix scan,
    # truncation, seq_cp on llama.cpp) every step; it is retried once something gives KV back.
    engine, backend = make_engine(FakeBackend(slots=2, kv_tokens=20))
    admits: list[str] = []
    real_admit = backend.admit

    def counting_admit(sequence_id, token_ids):
        admits.append(sequence_id)
        return real_admit(sequence_id, token_ids)
    backend.admit = counting_admit
    engine.add_request(list(range(12)), SamplingParams(max_tokens=8, temperature=0), request_id="big")
    engine.add_request(list(range(10)), SamplingParams(max_tokens=2, temperature=0), request_id="head")
    final = run_all(engine)
    # refused once while "big" runs (8 steps), admitted after "big" finished: two attempts, not nine
    assert admits.count("head") == 2, admits
    assert final["big"].outputs[0].token_ids == [12 + i for i in range(8)]
    assert final["head"].outputs[0].token_ids == [10, 11]
    assert backend.held == {}


def test_refused_head_is_retried_with_a_smaller_first_chunk():
    # The memo is per token budget: a smaller offer may fit where the bigger one did not.
    engine, _ = make_engine(FakeBackend(slots=2, kv_tokens=10_000))
    sched = engine.scheduler
    engine.add_request([1, 2, 3], GREEDY, request_id="a")
    head = sched.waiting.peek()
    sched._refused = _RefusedAdmission(head, sched._release_epoch, budget=64)
    assert sched._refused_before(head, 64) and not sched._refused_before(head, 8)
    sched._release_epoch += 1
    assert not sched._refused_before(head, 64)


def test_decodes_run_every_step_under_priority_while_a_higher_priority_prompt_prefills():
    # Issue 8: with the priority policy a long high-priority prompt sorted first and took the whole
    # budget, so lower-priority decodes were skipped for every step of its prefill.
    engine, backend = make_engine(FakeBackend(max_batch_tokens=8), policy="priority")
    engine.add_request([1], SamplingParams(max_tokens=10, temperature=0), request_id="dec", priority=5)
    engine.step()
    engine.add_request(list(range(40)), GREEDY, request_id="long", priority=0)
    for _ in range(5):
        engine.step()
    later = backend.batches[1:6]
    assert all("dec" in seqs for _, _, seqs in later)
    assert all(len(ids) <= 8 for ids, _, _ in later)
    assert sum(seqs.count("long") for _, _, seqs in later) == 7 + 4 * 7  # the prefill still advances
    final = run_all(engine)
    assert final["long"].outputs[0].token_ids == [40, 41, 42, 43, 44]


def test_recompute_prefill_does_not_starve_decodes_under_fcfs():
    # A preempted request comes back ahead of newer ones in FCFS order (it keeps its arrival number)
    # with all its tokens to recompute; the newer request's decode must still run in every step.
    engine, backend = make_engine(FakeBackend(max_batch_tokens=8))
    engine.add_request([1], SamplingParams(max_tokens=10, temperature=0), request_id="new")
    engine.step()
    engine.add_request(list(range(40)), GREEDY, request_id="old")
    engine.scheduler.requests["old"].arrival_seq = 0  # as a preempted older request resuming
    for _ in range(5):
        engine.step()
    assert all("new" in seqs for _, _, seqs in backend.batches[1:6])
    assert run_all(engine)["old"].outputs[0].token_ids == [40, 41, 42, 43, 44]


def test_prefill_is_chunked_only_while_someone_decodes():
    engine, backend = make_engine(FakeBackend(max_batch_tokens=64), max_prefill_chunk=8)
    engine.add_request(list(range(20)), GREEDY, request_id="a")
    engine.add_request(list(range(30)), GREEDY, request_id="b")
    engine.step()
    # nobody was decoding: the burst fills the budget, both prompts in one step
    assert sorted(backend.batches[0][2]) == ["a"] * 20 + ["b"] * 30
    engine.add_request(list(range(40)), GREEDY, request_id="late")
    for _ in range(3):
        engine.step()
    # a and b decode now: the late prompt gets at most 8 tokens a step beside them
    for ids, _, seqs in backend.batches[1:4]:
        assert seqs.count("late") <= 8 and "a" in seqs and "b" in seqs
    assert run_all(engine)["late"].outputs[0].token_ids == [40, 41, 42, 43, 44]


def test_prefill_beside_decodes_is_cut_to_the_stall_bound_at_the_measured_cost():
    engine, backend = make_engine(FakeBackend(max_batch_tokens=256), max_decode_stall_ms=100)
    sched = engine.scheduler
    engine.add_request(list(range(40)), GREEDY, request_id="a")
    engine.step()  # a 40-token step: the engine measured it
    assert sched.seconds_per_token is not None and sched.seconds_per_token > 0
    sched.observe_step(8, 10.0)  # too small a step to count
    sched.seconds_per_token = 0.002  # 2 ms a token: a 100 ms step holds 50 tokens
    sched.observe_step = lambda *args: None  # keep it there (the fake is much faster)
    engine.add_request([i % 60 for i in range(200)], GREEDY, request_id="late")
    engine.step()
    assert backend.batches[-1][2].count("late") == 49 and "a" in backend.batches[-1][2]  # 50 - a's decode
    sched.seconds_per_token = 1.0  # a slow machine: prompts still move 16 tokens a step
    engine.step()
    assert backend.batches[-1][2].count("late") == 16
    assert run_all(engine)["late"].outputs[0].token_ids == [20, 21, 22, 23, 24]  # the fake echoes last + 1


def test_auto_stall_bound_is_off_on_a_gpu_backend():
    """On a GPU a prompt's prefill is cheap beside a decode step: auto cuts nothing there (docs/gpu.md)."""
    gpu = FakeBackend(max_batch_tokens=2048)
    gpu.on_gpu = True
    engine, _ = make_engine(gpu)
    sched = engine.scheduler
    assert sched.stall_factor is None and sched.stall_s is None
    sched.observe_step(4, 0.200, num_sequences=4)
    sched.seconds_per_token = 0.010
    assert sched.stall_bound(4) is None and sched._prefill_while_decoding(4, 1) == sched.prefill_chunk
    engine, _ = make_engine(gpu, max_decode_stall_ms=300)  # a number is a number everywhere
    assert engine.scheduler.stall_s == pytest.approx(0.3)


def test_observe_step_averages_the_cost_per_token():
    engine, _ = make_engine(FakeBackend(max_batch_tokens=64), max_decode_stall_ms="off")
    sched = engine.scheduler
    sched.observe_step(100, 0.1)
    sched.observe_step(100, 0.2)
    assert sched.seconds_per_token == pytest.approx(0.001 + 0.2 * 0.001)
    sched.observe_step(4, 0.01, num_sequences=4)  # a pure decode step: no bound with the setting off
    assert sched._prefill_while_decoding(4, 1) == sched.prefill_chunk  # no stall bound: the chunk alone


def test_auto_stall_bound_is_a_multiple_of_a_measured_decode_step_of_as_many_sequences():
    engine, backend = make_engine(FakeBackend(max_batch_tokens=2048))  # the default: auto, factor 3
    sched = engine.scheduler
    assert sched.stall_factor == 3.0 and sched.stall_bound(4) is None  # nothing measured: prompts are not cut
    assert sched._prefill_while_decoding(4, 1) == sched.prefill_chunk  # (nor is a cost per token)
    sched.seconds_per_token = 0.001
    assert sched._prefill_while_decoding(4, 1) == 0  # one step without prompt tokens times a decode step of 4..7
    assert sched._prefill_while_decoding(5, 1) == sched.prefill_chunk  # once: then the budget alone
    sched.observe_step(4, 0.200, num_sequences=4)  # a decode step of 4 sequences: 200 ms
    sched.observe_step(40, 0.5, num_sequences=2)  # a prompt chunk beside a decode: not a decode step
    sched.observe_step(6, 0.5, num_sequences=3)  # a verification (drafts): not a decode step either
    assert sched.decode_seconds == {3: pytest.approx(0.200)}
    sched.seconds_per_token = 0.001
    assert sched.stall_bound(5) == pytest.approx(0.600)  # 4..7 sequences share the class
    assert sched._prefill_while_decoding(4, 1) == 600 - 4  # 600 ms at 1 ms a token, less the decodes
    sched.seconds_per_token = 0.010
    assert sched._prefill_while_decoding(4, 1) == 512  # never in chunks under min_prefill_per_prompt
    # ... per prompt waiting or being prefilled: a queue of prompts gets more of each step, up to the chunk
    assert sched._prefill_while_decoding(4, 3) == 3 * 512
    assert sched._prefill_while_decoding(4, 1000) == sched.prefill_chunk
    assert sched.stall_bound(8) is None  # another size class is measured on its own
    sched.observe_step(4, 0.400, num_sequences=4)  # slower now: the average follows
    assert sched.decode_seconds[3] == pytest.approx(0.200 + 0.2 * 0.200)
    # in the engine: two decoding sequences, then a long prompt arrives beside them (a floor under the bound)
    engine, backend = make_engine(FakeBackend(max_batch_tokens=2048), min_prefill_per_prompt=64)
    sched = engine.scheduler
    for rid in "ab":
        engine.add_request([1, 2, 3], GREEDY, request_id=rid)
    engine.step()
    engine.step()  # a and b decode: a pure decode step of 2, measured
    assert 2 in sched.decode_seconds
    sched.decode_seconds[2], sched.seconds_per_token = 0.100, 0.001  # (pinned: the fake is faster than any CPU)
    sched.observe_step = lambda *args: None
    engine.add_request([i % 60 for i in range(1000)], GREEDY, request_id="late")
    engine.step()
    assert backend.batches[-1][2].count("late") == 300 - 2 and "a" in backend.batches[-1][2]


def test_a_burst_of_long_prompts_times_a_decode_step_then_cuts_the_rest_beside_the_decodes():
    """Prompts arriving together fill the budget while nobody decodes; the first ones done then decode,
    and the step after carries no prompt tokens (no drafts either), so that a decode step of that size is
    measured and the prompts still waiting are cut to the bound beside it, but never below the floor per
    prompt pending (min_prefill_per_prompt 256, two prompts: 512 tokens where the bound alone would take 298)."""
    engine, backend = make_engine(FakeBackend(max_batch_tokens=2048), min_prefill_per_prompt=256)
    sched = engine.scheduler
    for rid in "abcd":
        engine.add_request([i % 50 + 1 for i in range(800)], GREEDY, request_id=rid)
    engine.step()  # 2048 tokens: a and b prefilled, c started
    assert [s for _, _, s in backend.batches][-1].count("c") == 448
    assert sched.seconds_per_token is not None and not sched.decode_seconds
    engine.step()  # a and b decode alone: the decode step of 2 is timed
    assert backend.batches[-1][2] == ["a", "b"] and 2 in sched.decode_seconds
    sched.decode_seconds[2], sched.seconds_per_token = 0.100, 0.001  # (pinned: the fake is faster than any CPU)
    sched.observe_step = lambda *args: None
    engine.step()
    step = backend.batches[-1][2]
    assert step.count("c") == 800 - 448 and step.count("d") == 2 * 256 - (800 - 448)
    outs = run_all(engine)
    assert all(len(outs[rid].outputs[0].token_ids) == 5 for rid in "abcd")


def test_kv_pressure_preempts_the_lowest_priority_even_when_it_was_admitted_first():
    """A request admitted later with a higher priority ranks first from the next step on (the running
    list is re-sorted after admissions), so running out of KV preempts the earlier, lower one."""
    engine, _ = make_engine(FakeBackend(slots=2, kv_tokens=24), policy="priority")
    params = SamplingParams(max_tokens=15, temperature=0)
    engine.add_request([1, 2, 3, 4, 5], params, request_id="low", priority=5)
    engine.step()
    engine.add_request([10, 11, 12, 13, 14], params, request_id="high", priority=0)
    preempted = []
    while engine.has_unfinished() and not preempted:
        engine.step()
        preempted = [r.request_id for r in engine.scheduler.waiting]
    assert preempted == ["low"]
    final = run_all(engine)
    assert final["high"].outputs[0].token_ids == [(15 + i) % 64 for i in range(15)]


def test_deadlines_end_only_expired_requests_and_ended_ones_are_not_kept():
    engine, backend = make_engine(FakeBackend(slots=4))
    for i in range(300):  # requests with a far deadline, each run to its end
        engine.add_request([1 + i % 50], SamplingParams(max_tokens=1, temperature=0), request_id=f"r{i}", timeout_s=600)
        run_all(engine)
    assert len(engine.scheduler._deadlines) <= 2 * len(engine.scheduler.requests) + 65
    engine.add_request([2], SamplingParams(max_tokens=50, temperature=0), request_id="late", timeout_s=0.2)
    engine.add_request([3], SamplingParams(max_tokens=3, temperature=0), request_id="quick", timeout_s=0.2)
    outs = {}
    for _ in range(4):  # "quick" ends well before its deadline
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["quick"].outputs[0].finish_reason == "length"
    time.sleep(0.25)
    outs = run_all(engine)  # only "late" is still there to time out
    assert outs["late"].outputs[0].finish_reason == "timeout"
    assert backend.held == {}
