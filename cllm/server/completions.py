"""POST /v1/completions: text (or token) prompts, one or a batch, n choices each."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cllm.backends.base import Tokenizer
from cllm.engine.prompt_ids import INLINE_PROMPT_LEN
from cllm.outputs import RequestOutput
from cllm.server.access_log import access_record
from cllm.server.errors import bad_request, reject_unsupported
from cllm.server.generation import GenerationStream, Prompt
from cllm.server.echo import echo_of
from cllm.server.logprobs import completion_logprobs, concat_logprobs
from cllm.server.fingerprint import fingerprint_of
from cllm.server.protocol import (
    CompletionChoice,
    CompletionChunkWithUsage,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from cllm.server.sampling import build_sampling_params
from cllm.server.serving import ResponseMeta, respond, total_usage
from cllm.server.state import get_state
from cllm.server.streaming import TextEvents, sse_model

# Prompts in one batched request; each becomes its own engine request.
MAX_PROMPTS = 128
# Legacy completions default when max_tokens is omitted (as on api.openai.com).
DEFAULT_MAX_TOKENS = 16
_NORMAL_FINISH = ("stop", "length")


def _check_tokens(tokens: list[int], vocab_size: int) -> list[int]:
    if not tokens:
        raise bad_request("a token prompt must not be empty", param="prompt")
    if min(tokens) >= 0 and max(tokens) < vocab_size:  # (C-speed; the list of bad ids only for the error)
        return list(tokens)
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"invalid prompt token ids {bad[:8]}: must be in [0, {vocab_size})", param="prompt")
    return list(tokens)


def prompts_of(prompt: str | list[str] | list[int] | list[list[int]], vocab_size: int) -> list[Prompt]:
    """The request's prompt field as a list of engine prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [_check_tokens(prompt, vocab_size)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"too many prompts ({len(prompt)}): at most {MAX_PROMPTS} per request", param="prompt")
    return [p if isinstance(p, str) else _check_tokens(p, vocab_size) for p in prompt]  # type: ignore[misc]


@dataclass(slots=True, frozen=True)
class EchoSpec:
    """How a request with ``echo: true`` echoes its prompts."""

    tokenizer: Tokenizer  # decodes token prompts and the null-logprob first token
    logprobs: int | None  # the request's logprobs (None: echo the text only)


class CompletionFormatter:
    """SSE chunks for /v1/completions; one chunk per choice with news."""

    def __init__(self, meta: ResponseMeta, n: int, logprobs: bool, echo: EchoSpec | None = None,
                 include_usage: bool = False) -> None:
        self._meta = meta
        # With include_usage every chunk carries "usage": null, the last one the usage.
        self._chunk_type = CompletionChunkWithUsage if include_usage else CompletionResponse
        self._n = n
        self._logprobs = logprobs
        self._echo = echo
        self._echo_chars: dict[int, int] = {}  # choice index -> length of its echoed prompt (sent in its first chunk)
        self._finished: set[int] = set()  # choices whose finish_reason was sent
        self._text_events = TextEvents(lambda index, text: self._chunk([CompletionChoice(index=index, text=text)]))

    def prelude(self) -> Iterable[bytes]:
        return ()

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        for o in out.outputs:
            index = prompt_index * self._n + o.index
            reason = o.finish_reason if o.finish_reason in _NORMAL_FINISH and index not in self._finished else None
            logprobs = completion_logprobs(o.logprobs_delta) if self._logprobs and o.logprobs_delta else None
            # A token whose text is held back (part of a UTF-8 character, a possible stop string) still
            # sends its logprob now, so streamed logprobs equal non-streamed ones token for token.
            if not (o.text_delta or reason or logprobs):
                continue
            echo_due = self._echo is not None and index not in self._echo_chars
            if o.text_delta or logprobs or echo_due:
                yield self._text_chunk(out, index, o.text_delta, logprobs)
            if reason:
                # The finish in a chunk of its own (text "", logprobs null), as OpenAI ends a choice.
                self._finished.add(index)
                yield sse_model(self._chunk([CompletionChoice(index=index, text="", finish_reason=reason)]))

    def _text_chunk(self, out: RequestOutput, index: int, text: str, logprobs: CompletionLogprobs | None) -> bytes:
        """A choice's new text and logprobs (its first chunk with the echoed prompt ahead of them)."""
        prefix = ""
        if self._echo is not None and index not in self._echo_chars:
            echo = echo_of(out, self._echo.tokenizer, logprobs=self._echo.logprobs)
            prefix = echo.text
            self._echo_chars[index] = len(prefix)
            if echo.logprobs is not None:
                logprobs = concat_logprobs(echo.logprobs, logprobs or completion_logprobs([]), shift=len(prefix))
        elif logprobs is not None and index in self._echo_chars:  # output offsets count the echoed prompt
            logprobs = concat_logprobs(completion_logprobs([]), logprobs, shift=self._echo_chars[index])
        elif logprobs is None:  # text alone, the per-token case
            return self._text_events.render(index, text)
        return sse_model(self._chunk([CompletionChoice(index=index, text=prefix + text, logprobs=logprobs)]))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse_model(self._chunk([], usage))

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        m = self._meta
        return self._chunk_type(id=m.id, created=m.created, model=m.model, system_fingerprint=m.system_fingerprint,
                                choices=choices, usage=usage)


