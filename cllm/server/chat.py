"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cllm.config import StructuredConfig
from cllm.engine.chat_request import attach_tool_calls
from cllm.outputs import RequestOutput
from cllm.server.access_log import access_record
from cllm.server.errors import bad_request, param_from_message, reject_unsupported
from cllm.server.generation import GenerationStream
from cllm.server.logprobs import chat_logprobs
from cllm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallModel,
    UsageInfo,
)
from cllm.server.sampling import build_sampling_params
from cllm.server.serving import ResponseMeta, respond, total_usage
from cllm.server.state import get_state
from cllm.server.streaming import sse_model
from cllm.server.tokens import default_max_tokens
from cllm.structured.response_format import response_format_constraint
from cllm.tools import ToolCall, ToolPlan, plan_tools
from cllm.tools.stream import ToolCallStream

log = logging.getLogger("cllm.server")
_NORMAL_FINISH = ("stop", "length")


def render_chat(engine: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                plan: ToolPlan | None = None) -> list[int]:
    """The prompt token ids for ``messages`` (content never parsed into special tokens); 400 naming
    the message for anything the template cannot take. ``plan`` brings the request's tools in."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    plain: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        try:
            text = message.text()
        except ValueError as exc:
            raise bad_request(str(exc), param=f"messages.{i}.content") from None
        # Chat templates predate OpenAI's "developer" role; it means what "system" meant.
        entry = {"role": "system" if message.role == "developer" else message.role, "content": text}
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
        return list(engine.tokenize_chat(plain, add_generation_prompt, tools))
    except Exception as exc:  # template errors (jinja raise_exception …) are about the messages given
        log.info("chat template refused the messages: %s", exc)
        raise bad_request(f"invalid messages for this model's chat template: {exc}", param="messages") from None


class ChatFormatter:
    """SSE chunks for /v1/chat/completions: a role chunk per choice, then content deltas; with
    tools, text that may be a tool call is held back and sent as ``delta.tool_calls`` fragments."""

    def __init__(self, meta: ResponseMeta, n: int, logprobs: bool, plan: ToolPlan | None = None) -> None:
        self._meta = meta
        self._n = n
        self._logprobs = logprobs
        self._finished: set[int] = set()  # choices whose finish_reason was sent
        self._plan = plan if plan is not None and plan.active else None
        self._tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its held-back text

    def prelude(self) -> Iterable[bytes]:
        for index in range(self._n):
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield sse_model(self._chunk([choice]))

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        for o in out.outputs:
            reason = o.finish_reason if o.finish_reason in _NORMAL_FINISH and o.index not in self._finished else None
            if self._plan is not None:
                yield from self._tool_chunks(o.index, o.text_delta, o.logprobs_delta, reason)
                continue
            logprobs = chat_logprobs(o.logprobs_delta) if self._logprobs and o.logprobs_delta else None
            # Held-back text (part of a UTF-8 character, a possible stop string) still sends its tokens'
            # logprobs now, so streamed logprobs equal non-streamed ones token for token.
            if not (o.text_delta or reason or logprobs):
                continue
            if reason:
                self._finished.add(o.index)
            delta = DeltaMessage(content=o.text_delta) if o.text_delta else DeltaMessage()
            choice = ChatStreamChoice(index=o.index, delta=delta, logprobs=logprobs, finish_reason=reason)
            yield sse_model(self._chunk([choice]))

    def _tool_chunks(self, index: int, text_delta: str, logprobs_delta: list | None, reason: str | None) -> Iterable[bytes]:
        stream = self._tool_streams.setdefault(index, ToolCallStream(self._plan))  # type: ignore[arg-type]
        content = stream.feed(text_delta)
        calls = []
        if reason:
            self._finished.add(index)
            rest, calls = stream.finish()
            content += rest
        logprobs = chat_logprobs(logprobs_delta) if self._logprobs and logprobs_delta else None
        if content or logprobs:
            delta = DeltaMessage(content=content) if content else DeltaMessage()
            yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs)]))
        for i, call in enumerate(calls):
            # As OpenAI: the first fragment names the call, later ones carry the arguments text.
            head = DeltaToolCall(index=i, id=call.id, type="function", function=DeltaFunctionCall(name=call.name, arguments=""))
            body = DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.arguments))
            for fragment in (head, body):
                yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(tool_calls=[fragment]))]))
        if reason:
            final = "tool_calls" if calls else reason
            yield sse_model(self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(), finish_reason=final)]))

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        return sse_model(self._chunk([], usage))

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        m = self._meta
        return ChatCompletionChunk(id=m.id, created=m.created, model=m.model, choices=choices, usage=usage)


def build_chat(meta: ResponseMeta, final: RequestOutput, logprobs: bool, plan: ToolPlan | None = None) -> ChatCompletionResponse:
    """The non-streaming response body (tool calls parsed out of the text when tools are on)."""
    final = attach_tool_calls(final, plan)
    choices = [
        ChatChoice(
            index=o.index,
            message=_message(o.text, o.tool_calls),
            logprobs=chat_logprobs(o.logprobs or []) if logprobs else None,
            finish_reason=o.finish_reason,
        )
        for o in final.outputs
    ]
    return ChatCompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=total_usage([final])
    )


def _message(text: str, calls: list[ToolCall] | None) -> ChatResponseMessage:
    if not calls:
        return ChatResponseMessage(content=text)
    models = [ToolCallModel(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
    return ChatResponseMessage(content=text or None, tool_calls=models)


def _plan(body: ChatCompletionRequest, engine: Any, settings: StructuredConfig) -> ToolPlan | None:
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
    state = get_state(request)
    model = state.require_ready()
    state.check_model(body.model)
    reject_unsupported(body)
    # Jinja rendering and tokenising a large conversation take a while: off the event loop, so they do
    # not stall every other stream (issue 9 defect 17).
    plan = _plan(body, model.engine, state.config.structured)
    constraint = _constraint(body, plan)
    prompt = await run_in_threadpool(render_chat, model.engine, body.messages, body.add_generation_prompt is not False, plan)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(
            model.engine.tokenizer, prompt, max_model_len=model.max_model_len, limit=model.limits.max_tokens_limit
        )
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=_logprobs_setting(body), limits=model.limits,
                                   constraint=constraint)
    meta = ResponseMeta(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model.name)
    record = access_record(request)
    if record is not None:
        record.request_id = meta.id
    lease, priority = state.quota.admit(request, num_sequences=params.n, priority=body.priority)
    stream = GenerationStream(
        model.engine, [prompt], params, request_id=meta.id, priority=priority,
        metrics=state.metrics, record=record, prompt_param="messages", lease=lease,
    )
    wants_logprobs = bool(body.logprobs)
    return await respond(
        request, stream, meta=meta, wants_stream=body.wants_stream, include_usage=body.include_usage,
        keepalive_s=state.config.server.sse_keepalive_s,
        formatter=lambda: ChatFormatter(meta, params.n, wants_logprobs, plan),
        build=lambda finals: build_chat(meta, finals[0], wants_logprobs, plan),
    )
