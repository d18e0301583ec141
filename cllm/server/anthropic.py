"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

A Messages request becomes a chat request (anthropic_input.py) and runs through the shared chat
path (chat.prepare_chat / run_chat, ReplyStream): templates, role-injection safety, tools, forced
tool use, reasoning split, stop sequences, disconnect abort, quotas. This file only speaks the wire
format: the Message object with ``thinking`` / ``text`` / ``tool_use`` blocks, and the stream's
``message_start``, ``content_block_*``, ``message_delta``, ``message_stop`` and ``ping`` events.
Errors leave in Anthropic's shape (anthropic_errors.py).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.multimodal.prompt import text_ids
from cllm.outputs import RequestOutput
from cllm.server.anthropic_errors import anthropic_error_body
from cllm.server.anthropic_input import chat_messages, chat_tool_choice, chat_tools
from cllm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from cllm.server.chat import ChatJob, plan_request, prepare_chat, render_chat, run_chat
from cllm.server.errors import APIError, bad_request
from cllm.server.images import message_contents
from cllm.server.protocol import ChatCompletionRequest
from cllm.server.reply import NORMAL_FINISH, ReplyStream, read_reply, read_unfinished
from cllm.server.responses import JSONBody
from cllm.server.serving import SSEFraming
from cllm.server.state import get_state
from cllm.tools import ToolCall

# Chat field names as the Messages API spells them, for error bodies.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def _chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request runs as (its fields were validated by MessagesRequest)."""
    choice, parallel = chat_tool_choice(body.tool_choice)
    fields: dict[str, Any] = {"model": body.model, "keep_alive": body.keep_alive, "messages": chat_messages(body), "tools": chat_tools(body.tools),
                              "tool_choice": choice, "parallel_tool_calls": parallel}
    if isinstance(body, MessagesRequest):
        fields.update(max_completion_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, stop=body.stop_sequences, stream=body.stream, speculative=body.speculative,
                      user=(body.metadata or {}).get("user_id") if isinstance((body.metadata or {}).get("user_id"), str) else None)
    return ChatCompletionRequest.model_construct(**fields)


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _tool_input(call: ToolCall) -> dict[str, Any]:
    try:
        parsed = json.loads(call.arguments)
    except json.JSONDecodeError:
        return {"arguments": call.arguments}
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