def build_completion(meta: ResponseMeta, finals: list[RequestOutput], n: int, logprobs: bool,
                     echo: EchoSpec | None = None) -> CompletionResponse:
    """The non-streaming response body."""
    choices = []
    for p, final in enumerate(finals):
        echoed = echo_of(final, echo.tokenizer, logprobs=echo.logprobs) if echo is not None else None
        for o in final.outputs:
            lp = completion_logprobs(o.logprobs or []) if logprobs else None
            if echoed is not None and echoed.logprobs is not None:
                lp = concat_logprobs(echoed.logprobs, lp or completion_logprobs([]), shift=len(echoed.text))
            text = o.text if echoed is None else echoed.text + o.text
            choices.append(CompletionChoice(index=p * n + o.index, text=text, logprobs=lp, finish_reason=o.finish_reason))
    return CompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
        choices=choices, usage=total_usage(finals),
    )


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Validate, admit and run one completions request."""
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    reject_unsupported(body)
    # Checking a long token-id prompt is a Python loop over it: off the event loop (issue 9 defect 17);
    # a text or a short one is checked at once (the thread's round trip costs more than the check).
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int) and len(prompt) <= INLINE_PROMPT_LEN):
        prompts = prompts_of(prompt, model.limits.vocab_size)
    else:
        prompts = await run_in_threadpool(prompts_of, prompt, model.limits.vocab_size)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    # echo scores the prompt; max_tokens=0 with echo (score only) needs prompt logprobs even without logprobs.
    prompt_logprobs = None
    if body.echo:
        prompt_logprobs = body.logprobs if body.logprobs is not None else (0 if max_tokens == 0 else None)
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, limits=model.limits,
                                   prompt_logprobs=prompt_logprobs)
    meta = ResponseMeta(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model.name,
                        system_fingerprint=fingerprint_of(request))
    record = access_record(request)
    if record is not None:
        record.request_id = meta.id
    lease, priority = state.quota.admit(request, num_sequences=len(prompts) * params.n, priority=body.priority,
                                        param="n" if params.n > 1 else "prompt")
    stream = GenerationStream(
        model.engine, prompts, params, request_id=meta.id, priority=priority,
        metrics=state.metrics.for_model(model.name), record=record, prompt_param="prompt", lease=lease,
    )
    wants_logprobs = body.logprobs is not None
    echo = EchoSpec(model.engine.tokenizer, body.logprobs) if body.echo else None
    return await respond(
        request, stream, meta=meta, wants_stream=body.wants_stream, include_usage=body.include_usage,
        keepalive_s=state.config.server.sse_keepalive_s,
        formatter=lambda: CompletionFormatter(meta, params.n, wants_logprobs, echo, include_usage=body.include_usage),
        build=lambda finals: build_completion(meta, finals, params.n, wants_logprobs, echo),
    )
