"""Pydantic models of OpenAI's Responses API requests (POST /v1/responses).

Input items and tools stay plain JSON objects here: ``cllm/server/responses_input.py`` checks them
one by one, so an unsupported item type or content part is a 400 naming exactly that field
(``input[2].content[0].type``), as the issue asks, rather than a union-validation error listing
every branch. Unknown top-level fields are ignored (clients send ``include``, ``prompt_cache_key`` …).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cllm.server.protocol import _Request


class ResponseTextFormat(_Request):
    """``text.format``: text, json_object, or json_schema (name, schema, strict at this level)."""

    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseTextConfig(_Request):
    """``text``: the output format (and verbosity, which only steers OpenAI's own models)."""

    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponseReasoningConfig(_Request):
    """``reasoning``: accepted; a local model reasons as its chat template makes it."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = None
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: ResponseTextConfig | None = None
    reasoning: ResponseReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extensions (vLLM / llama-server names), as on chat completions.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = Field(None, description="lower runs first under the priority scheduling policy")
    speculative: bool | None = Field(None, description="false: no speculative decoding for this request (default: the server's setting)")

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for the first field set to something this server cannot do."""
        if self.background:
            return "background", "background responses are not supported: use stream or a plain request"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported on /v1/responses (use /v1/chat/completions logprobs)"
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            return "max_tool_calls", f"invalid max_tool_calls={self.max_tool_calls}: must be at least 1"
        return None
