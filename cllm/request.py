"""Request and RequestStatus: the scheduler's unit of work."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cllm.multimodal.span import ImageSpan
from cllm.outputs import RequestMetrics, TokenLogprob
from cllm.sampling.params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_TIMEOUT = 6
    FAILED = 7

    @property
    def is_finished(self) -> bool:
        return self >= FIRST_FINAL  # a plain int: enum member lookups cost ~10x this comparison

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish_reason (vLLM's extension names for abort/timeout/error)."""
        return _FINISH_REASONS.get(self)


FIRST_FINAL = int(RequestStatus.FINISHED_STOPPED)  # statuses from here on are final
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FAILED: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` is the only progress counter: the backend's KV holds
    the first ``num_computed_tokens`` of ``all_token_ids``. Prefill, chunked
    prefill, prefix-cache hits and recompute after preemption all fall out of
    it catching up with ``num_tokens``.
    """

    request_id: str  # unique engine id
    prompt_token_ids: list[int]  # tokenised prompt
    params: SamplingParams  # sampling settings
    max_tokens: int  # resolved output cap (params.max_tokens or what the context leaves)
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)  # when added
    deadline: float | None = None  # monotonic time after which it times out
    eos_token_ids: frozenset[int] = frozenset()  # the model's end tokens
    status: RequestStatus = RequestStatus.WAITING  # lifecycle state
    output_token_ids: list[int] = field(default_factory=list)  # sampled so far
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when params.logprobs is set
    scores_prompt: bool = False  # compute prompt_logprobs (params.prompt_logprobs set; first choice only)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per prompt token scored so far (first: None)
    num_computed_tokens: int = 0  # tokens whose KV the backend holds
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    swapped_state: bytes | list[bytes] | None = None  # saved KV: bytes while swapped out, segments (Backend.import_kv) when handed over by another engine
    stop_reason: str | int | None = None  # matched stop string / token
    error: str | None = None  # failure message
    metrics: RequestMetrics = field(init=False)  # timings
    arrival_seq: int = 0  # tie-breaker: order of arrival
    stop_ids: frozenset[int] = field(init=False)  # EOS + params.stop_token_ids (what min_tokens holds back)
    mm_spans: tuple[ImageSpan, ...] = ()  # images in the prompt, in order (their placeholder ids are in prompt_token_ids)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.stop_ids = self.eos_token_ids | frozenset(self.params.stop_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and not every prompt token is scored yet."""
        return self.scores_prompt and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def fit_chunk(self, n: int) -> int:
        """``n`` prompt tokens from ``num_computed_tokens``, moved so that the chunk never splits an image:
        it stops before an image it reaches, and one starting at an image takes all of it (maybe more than
        ``n``: an image is encoded and evaluated in one step, as llama-server and vLLM do)."""
        if not self.mm_spans:
            return n
        start = self.num_computed_tokens
        end = start + n
        for span in self.mm_spans:
            if span.end <= start:
                continue
            if span.start >= end:
                break
            if span.start > start:
                return span.start - start  # text up to the image; the image starts the next chunk
            end = max(end, span.end)  # starts at (or, after a cut cache hit, inside) the image: all of it
        return end - start

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
