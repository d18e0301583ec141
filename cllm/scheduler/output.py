"""What one scheduling step decided: plain data handed to the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from cllm.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """A contiguous run of one sequence's tokens evaluated this step."""

    request: Request  # whose tokens
    start: int  # position of the first token (== its num_computed_tokens)
    num_tokens: int  # how many tokens
    sample: bool  # the chunk reaches the sequence's last token, so a new token is sampled


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the chunks to run, plus requests that ended or were preempted while scheduling."""

    chunks: list[ScheduledChunk] = field(default_factory=list)  # in batch order
    preempted: list[Request] = field(default_factory=list)  # moved back to waiting this step
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (timeout, too long)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
