"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id}, GET …/input_items.

A Responses request becomes a chat request (responses_input.py) and runs through the shared chat
path (chat.prepare_chat / run_chat, ReplyStream): templates, role-injection safety, tools, output
constraints, reasoning split, stop handling, disconnect abort, quotas. This file only speaks the
wire format: the Response object, its output items (``reasoning``, ``message``, ``function_call``)
and the typed stream events, each with its ``sequence_number``.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, RootModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.outputs import RequestOutput
from cllm.server.chat import ChatJob, prepare_chat, run_chat
from cllm.server.errors import APIError, bad_request, reject_unsupported
from cllm.server.protocol import ChatCompletionRequest
from cllm.server.reply import NORMAL_FINISH, Reply, ReplyStream, read_reply, read_unfinished
from cllm.server.responses_input import (
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from cllm.server.responses_protocol import ResponsesRequest
from cllm.server.responses_store import ResponseStore, response_store
from cllm.server.serving import SSEFraming
from cllm.tools import ToolCall

# Request fields a Response echoes back or the store keeps (their text must be writable as UTF-8).
_ECHOED = ("input", "instructions", "metadata", "user", "tools", "tool_choice", "text", "reasoning")
# Chat field names as the Responses API spells them, for error bodies.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}


class JSONBody(RootModel[dict[str, Any]]):
    """A plain JSON object as a response body."""


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class ResponseContext:
    """One Responses request: its chat job, the conversation it continues, and the Response object's
    fields (shared by the streamed and the plain answer, which therefore agree)."""

    def __init__(self, body: ResponsesRequest, job: ChatJob, history: list[dict[str, Any]],
                 new_messages: list[dict[str, Any]], store: ResponseStore) -> None:
        self.body = body
        self.job = job
        self._history = history
        self._new = new_messages
        self._store = store

    @property
    def stored(self) -> bool:
        return self.body.store is not False

    def response(self, status: str, output: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object."""
        b, meta = self.body, self.job.meta
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return {
            "id": meta.id, "object": "response", "created_at": meta.created, "status": status, "background": False,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": b.max_tool_calls,
            "model": meta.model, "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "store": self.stored, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": b.truncation or "disabled",
            "usage": usage, "user": b.user, "metadata": b.metadata or {},
        }

    def calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        limit = self.body.max_tool_calls
        return calls if limit is None else calls[:limit]

    def finish(self, final: RequestOutput, output: list[dict[str, Any]], reply: Reply) -> dict[str, Any]:
        """The completed Response object (stored when ``store`` is not false)."""
        finish = final.outputs[0].finish_reason if final.outputs else "stop"
        incomplete = "max_output_tokens" if finish == "length" else None
        u = final.usage
        reasoning_tokens = len(self.job.model.engine.tokenizer.encode(reply.reasoning, add_special=False)) \
            if reply.reasoning else 0
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                 "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
        response = self.response("incomplete" if incomplete else "completed", output, usage=usage, incomplete=incomplete)
        if self.stored:
            answer: dict[str, Any] = {"role": "assistant", "content": reply.content}
            calls = self.calls(reply.tool_calls)
            if calls:
                answer["tool_calls"] = [c.to_openai() for c in calls]
            self._store.put(response, [*self._history, *self._new, answer], _input_items(self.body.input))
        return response


def _input_items(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(raw, str):
        return [{"id": _item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]}]
    return [{"id": _item_id("item"), **item} if "id" not in item else item for item in raw]


def build_response(ctx: ResponseContext, final: RequestOutput) -> JSONBody:
    """The non-streamed Response."""
    o = final.outputs[0]
    fmt = ctx.job.reply
    reply = read_reply(o.text, fmt) if o.finish_reason in NORMAL_FINISH else read_unfinished(o.text, fmt)
    output: list[dict[str, Any]] = []
    if reply.reasoning:
        output.append(reasoning_item(_item_id("rs"), reply.reasoning))
    calls = ctx.calls(reply.tool_calls)
    status = "incomplete" if o.finish_reason == "length" else "completed"
    if reply.content or not calls:
        output.append(message_item(_item_id("msg"), reply.content, status))
    output += [call_item(_item_id("fc"), c) for c in calls]
    return JSONBody(ctx.finish(final, output, reply))


class ResponsesFormatter:
    """The typed events of a streamed Response: ``response.created`` / ``in_progress``, then per output
    item ``output_item.added``, its content part and text deltas, ``….done`` events, and
    ``response.completed`` (``response.incomplete`` at max_output_tokens)."""

    def __init__(self, ctx: ResponseContext) -> None:
        self._ctx = ctx
        self._seq = 0
        self._reply = ReplyStream(ctx.job.reply)
        self._output: list[dict[str, Any]] = []  # items done
        self._open: dict[str, Any] | None = None  # the item whose text is streaming
        self._text = ""  # its text so far
        self._reasoning = ""  # all reasoning, for the usage's reasoning tokens
        self._content = ""  # all content
        self._done = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    def prelude(self) -> Iterable[bytes]:
        snapshot = self._ctx.response("in_progress", [])
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterable[bytes]:
        if self._done or not out.outputs:
            return
        o = out.outputs[0]
        reason = o.finish_reason if o.finish_reason in NORMAL_FINISH else None
        delta = self._reply.step(o.text_delta, reason)
        calls: list[ToolCall] = self._ctx.calls(delta.tool_calls) if reason else []
        if delta.reasoning:
            self._reasoning += delta.reasoning
            yield from self._stream_text("reasoning", delta.reasoning)
        if delta.content:
            self._content += delta.content
            yield from self._stream_text("message", delta.content)
        if reason:
            self._done = True
            yield from self._end(out, reason, calls)

    def _end(self, final: RequestOutput, reason: str, calls: list[ToolCall]) -> Iterable[bytes]:
        status = "incomplete" if reason == "length" else "completed"
        if self._open is not None and self._open["type"] == "reasoning":
            yield from self._close()
        if self._open is None and not calls and not any(i["type"] == "message" for i in self._output):
            yield from self._open_item("message")  # every reply has a message, if only an empty one
        if self._open is not None:
            yield from self._close(status)
        for call in calls:
            yield from self._call_events(call)
        reply = Reply(self._reasoning or None, self._content.strip() if calls else self._content, calls)
        response = self._ctx.finish(final, self._output, reply)
        yield self._event("response.incomplete" if status == "incomplete" else "response.completed", response=response)

    def _stream_text(self, kind: str, text: str) -> Iterable[bytes]:
        if self._open is not None and self._open["type"] != kind:
            yield from self._close()
        if self._open is None:
            yield from self._open_item(kind)
        assert self._open is not None
        self._text += text
        index = len(self._output)
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", item_id=self._open["id"], output_index=index,
                              content_index=0, delta=text)
        else:
            yield self._event("response.output_text.delta", item_id=self._open["id"], output_index=index,
                              content_index=0, delta=text, logprobs=[])

    def _open_item(self, kind: str) -> Iterable[bytes]:
        if kind == "reasoning":
            item = reasoning_item(_item_id("rs"), "", "in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(_item_id("msg"), "", "in_progress")
            item["content"] = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open, self._text = item, ""
        index = len(self._output)
        yield self._event("response.output_item.added", output_index=index, item=item)
        yield self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                          part=part)

    def _close(self, status: str = "completed") -> Iterable[bytes]:
        item, text = self._open, self._text
        assert item is not None
        index = len(self._output)
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text)
        else:
            done = message_item(item["id"], text, status)
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=done["content"][0])
        yield self._event("response.output_item.done", output_index=index, item=done)
        self._output.append(done)
        self._open, self._text = None, ""

    def _call_events(self, call: ToolCall) -> Iterable[bytes]:
        item = call_item(_item_id("fc"), call)
        index = len(self._output)
        yield self._event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"})
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=call.arguments)
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=call.name, arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def usage_chunk(self, usage: Any) -> bytes:
        return b""  # usage is part of response.completed

    def error_event(self, error: APIError) -> bytes:
        """``response.failed`` then ``error`` (which the openai client raises as an APIError)."""
        failed = self._ctx.response("failed", self._output, error={"code": error.code or error.type,
                                                                    "message": error.message})
        detail = {"type": error.type, "code": error.code, "message": error.message, "param": error.param}
        return self._event("response.failed", response=failed) + self._event(
            "error", code=error.code, message=error.message, param=error.param, error=detail)


def _history(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    if body.previous_response_id is None:
        return []
    entry = store.get(body.previous_response_id)
    if entry is None:
        raise APIError(404, f"response {body.previous_response_id!r} not found: unknown, expired, deleted, or "
                            "created with store=false", param="previous_response_id", code="response_not_found")
    return entry.history


def _chat_request(body: ResponsesRequest, convo: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request runs as (its fields were validated by ResponsesRequest)."""
    return ChatCompletionRequest.model_construct(
        model=body.model, keep_alive=body.keep_alive, messages=chat_messages(convo), tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=chat_response_format(body), max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        stop=body.stop, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, priority=body.priority, stream=body.stream,
        speculative=body.speculative,
    )


def _check_echoed(body: ResponsesRequest) -> None:
    """400 for echoed fields holding a lone surrogate (valid JSON, not valid UTF-8): the Response and
    the store give them back, and writing them would fail after the work was done."""
    for name in _ECHOED:
        value = getattr(body, name)
        if value is None:
            continue
        plain = value.model_dump() if isinstance(value, BaseModel) else value
        try:
            json.dumps(plain, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise bad_request(f"invalid {name}: holds text that is not valid Unicode (a lone surrogate)",
                              param=name) from None


async def prepare_response(body: ResponsesRequest, request: Request) -> ResponseContext:
    """Validate and render a Responses request (the conversation it continues included), ready to run
    or to count (POST /v1/responses/input_tokens)."""
    reject_unsupported(body)
    _check_echoed(body)
    store = response_store(request)
    history = _history(body, store)
    new = input_messages(body.input)
    # Instructions apply to this request only: with previous_response_id they are not carried over.
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = _chat_request(body, [*system, *history, *new])
    job = await prepare_chat(chat, request, id_prefix="resp_", params_renamed=_PARAMS)
    return ResponseContext(body, job, history, new, store)


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """Validate, admit and run one Responses request."""
    ctx = await prepare_response(body, request)
    job = ctx.job
    formatter = ResponsesFormatter(ctx)
    return await run_chat(
        request, job, wants_stream=bool(body.stream), include_usage=False, priority=body.priority,
        prompt_param="input", formatter=lambda: formatter, build=lambda finals: build_response(ctx, finals[0]),
        framing=SSEFraming(error=formatter.error_event, done=b""),
    )


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found: unknown, expired, deleted, or created with store=false",
                    param="response_id", code="response_not_found")


async def get_response(response_id: str, request: Request) -> JSONResponse:
    entry = response_store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not response_store(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(response_id: str, request: Request) -> JSONResponse:
    entry = response_store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    items = entry.input_items
    return JSONResponse({"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
                         "last_id": items[-1].get("id") if items else None, "has_more": False})
