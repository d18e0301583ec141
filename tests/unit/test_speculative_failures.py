"""Speculative decoding when a verification step goes wrong (issue 46 §7): a BackendError in the step
that verifies drafts fails only the sequence that broke it, a full KV cache there preempts and the
output stays exact, and an abort that lands while drafts are being verified ends that request alone
with nothing left held. The counting fake (t -> t + 1) makes every n-gram draft of a counting prompt
right, so verification steps come every step after the prefill."""
from __future__ import annotations

import cllm
from cllm.backends.base import BackendError, KVCacheFullError
from cllm.engine.llm_engine import LLMEngine
from tests.unit.fakes import fake_config, run_all
from tests.unit.test_speculative_parts import FlatCost, SpeculatingFake

PROMPT = list(range(64)) + list(range(10))  # the counting model goes on 10, 11, ...: n-gram drafts say so too
PARAMS = cllm.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
EXPECTED = list(range(10, 40))


class VerifyFault(SpeculatingFake):
    """Injects ``fault`` into forward passes in which ``victim`` carries draft tokens (a verification
    step): "backend" raises a BackendError every time, "kv" a KVCacheFullError once, "abort" aborts the
    victim once its pass has run (an abort that lands mid-step)."""

    def __init__(self, fault: str, victim: str) -> None:
        super().__init__(slots=4, max_batch_tokens=64)
        self.fault, self.victim = fault, victim
        self.engine: LLMEngine | None = None
        self.injected = 0
        self.aborted_output = None

    def _verifying(self, positions, sequence_ids) -> bool:
        mine = [p for p, s in zip(positions, sequence_ids) if s == self.victim]
        return len(mine) > 1 and mine[0] >= len(PROMPT)  # several tokens past the prompt: drafts

    def forward_batch(self, flat_ids, positions, sequence_ids, **kwargs):
        verifying = self._verifying(positions, sequence_ids)
        ids = sorted(set(sequence_ids))
        if verifying and self.fault == "backend":
            self.injected += 1
            raise BackendError("injected failure", ids)
        if verifying and self.fault == "kv" and not self.injected:
            self.injected += 1
            raise KVCacheFullError("no KV room", ids)
        out = super().forward_batch(flat_ids, positions, sequence_ids, **kwargs)
        if verifying and self.fault == "abort" and not self.injected:
            self.injected += 1
            self.aborted_output = self.engine.abort_request(self.victim)
        return out


def engine_with(fault: str, victim: str) -> tuple[LLMEngine, VerifyFault]:
    backend = VerifyFault(fault, victim)
    engine = LLMEngine(fake_config(n_seq_max=4, speculative="ngram", num_speculative_tokens=4), backend)
    engine.speculator.cost = FlatCost()  # drafts pay whatever this machine's timings
    backend.engine = engine
    for rid in ("a", "b"):
        engine.add_request(PROMPT, PARAMS, request_id=rid)
    return engine, backend


def assert_nothing_held(engine: LLMEngine, backend: VerifyFault) -> None:
    assert not engine.has_unfinished() and engine.scheduler.requests == {}
    assert backend.held == {} and backend.kv == {}


def test_a_backend_error_in_a_verification_step_fails_only_the_sequence_that_broke_it():
    engine, backend = engine_with("backend", victim="b")
    final = run_all(engine)
    assert backend.injected >= 2  # the batch, then "b" rerun alone
    assert final["b"].outputs[0].finish_reason == "error" and "injected failure" in final["b"].error
    assert final["a"].outputs[0].token_ids == EXPECTED and final["a"].outputs[0].finish_reason == "length"
    assert engine.speculator.stats.accepted_tokens > 0  # "a" went on verifying drafts
    assert_nothing_held(engine, backend)


def test_a_full_kv_cache_in_a_verification_step_preempts_and_the_output_stays_exact():
    engine, backend = engine_with("kv", victim="b")
    final = run_all(engine)
    assert backend.injected == 1
    assert {rid: out.outputs[0].token_ids for rid, out in final.items()} == {"a": EXPECTED, "b": EXPECTED}
    assert all(out.usage.completion_tokens == 30 for out in final.values())
    assert_nothing_held(engine, backend)


def test_an_abort_while_drafts_are_verified_ends_that_request_alone():
    engine, backend = engine_with("abort", victim="b")
    final = run_all(engine)
    aborted = backend.aborted_output
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert EXPECTED[:len(aborted.outputs[0].token_ids)] == aborted.outputs[0].token_ids  # what it had, exact
    assert "b" not in final or final["b"].outputs[0].finish_reason == "abort"
    assert final["a"].outputs[0].token_ids == EXPECTED
    assert_nothing_held(engine, backend)
    stats = engine.speculator.stats
    assert stats.emitted_tokens == stats.accepted_tokens + stats.verify_steps  # the aborted verify counted nowhere
