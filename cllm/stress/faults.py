"""Fault injection: a llama_decode failure fails only the request that causes it; its batch-mates
and the requests after it succeed.

The fault is a test hook in a subclass (``FaultyLlamaCppBackend``), never in the shipped backend:
the battery passes an instance to the engine in its own process, as a user may pass any Backend.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cllm.backends.llama_cpp.backend import LlamaCppBackend
from cllm.config import CllmConfig, load_config
from cllm.engine.llm_engine import LLMEngine
from cllm.outputs import RequestOutput
from cllm.sampling.params import SamplingParams

# What llama_decode returns for an internal error (anything but 0 = ok and 1 = no KV slot).
DECODE_ERROR = -3


class FaultyLlamaCppBackend(LlamaCppBackend):
    """The llama.cpp backend, but every llama_decode of a batch holding a poisoned sequence fails."""

    name = "llama_cpp_faulty"

    def __init__(self, config: CllmConfig) -> None:
        super().__init__(config)
        self.poisoned: set[str] = set()  # sequence ids whose batches fail
        self.failed_decodes = 0  # decodes failed so far
        self._fail_this_decode = False

    def forward_batch(self, flat_ids: Sequence[int], positions: Sequence[int], sequence_ids: Sequence[str],
                      *, logits_for: Sequence[str] | None = None, all_logits_for: Sequence[str] = ()) -> np.ndarray:
        self._fail_this_decode = bool(self.poisoned.intersection(sequence_ids))
        return super().forward_batch(flat_ids, positions, sequence_ids, logits_for=logits_for,
                                     all_logits_for=all_logits_for)

    def _run_decode(self) -> int:
        if self._fail_this_decode:
            self.failed_decodes += 1
            return DECODE_ERROR
        return super()._run_decode()


@dataclass(slots=True)
class FaultResult:
    """How each request ended."""

    poisoned: str | None  # finish reason of the request whose decodes fail
    batch_mates: list[str | None]  # finish reasons of the requests sharing its batches
    after: list[str | None]  # finish reasons of the requests sent once it failed
    failed_decodes: int  # decodes the hook failed


def _run(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    raise RuntimeError("the engine did not finish")


def run_decode_fault(*, batch_mates: int = 3, after: int = 4, max_tokens: int = 8, **overrides: object) -> FaultResult:
    """One poisoned request among ``batch_mates`` others, then ``after`` clean requests."""
    config = load_config(None, n_threads=1, n_seq_max=max(batch_mates + 1, after), **overrides)
    engine = LLMEngine(config, FaultyLlamaCppBackend(config))
    backend: FaultyLlamaCppBackend = engine.backend  # type: ignore[assignment]
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        backend.poisoned.add("poisoned")
        engine.add_request("A request whose decode fails", params, request_id="poisoned")
        for i in range(batch_mates):
            engine.add_request(f"Batch mate {i} tells a story", params, request_id=f"mate-{i}")
        first = _run(engine)
        for i in range(after):
            engine.add_request(f"Later request {i} tells a story", params, request_id=f"after-{i}")
        second = _run(engine)
        return FaultResult(
            first["poisoned"].outputs[0].finish_reason,
            [first[f"mate-{i}"].outputs[0].finish_reason for i in range(batch_mates)],
            [second[f"after-{i}"].outputs[0].finish_reason for i in range(after)],
            backend.failed_decodes,
        )
    finally:
        engine.close()