class MessageContext:
    """One Messages request: its chat job and how its reply becomes blocks and a stop reason."""

    def __init__(self, body: MessagesRequest, job: ChatJob) -> None:
        self.body = body
        self.job = job
        self.show_thinking = body.thinking is None or body.thinking.type != "disabled"

    def stop(self, o: Any, calls: list[ToolCall]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for a finished choice."""
        if calls:
            return "tool_use", None
        if o.finish_reason == "length":
            return "max_tokens", None
        if isinstance(o.stop_reason, str) and o.stop_reason in (self.body.stop_sequences or []):
            return "stop_sequence", o.stop_reason
        return "end_turn", None

    def usage(self, final: RequestOutput | None) -> dict[str, Any]:
        """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache."""
        if final is None:
            return {"input_tokens": len(text_ids(self.job.prompt)), "output_tokens": 0, "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0}
        u = final.usage
        return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, Any]) -> dict[str, Any]:
        meta = self.job.meta
        return {"id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def build_message(ctx: MessageContext, final: RequestOutput) -> JSONBody:
    """The non-streamed Message."""
    o = final.outputs[0]
    fmt = ctx.job.reply
    reply = read_reply(o.text, fmt) if o.finish_reason in NORMAL_FINISH else read_unfinished(o.text, fmt)
    blocks: list[dict[str, Any]] = []
    if reply.reasoning and ctx.show_thinking:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": _tool_use_id(c), "name": c.name, "input": _tool_input(c)}
               for c in reply.tool_calls]
    return JSONBody(ctx.message(blocks, ctx.stop(o, reply.tool_calls), ctx.usage(final)))


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n".encode()


class MessagesFormatter:
    """Anthropic's stream: ``message_start``, ``ping``, per block ``content_block_start`` / ``_delta`` /
    ``_stop`` (thinking, then text, then each tool_use), ``message_delta`` with the stop reason and
    usage, ``message_stop``; ``event: error`` on failure."""

    def __init__(self, ctx: MessageContext) -> None:
        self._ctx = ctx
        self._reply = ReplyStream(ctx.job.reply)
        self._index = -1  # index of the latest block started
        self._open: str | None = None  # type of the block streaming now
        self._done = False

    def prelude(self) -> Iterable[bytes]:
        start = self._ctx.message([], (None, None), self._ctx.usage(None))
        yield _sse("message_start", {"message": start})
        yield _sse("ping", {})

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        if self._done or not out.outputs:
            return
        o = out.outputs[0]
        reason = o.finish_reason if o.finish_reason in NORMAL_FINISH else None
        delta = self._reply.step(o.text_delta, reason)
        calls: list[ToolCall] = delta.tool_calls or []
        if delta.reasoning and self._ctx.show_thinking:
            yield from self._text("thinking", delta.reasoning)
        if delta.content:
            yield from self._text("text", delta.content)
        if reason:
            self._done = True
            yield from self._close()
            for call in calls:
                yield from self._tool_use(call)
            stop = self._ctx.stop(o, calls)
            usage = self._ctx.usage(out)
            yield _sse("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]}, "usage": usage})
            yield _sse("message_stop", {})

    def _text(self, kind: str, text: str) -> Iterable[bytes]:
        if self._open != kind:
            yield from self._close()
            self._index += 1
            self._open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            yield _sse("content_block_start", {"index": self._index, "content_block": block})
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta", "text": text}
        yield _sse("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> Iterable[bytes]:
        if self._open is None:
            return
        if self._open == "thinking":
            yield _sse("content_block_delta", {"index": self._index, "delta": {"type": "signature_delta", "signature": ""}})
        yield _sse("content_block_stop", {"index": self._index})
        self._open = None

    def _tool_use(self, call: ToolCall) -> Iterable[bytes]:
        self._index += 1
        block = {"type": "tool_use", "id": _tool_use_id(call), "name": call.name, "input": {}}
        yield _sse("content_block_start", {"index": self._index, "content_block": block})
        partial = json.dumps(_tool_input(call), ensure_ascii=False)
        yield _sse("content_block_delta", {"index": self._index, "delta": {"type": "input_json_delta", "partial_json": partial}})
        yield _sse("content_block_stop", {"index": self._index})

    def usage_chunk(self, usage: Any) -> bytes:
        return b""  # usage goes out in message_start and message_delta

    @staticmethod
    def error_event(error: APIError) -> bytes:
        body = anthropic_error_body(error.status, error.message)
        return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


async def create_message(body: MessagesRequest, request: Request) -> Response:
    """Validate, admit and run one Messages request."""
    chat = _chat_request(body)
    job = await prepare_chat(chat, request, id_prefix="msg_", params_renamed=_PARAMS)
    ctx = MessageContext(body, job)
    formatter = MessagesFormatter(ctx)
    return await run_chat(
        request, job, wants_stream=bool(body.stream), include_usage=False, prompt_param="messages",
        formatter=lambda: formatter, build=lambda finals: build_message(ctx, finals[0]),
        framing=SSEFraming(error=MessagesFormatter.error_event, done=b""),
    )


async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    """The prompt's token count as the model will see it (template, tools and system included)."""
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    chat = _chat_request(body)
    plan = plan_request(chat, model.engine, state.config.structured)
    contents = await message_contents(chat.messages, state.config.images, model.engine, model.name, request)
    prompt = await run_in_threadpool(render_chat, model.engine, chat.messages, True, plan, False, contents)
    try:
        count = len(await run_in_threadpool(model.engine.expanded_ids, prompt))
    except ValueError as err:
        raise bad_request(str(err), param="messages") from None
    return JSONResponse({"input_tokens": count})
