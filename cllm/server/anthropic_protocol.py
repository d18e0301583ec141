"""Pydantic models of Anthropic's Messages API requests (POST /v1/messages, …/count_tokens).

Content blocks, tools and tool_choice stay plain JSON objects: ``cllm/server/anthropic_input.py``
checks them one by one, so an unsupported block is a 400 naming exactly that field
(``messages.1.content.0.type``). Unknown top-level fields are ignored (``metadata``,
``service_tier``, ``container`` …), as Anthropic's SDKs send some of them.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cllm.server.protocol import _Request


class AnthropicMessage(_Request):
    """One turn: ``content`` is a string or a list of content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ThinkingConfig(_Request):
    """``thinking``: enabled (with a token budget) or disabled. A local model thinks as its chat
    template makes it; ``disabled`` leaves thinking blocks out of the answer."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(description="most tokens to generate (required, as on Anthropic's API)")
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    # Extension (as on chat completions).
    speculative: bool | None = Field(None, description="false: no speculative decoding for this request (default: the server's setting)")
