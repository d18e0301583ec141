"""What the engine hands back: plain dataclasses, one per concept."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cllm.tools.spec import ToolCall


@dataclass(slots=True)
class TopLogprob:
    """One alternative at a sampled position."""

    token_id: int  # vocabulary id
    token: str  # its text
    logprob: float  # log-probability under the (temperature-free) model distribution
    bytes: list[int]  # raw UTF-8 bytes of the token


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's logprob, with the top alternatives."""

    token_id: int  # sampled id
    token: str  # its text
    logprob: float  # its log-probability
    bytes: list[int]  # its raw bytes
    top: list[TopLogprob]  # the k most likely tokens (k = SamplingParams.logprobs)
    # Characters of the choice's text before this token's own text: a token that only completes part
    # of a UTF-8 character adds no text yet, so it and the next token share an offset.
    text_offset: int = 0


@dataclass(slots=True)
class Usage:
    """Token accounting, OpenAI-style, with cached prompt tokens."""

    prompt_tokens: int  # prompt length
    completion_tokens: int  # tokens generated (all choices)
    cached_tokens: int  # prompt tokens served from prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and derived latencies of one request."""

    arrival_time: float  # added to the engine
    first_scheduled_time: float | None = None  # first step that ran its tokens
    first_token_time: float | None = None  # first output token sampled
    last_token_time: float | None = None  # latest output token sampled
    finished_time: float | None = None  # reached a final status

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request (n > 1 gives several)."""

    index: int  # choice index
    text: str  # all the text (stop strings removed), once the choice has ended ("" before: see text_delta)
    token_ids: list[int]  # all output tokens: on the final output only ([] on streamed ones: see token_ids_delta)
    finish_reason: str | None  # "stop" | "length" | "abort" | "timeout" | "error"; None while running
    stop_reason: str | int | None = None  # matched stop string or stop token, if any
    logprobs: list[TokenLogprob] | None = None  # per output token, when requested: on the final output only (streamed: logprobs_delta)
    text_delta: str = ""  # text new since the previous streamed output of this choice
    token_ids_delta: list[int] = field(default_factory=list)  # tokens new since then
    logprobs_delta: list[TokenLogprob] | None = None  # logprobs new since then
    tool_calls: list[ToolCall] | None = None  # calls parsed from the final text (chat with tools; finish_reason "tool_calls")


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: streamed while running, final when ``finished``.

    Streamed outputs are deltas (each choice's ``*_delta`` fields); only the final one also holds
    each choice's whole ``token_ids`` and ``logprobs``. ``prompt_token_ids`` is shared with the
    engine's request: read it, never change it."""

    request_id: str  # engine id
    prompt: str | None  # prompt text, if given as text
    prompt_token_ids: list[int]  # tokenised prompt
    outputs: list[CompletionOutput]  # one per choice
    finished: bool  # all choices reached a final status
    usage: Usage  # token accounting so far
    metrics: RequestMetrics  # timings of the first choice
    error: str | None = None  # why the request failed, if it did
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs: one per prompt token (first None), once all are scored

    @property
    def num_cached_tokens(self) -> int:
        return self.usage.cached_tokens


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding (LLM.embed, AsyncLLM.embed, /v1/embeddings)."""

    embedding: list[float]  # the pooled final hidden state, L2-normalised (unit length, as OpenAI's)
    prompt_token_ids: list[int]  # the input's tokens (usage counts them)


def aborted_before_start(request_id: str, prompt: str | None, prompt_ids: list[int], n: int) -> RequestOutput:
    """The final output of a request aborted before it reached the engine (its grammar compiling)."""
    now = time.monotonic()
    return RequestOutput(request_id, prompt, prompt_ids, [CompletionOutput(i, "", [], "abort") for i in range(n)], True,
                         Usage(len(prompt_ids), 0, 0), RequestMetrics(now, finished_time=now))


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` carrying ``earlier``'s deltas in front of its own: what a reader that missed ``earlier``
    needs. Reuses ``earlier``'s delta lists (extended in place), so merging a long backlog one output
    at a time stays linear in the tokens; ``earlier`` must not be used afterwards."""
    for prev, choice in zip(earlier.outputs, later.outputs):
        if prev.text_delta:
            choice.text_delta = prev.text_delta + choice.text_delta
        if prev.token_ids_delta:
            prev.token_ids_delta.extend(choice.token_ids_delta)
            choice.token_ids_delta = prev.token_ids_delta
        if prev.logprobs_delta:
            prev.logprobs_delta.extend(choice.logprobs_delta or [])
            choice.logprobs_delta = prev.logprobs_delta
    return later
