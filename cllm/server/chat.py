"""POST /v1/chat/completions, and the chat path every chat-shaped route shares.

The Responses and Messages routes translate their requests into a ``ChatCompletionRequest`` and run
them through the same steps as chat completions: ``prepare_chat`` (model check, tools, output
constraint, template rendering with role-injection safety, sampling params, reasoning format),
``run_chat`` (client quota, GenerationStream: backpressure, disconnect abort, stop handling) and
``ReplyStream`` (reasoning split, tool calls). Only the wire format differs per route.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cllm.config import StructuredConfig
from cllm.multimodal.prompt import MultimodalPrompt, text_ids
from cllm.outputs import RequestOutput
from cllm.sampling.params import SamplingParams
from cllm.server.access_log import access_record
from cllm.server.errors import APIError, bad_request, param_from_message, reject_unsupported
from cllm.server.fingerprint import fingerprint_of
from cllm.server.generation import GenerationStream
from cllm.server.images import message_contents
from cllm.server.logprobs import chat_logprobs
from cllm.server.protocol import (
    ChatChoice,
    ChatChunkWithUsage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FinishDelta,
    FunctionCall,
    ToolCallModel,
    UsageInfo,
)
from cllm.server.reasoning import HARMONY, parser_for_template, resolve_format
from cllm.server.reply import NORMAL_FINISH, ReplyFormat, ReplyStream, read_reply, read_unfinished
from cllm.server.sampling import build_sampling_params
from cllm.server.serving import ResponseMeta, SSEFraming, StreamFormatter, respond, total_usage
from cllm.server.state import LoadedModel, get_state
from cllm.server.streaming import TextEvents, sse_model
from cllm.server.tokens import default_max_tokens
from cllm.structured.response_format import response_format_constraint
from cllm.tools import ToolCall, ToolPlan, plan_tools

log = logging.getLogger("cllm.server")
# Tokens of the prompt's end decoded to see whether the template opened the reasoning block.
_PROMPT_TAIL_TOKENS = 8


def render_chat(engine: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None, continue_final_message: bool = False,
                contents: list[Any] | None = None) -> list[int] | MultimodalPrompt:
    """The prompt token ids for ``messages`` (content never parsed into special tokens); 400 naming
    the message for anything the template cannot take. ``plan`` brings the request's tools in;
    ``continue_final_message``: the prompt ends inside the last message, for the model to continue;
    ``contents``: each message's content with its images loaded (cllm.server.images.message_contents),
    without which a message may hold only text parts."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: continue the last "
                          "message, or start a new assistant turn", param="continue_final_message")
    plain: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        try:
            content = contents[i] if contents is not None else message.text()
        except ValueError as exc:
            raise bad_request(str(exc), param=f"messages.{i}.content") from None
        # Chat templates predate OpenAI's "developer" role; it means what "system" meant.
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        plain.append(entry)
    tools = None
    if plan is not None:
        plain = plan.prepare_messages(plain)
        tools = plan.template_tools()
    try:
        prompt = engine.tokenize_chat(plain, add_generation_prompt, tools, continue_final_message=continue_final_message)
        return prompt if isinstance(prompt, MultimodalPrompt) else list(prompt)
    except Exception as exc:  # template errors (jinja raise_exception …) are about the messages given
        log.info("chat template refused the messages: %s", exc)
        raise bad_request(f"invalid messages for this model's chat template: {exc}", param="messages") from None


# ---- the shared chat path ------------------------------------------------------------------


@dataclass(slots=True)
class ChatJob:
    """A chat-shaped request, validated and rendered, ready to run."""

    model: LoadedModel  # the served model
    prompt: list[int] | MultimodalPrompt  # rendered, tokenised conversation (with images: expanded by the engine)
    params: SamplingParams  # sampling, limits and output constraint
    reply: ReplyFormat  # how replies are read (tools, reasoning)
    meta: ResponseMeta  # id / created / model of every body and chunk


