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
    draft: list[int] | tuple = ()  # draft tokens evaluated after the sequence's last one (counted in num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: the chunks to run, plus requests that ended or were preempted while scheduling."""

    chunks: list[ScheduledChunk] = field(default_factory=list)  # in batch order (change through add / drop)
    preempted: list[Request] = field(default_factory=list)  # moved back to waiting this step
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (timeout, too long)
    # Tokens of all chunks, kept as chunks come and go: the scheduler asks once per candidate, and
    # re-summing every chunk each time was O(batch^2) per step (2 M generator steps for 64 steps at 256).
    num_tokens: int = 0

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_tokens += chunk.num_tokens

    def drop(self, request: Request) -> None:
        """Take ``request``'s chunk out (it was preempted after being scheduled)."""
        kept = [c for c in self.chunks if c.request is not request]
        if len(kept) != len(self.chunks):
            self.chunks = kept
            self.num_tokens = sum(c.num_tokens for c in kept)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
