"""POST /v1/chat/completions/input_tokens and /v1/responses/input_tokens: a prompt's token count,
answered without generating.

The body is the generation request's own, and it goes through the same preparation (model check,
tools, output constraint, template, previous_response_id), so the count is the length of exactly
the prompt ids that request would run, and a body the generation route would refuse is refused here
with the same 4xx naming the field. Nothing is admitted or queued. The answer is OpenAI's
``{"object": "response.input_tokens", "input_tokens": N}``; chat, which OpenAI has no counting
route for, answers the same shape with ``"object": "chat.completion.input_tokens"``.
"""
from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from cllm.server.chat import prepare_chat
from cllm.server.errors import bad_request
from cllm.server.protocol import ChatCompletionRequest
from cllm.server.responses import prepare_response
from cllm.server.responses_protocol import ResponsesRequest


def _count(obj: str, num_tokens: int) -> JSONResponse:
    return JSONResponse({"object": obj, "input_tokens": num_tokens})


async def chat_input_tokens(body: ChatCompletionRequest, request: Request) -> JSONResponse:
    """The prompt tokens of a chat completions request (template, tools and system included)."""
    job = await prepare_chat(body, request)
    return _count("chat.completion.input_tokens", await prompt_tokens(job))


async def response_input_tokens(body: ResponsesRequest, request: Request) -> JSONResponse:
    """The input tokens of a Responses request (instructions and the conversation it continues included)."""
    ctx = await prepare_response(body, request)
    return _count("response.input_tokens", await prompt_tokens(ctx.job))


async def prompt_tokens(job: Any) -> int:
    """The job's prompt tokens, an image's included (expanded by the engine: 400 where it cannot)."""
    try:
        return len(await run_in_threadpool(job.model.engine.expanded_ids, job.prompt))
    except ValueError as err:
        raise bad_request(str(err), param="messages") from None