def _rename_param(exc: APIError, params: dict[str, str]) -> APIError:
    """The error with the request field spelled as the client's protocol spells it."""
    if exc.param is not None:
        head, dot, rest = exc.param.partition(".")
        if head in params:
            exc.param = params[head] + dot + rest
    return exc


async def prepare_chat(body: ChatCompletionRequest, request: Request, *, id_prefix: str = "chatcmpl-",
                       params_renamed: dict[str, str] | None = None) -> ChatJob:
    """Validate, render and resolve one chat request (APIError 4xx naming the field).
    ``params_renamed`` maps chat field names onto the calling protocol's (``max_tokens`` ->
    ``max_output_tokens`` …) in error bodies."""
    try:
        return await _prepare_chat(body, request, id_prefix)
    except APIError as exc:
        raise _rename_param(exc, params_renamed or {}) from None


async def _prepare_chat(body: ChatCompletionRequest, request: Request, id_prefix: str) -> ChatJob:
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    reject_unsupported(body)
    settings = state.config.structured
    plan = plan_request(body, model.engine, settings)
    constraint = _constraint(body, plan)
    # Jinja rendering and tokenising a large conversation take a while: off the event loop, so they do
    # not stall every other stream (issue 9 defect 17).
    # continue_final_message alone means no new turn; both given true is a 400 (render_chat)
    generation_prompt = body.add_generation_prompt if body.continue_final_message else body.add_generation_prompt is not False
    contents = await message_contents(body.messages, state.config.images, model.engine, model.name, request)
    prompt = await run_in_threadpool(render_chat, model.engine, body.messages, bool(generation_prompt), plan,
                                     bool(body.continue_final_message), contents)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(
            model.engine.tokenizer, text_ids(prompt), max_model_len=model.max_model_len, limit=model.limits.max_tokens_limit
        )
        if isinstance(prompt, MultimodalPrompt):  # its images' tokens are counted in the engine: fit there
            prompt = dataclasses.replace(prompt, fit_max_tokens=True)
    reply = _reply_format(model.engine, prompt, plan, settings, constrained=bool(constraint or body.constraint()))
    # A harmony reply's markers are control tokens: kept in its text, for ReplyStream to read the channels.
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=_logprobs_setting(body), limits=model.limits,
                                   constraint=constraint, skip_special_tokens=not reply.harmony)
    meta = ResponseMeta(id=f"{id_prefix}{uuid.uuid4().hex}", created=int(time.time()), model=model.name,
                        system_fingerprint=fingerprint_of(request))
    return ChatJob(model, prompt, params, reply, meta)


def _reply_format(engine: Any, prompt: list[int] | MultimodalPrompt, plan: ToolPlan | None, settings: StructuredConfig, *,
                  constrained: bool) -> ReplyFormat:
    """Tools and reasoning markers for reading the reply. A constrained reply (JSON schema, grammar, a
    forced call) has no reasoning block: the constraint holds from the first token. Harmony channels
    (gpt-oss) are read whether constrained or not: they are the reply's format, not a block, and a
    constrained reply without their markers reads as all content, as before."""
    tokenizer = engine.tokenizer
    detected = parser_for_template(tokenizer.chat_template, lambda: tokenizer.control_tokens)
    setting = settings.reasoning_parser
    fmt = resolve_format(detected if setting == "auto" else setting, None)
    # A harmony model's replies are read as channels whatever reasoning_parser says (none: analysis is content).
    harmony = (detected == HARMONY or (fmt is not None and fmt.harmony)
               or (plan is not None and plan.parser.name == HARMONY))
    if constrained and not harmony:
        fmt = None
    opened = False
    if fmt is not None:
        opened = fmt.opened_by(tokenizer.decode(text_ids(prompt)[-_PROMPT_TAIL_TOKENS:]))
    return ReplyFormat(plan if plan is not None and plan.active else None, fmt, opened, harmony)


