"""RequestSnapshot: everything besides the KV that another engine needs to continue a sequence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cllm.outputs import TokenLogprob
from cllm.sampling.params import SamplingParams


@dataclass(slots=True)
class RequestSnapshot:
    """One single-choice request, frozen between two engine steps.

    Times are ages (seconds before the export), not clock readings: monotonic
    clocks of two processes or machines share no origin.
    """

    request_id: str  # the request's id, kept on the receiving engine
    prompt: str | None  # prompt text, when the request was given text
    prompt_token_ids: list[int]  # tokenised prompt
    output_token_ids: list[int]  # tokens sampled so far
    params: SamplingParams  # sampling settings
    max_tokens: int  # resolved output cap
    num_computed_tokens: int  # leading tokens whose KV travels with the snapshot (0: none, recompute)
    rng_state: dict[str, Any]  # the request's numpy bit-generator state: a seeded sample continues its stream
    backend: str  # backend that produced the KV; another backend cannot import it
    model: str  # model identity (file name and size); another model cannot import it
    priority: int = 0  # scheduling priority
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    scores_prompt: bool = False  # the request scores its prompt (params.prompt_logprobs)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # prompt tokens scored so far
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission (usage reporting)
    age_s: float = 0.0  # seconds since arrival
    first_token_age_s: float | None = None  # seconds since the first token, if one came
    timeout_left_s: float | None = None  # seconds left before the request's deadline

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
