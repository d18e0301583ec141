"""The one-step lookahead (scheduler.lookahead) on the real scheduler and engine, over the null backend.

The null backend in keyed mode gives each row logits that depend only on the sequence's last token and
its position, never on the row's place in the batch or on what else runs: so whatever the schedule, the
same requests must get the same tokens, logprobs and texts. These tests run each scenario with the
lookahead off (today's order) and on, and compare bitwise; the real model's version is in
tests/integration/test_lookahead_torch.py.
"""
from __future__ import annotations

import time

import pytest

import cllm
from cllm.backends.base import BackendError
from cllm.bench.null_backend import NullBackend, SimulatedDevice
from cllm.config import load_config
from cllm.engine.llm_engine import LLMEngine, _lookahead_on

SLOTS = 8


def _engine(lookahead: str, *, kv_tokens: int = 1 << 20, device: str = "torch", device_ms: float = 0.0,
            **settings: object) -> LLMEngine:
    backend = NullBackend(slots=SLOTS, vocab_size=1024, device=device, keyed=True, kv_tokens=kv_tokens,
                          device_ms=device_ms)
    config = load_config(None, environ={}, n_seq_max=SLOTS, max_waiting=4096, lookahead=lookahead, **settings)
    return LLMEngine(config, backend=backend)


def _params(i: int, **extra: object) -> cllm.SamplingParams:
    sampling = dict(temperature=0) if i % 2 else dict(temperature=0.9, top_p=0.9, seed=100 + i,
                                                       repetition_penalty=1.3, frequency_penalty=0.4)
    return cllm.SamplingParams(max_tokens=12 + i % 9, ignore_eos=True, logprobs=2 if i % 3 == 0 else None,
                               **sampling, **extra)  # type: ignore[arg-type]


def _run(engine: LLMEngine, n: int, *, abort_at: int | None = None, check=None, **extra: object) -> dict:
    """``n`` requests (more than the slots: admissions all along); the finished outputs by id."""
    for i in range(n):
        engine.add_request([300 + i + j for j in range(3 + i % 7)], _params(i, **extra), request_id=f"r{i}")
    outs: dict[str, tuple] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == abort_at:
            for i in range(0, n, 4):
                engine.abort_request(f"r{i}")
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = (c.token_ids, c.text, c.finish_reason,
                                      [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                                       for lp in (c.logprobs or [])])
        if check is not None:
            check(engine)
        steps += 1
    return outs


@pytest.mark.parametrize("scenario", ["admissions", "preemption", "stop_strings", "aborts"])
def test_outputs_are_the_same_with_the_lookahead_on_and_off(scenario):
    kw: dict = {}
    extra: dict = {}
    if scenario == "preemption":
        kw["kv_tokens"] = 120  # 8 sequences of up to 29 tokens cannot all hold their KV
    if scenario == "stop_strings":
        extra["stop"] = [" w33", " w50"]
    if scenario == "aborts":
        kw["abort_at"] = 6
    runs = {}
    for lookahead in ("off", "on"):
        engine = _engine(lookahead, kv_tokens=kw.get("kv_tokens", 1 << 20))
        runs[lookahead] = _run(engine, 30, abort_at=kw.get("abort_at"), **extra)
        stats = (engine.ahead_rows, engine.ahead_used, engine.scheduler.num_preemptions)
        engine.close()
        if lookahead == "on":
            assert stats[1] > 0.5 * stats[0] > 0, stats  # the lookahead ran, and most of it was used
        if scenario == "preemption":
            assert stats[2] > 0
    assert runs["on"] == runs["off"]
    if scenario == "stop_strings":
        assert any(reason == "stop" for _, _, reason, _ in runs["on"].values())
    if scenario == "aborts":
        assert len(runs["on"]) < 30


def test_the_backend_holds_only_confirmed_tokens_after_every_step():
    """Rows launched ahead for requests that ended, were preempted or aborted are never confirmed: after
    every step each live sequence holds exactly the tokens the host counts as computed."""
    def check(engine: LLMEngine) -> None:
        backend = engine.backend
        for req in engine.scheduler.running:
            assert backend._computed[req.request_id] == req.num_computed_tokens, req.request_id
        assert set(backend._computed) == {r.request_id for r in engine.scheduler.running}

    engine = _engine("on", kv_tokens=120)
    _run(engine, 30, abort_at=5, check=check, stop=[" w33"])
    assert engine.ahead_rows > engine.ahead_used > 0
    engine.close()


def test_a_failed_launch_ahead_only_costs_the_overlap(monkeypatch):
    """A forward_ahead that raises leaves the next step to run those rows itself: same outputs."""
    expected = _run(_engine("off"), 12)
    engine = _engine("on")
    original, calls = engine.backend.forward_ahead, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) % 3 == 0:
            raise BackendError("simulated launch failure", list(args[2]))
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.backend, "forward_ahead", flaky)
    assert _run(engine, 12) == expected
    assert len(calls) >= 6 and engine.ahead_used > 0


def test_the_setting():
    assert _engine("on").lookahead and not _engine("off").lookahead
    assert _engine("auto", device_ms=1.0).lookahead  # an asynchronous device that samples there: on
    assert not _engine("auto").lookahead  # a synchronous device: nothing to overlap
    assert not _engine("auto", device="numpy", device_ms=1.0).lookahead  # host sampling: ids are not on the device
    with pytest.raises(ValueError, match="scheduler.lookahead: on needs a backend that samples on its device"):
        _engine("on", device="numpy")
    config = load_config(None, environ={}, lookahead="on")
    assert not _lookahead_on(config, NullBackend(slots=2, device="torch"), speculative=True)
    assert load_config(None, environ={}, lookahead=True).scheduler.lookahead == "on"  # YAML's bare on
    with pytest.raises(ValueError):
        load_config(None, environ={}, lookahead="sometimes")


def test_the_simulated_device_runs_launched_steps_one_after_another():
    device = SimulatedDevice()
    t0 = time.perf_counter()
    first, second = device.launch(0.03), device.launch(0.03)
    assert time.perf_counter() - t0 < 0.03  # launching does not wait
    device.wait(first)
    assert time.perf_counter() - t0 >= 0.03
    device.wait(second)
    assert time.perf_counter() - t0 >= 0.06  # the second started when the first ended
    assert device.busy_s == pytest.approx(0.06)


def test_an_asynchronous_device_gives_the_same_outputs():
    """With a simulated device the host really waits (results() after the launch): same outputs."""
    off = _run(_engine("off", device_ms=0.5), 10)
    on = _run(_engine("on", device_ms=0.5), 10)
    assert on == off