async def run_chat(request: Request, job: ChatJob, *, wants_stream: bool, include_usage: bool,
                   formatter: Callable[[], StreamFormatter], build: Callable[[list[RequestOutput]], BaseModel],
                   priority: int | None = None, prompt_param: str = "messages",
                   framing: SSEFraming | None = None) -> Response:
    """Admit ``job`` under the client's quota, run it, and answer as JSON (``build``) or SSE (``formatter``)."""
    state = get_state(request)
    record = access_record(request)
    if record is not None:
        record.request_id = job.meta.id
    lease, granted = state.quota.admit(request, num_sequences=job.params.n, priority=priority)
    stream = GenerationStream(
        job.model.engine, [job.prompt], job.params, request_id=job.meta.id, priority=granted,
        metrics=state.metrics.for_model(job.model.name), record=record, prompt_param=prompt_param, lease=lease,
    )
    return await respond(
        request, stream, meta=job.meta, wants_stream=wants_stream, include_usage=include_usage,
        keepalive_s=state.config.server.sse_keepalive_s, formatter=formatter, build=build, framing=framing,
    )


# ---- chat completions ----------------------------------------------------------------------


class ChatFormatter:
    """SSE chunks for /v1/chat/completions: a role chunk per choice, then reasoning and content deltas;
    with tools, text that may be a tool call is held back and sent as ``delta.tool_calls`` fragments."""

    def __init__(self, meta: ResponseMeta, n: int, logprobs: bool, reply: ReplyFormat | None = None,
                 include_usage: bool = False) -> None:
        self._meta = meta
        self._n = n
        self._logprobs = logprobs
        # With include_usage every chunk carries "usage": null, the last one the usage.
        self._chunk_type = ChatChunkWithUsage if include_usage else ChatCompletionChunk
        self._reply = reply or ReplyFormat()
        self._replies: dict[int, ReplyStream] = {}  # choice index -> its reply so far
        self._plain = self._reply.plain  # content passes through as is
        self._content_events = TextEvents(
            lambda index, text: self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=text))]))

    def prelude(self) -> Iterable[bytes]:
        for index in range(self._n):
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield sse_model(self._chunk([choice]))

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        for o in out.outputs:
            reply = self._replies.get(o.index)
            if reply is None:
                reply = self._replies[o.index] = ReplyStream(self._reply)
            if reply.finished:
                continue
            reason = o.finish_reason if o.finish_reason in NORMAL_FINISH else None
            if reason:
                _check_forced_call(self._reply, o.text, reason)  # before anything of the reply's end goes out
            if self._plain:
                yield from self._plain_chunks(o.index, reply, o.text_delta, o.logprobs_delta, reason)
            else:
                yield from self._choice_chunks(o.index, reply, o.text_delta, o.logprobs_delta, reason)

    def _plain_chunks(self, index: int, reply: ReplyStream, text_delta: str, logprobs_delta: list | None,
                      reason: str | None) -> Iterable[bytes]:
        """No tools, no reasoning split: the delta is the content (the per-token fast path)."""
        logprobs = chat_logprobs(logprobs_delta) if self._logprobs and logprobs_delta else None
        if text_delta and logprobs is None:  # the per-token case
            yield self._content_events.render(index, text_delta)
        elif text_delta or logprobs:
            delta = DeltaMessage(content=text_delta or None)
            yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs)]))
        if reason:
            reply.finished = True
            yield self._finish_chunk(index, reason)

    def _choice_chunks(self, index: int, reply: ReplyStream, text_delta: str, logprobs_delta: list | None,
                       reason: str | None) -> Iterable[bytes]:
        delta = reply.step(text_delta, reason)
        calls: list[ToolCall] = delta.tool_calls or []
        # Held-back text (part of a UTF-8 character, a possible stop string or marker) still sends its
        # tokens' logprobs now, so streamed logprobs equal non-streamed ones token for token.
        logprobs = chat_logprobs(logprobs_delta) if self._logprobs and logprobs_delta else None
        if delta.reasoning or delta.content or logprobs:
            message = DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None)
            yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=message, logprobs=logprobs)]))
        for i, call in enumerate(calls):
            # As OpenAI: the first fragment names the call, later ones carry the arguments text.
            head = DeltaToolCall(index=i, id=call.id, type="function", function=DeltaFunctionCall(name=call.name, arguments=""))
            body = DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.arguments))
            for fragment in (head, body):
                yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(tool_calls=[fragment]))]))
        if reason:
            yield self._finish_chunk(index, "tool_calls" if calls else reason)

    def _finish_chunk(self, index: int, reason: str) -> bytes:
        """The finish in a chunk of its own with an empty delta, as OpenAI ends every choice: a client
        that stops reading at the finish_reason has had all of the text by then."""
        return sse_model(self._chunk([ChatStreamChoice(index=index, delta=FinishDelta(), finish_reason=reason)]))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse_model(self._chunk([], usage))

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        m = self._meta
        return self._chunk_type(id=m.id, created=m.created, model=m.model, system_fingerprint=m.system_fingerprint,
                                choices=choices, usage=usage)


