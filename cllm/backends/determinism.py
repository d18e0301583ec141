"""What ``model.deterministic`` promises on a backend, said at start-up (the ready block, /v1/engine).

Under the setting a request's greedy tokens and every logprob are meant to be bitwise identical
whatever else is batched with it, however its prompt is chunked, whatever part of it came from the
prefix cache, with speculation on or off, streamed or not, before or after a preemption
(docs/reproducibility.md). Each backend reaches that by its own means and knows where it cannot:
``Determinism`` carries what it changed to get there and every case it does not promise, so a user
reads the exceptions at start-up instead of finding them in their outputs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Determinism:
    """A backend's answer to ``model.deterministic``."""

    on: bool  # the setting was asked for
    how: tuple[str, ...] = ()  # what the backend changed for it ("flash attention on", "KV cache bf16", ...)
    not_promised: tuple[str, ...] = ()  # what it cannot make batch-invariant here, in words

    @property
    def promised(self) -> bool:
        return self.on and not self.not_promised

    def text(self) -> str:
        """One line for the ready block."""
        if not self.on:
            return "off (batch composition and prefix-cache hits may change results within rounding)"
        head = "bitwise, whatever the batch" if self.promised else "asked for, NOT fully promised"
        parts = [f"{head} ({'; '.join(self.how)})" if self.how else head]
        parts += [f"not promised: {reason}" for reason in self.not_promised]
        return "; ".join(parts)


OFF = Determinism(on=False)