def build_chat(meta: ResponseMeta, final: RequestOutput, logprobs: bool, reply: ReplyFormat | None = None) -> ChatCompletionResponse:
    """The non-streaming response body (reasoning and tool calls read out of the text)."""
    fmt = reply or ReplyFormat()
    choices = []
    for o in final.outputs:
        finish = o.finish_reason
        if finish in NORMAL_FINISH:
            _check_forced_call(fmt, o.text, finish)
            parsed = read_reply(o.text, fmt)
            finish = "tool_calls" if parsed.tool_calls else finish
        else:
            parsed = read_unfinished(o.text, fmt)
        message = _message(parsed.content, parsed.tool_calls, parsed.reasoning)
        choices.append(ChatChoice(index=o.index, message=message,
                                  logprobs=chat_logprobs(o.logprobs or []) if logprobs else None, finish_reason=finish))
    return ChatCompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.system_fingerprint,
        choices=choices, usage=total_usage([final]),
    )


def _check_forced_call(fmt: ReplyFormat, text: str, finish: str) -> None:
    """A forced call (tool_choice required or a named function) comes back as a call or as this error,
    which says what cut it short (max_tokens, or the request's own stop strings): never as plain text
    with finish_reason "stop" (issue 27 item 3)."""
    plan = fmt.plan
    if plan is None:
        return
    reason = plan.missing_call(text, finish)
    if reason is not None:
        raise bad_request(reason, param="max_tokens" if finish == "length" else "stop", code="tool_call_incomplete")


def _message(text: str, calls: list[ToolCall] | None, reasoning: str | None = None) -> ChatResponseMessage:
    if not calls:
        return ChatResponseMessage(content=text, reasoning_content=reasoning)
    models = [ToolCallModel(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return ChatResponseMessage(content=text or None, tool_calls=models, reasoning_content=reasoning)


def plan_request(body: ChatCompletionRequest, engine: Any, settings: StructuredConfig) -> ToolPlan | None:
    try:
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, engine.tokenizer.chat_template,
                          settings.tool_call_parser, settings.max_parallel_tool_calls)
    except ValueError as exc:
        raise bad_request(str(exc), param=param_from_message(str(exc)) or "tools") from None


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, Any]:
    """Output-constraint fields from response_format or a forced (required / named) tool call."""
    try:
        fmt = response_format_constraint(body.response_format.model_dump() if body.response_format else None)
    except ValueError as exc:
        raise bad_request(str(exc), param="response_format") from None
    forced = plan.forced_schema() if plan is not None else None
    if forced is None:
        return fmt
    if fmt:
        raise bad_request("response_format cannot be combined with a forced tool call (tool_choice required or a "
                          "named function)", param="response_format")
    return {"json_schema": forced}


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """Validate, admit and run one chat request."""
    job = await prepare_chat(body, request)
    wants_logprobs = bool(body.logprobs)
    n = job.params.n
    return await run_chat(
        request, job, wants_stream=body.wants_stream, include_usage=body.include_usage, priority=body.priority,
        formatter=lambda: ChatFormatter(job.meta, n, wants_logprobs, job.reply, include_usage=body.include_usage),
        build=lambda finals: build_chat(job.meta, finals[0], wants_logprobs, job.reply),
    )
