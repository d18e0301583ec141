"""Pydantic models of the OpenAI HTTP API (requests, responses, stream chunks).

Requests validate strictly (``"n": "2"`` or ``"stream": "yes"`` are type
errors, as on api.openai.com) but ignore fields we do not know, so clients that
send extra OpenAI fields keep working; fields we know and cannot honour (legacy
``functions``, suffix …) are listed by ``unsupported()`` and refused with 400.
Values are range-checked where they become SamplingParams, which names the bad
parameter.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


class StreamOptions(_Request):
    """``stream_options``: ask for a final usage chunk."""

    include_usage: bool | None = None


class GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (None = default)."""

    model: str | None = None
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = None
    # Extensions (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = Field(None, description="false: no speculative decoding for this request (default: the server's setting)")
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = Field(None, description="lower runs first under the priority scheduling policy")
    # Constrained decoding: llama-server's `grammar` (GBNF) and vLLM's guided_* names.
    grammar: str | None = Field(None, description="GBNF grammar the output must match (llama-server's field)")
    guided_json: dict[str, Any] | str | None = Field(None, description="JSON Schema the output must match")
    guided_regex: str | None = Field(None, description="regular expression the output must match")
    guided_choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    guided_grammar: str | None = Field(None, description="same as grammar")

    def constraint(self) -> dict[str, Any]:
        """SamplingParams constraint fields this request sets itself (several: SamplingParams refuses)."""
        grammar = self.grammar if self.grammar is not None else self.guided_grammar  # two names, one field
        fields = {"grammar": grammar, "json_schema": self.guided_json, "regex": self.guided_regex,
                  "choice": self.guided_choice}
        return {k: v for k, v in fields.items() if v is not None}

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for the first field set to something this server cannot do."""
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of", "best_of is not supported (only best_of == n)"
        return None

    @property
    def wants_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().unsupported()


class ContentPart(_Request):
    """One part of a message's content: ``{"type": "text", "text"}`` or ``{"type": "image_url",
    "image_url": {"url", "detail"}}`` (or the URL itself, as some clients send it); parts are checked
    by cllm.multimodal.content, which names the bad one."""

    type: str
    text: str | None = None
    image_url: Any = None  # checked by cllm.multimodal.content, which names the part (a union here would not)
    # How errors name this part when the request came in another protocol (Responses' input[0].content[1],
    # Messages' messages.0.content.1); None = messages.I.content.J. Not a request field: set by the converters.
    _where: str | None = PrivateAttr(None)

    def plain(self) -> dict[str, Any]:
        """The part as cllm.multimodal.content parses it."""
        return {"type": self.type, "text": self.text, "image_url": self.image_url}


TextContentPart = ContentPart  # the name before image parts


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); ValueError for non-text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part of type {part.type!r} is not supported (text only)")
        return "".join(part.text or "" for part in self.content)

    def parts(self, index: int) -> list[tuple[str, dict[str, Any]]]:
        """(where, part) for each content part (list content only), ``where`` as errors name it."""
        if not isinstance(self.content, list):
            return []
        return [(part._where or f"messages.{index}.content.{j}", part.plain()) for j, part in enumerate(self.content)]


class ResponseFormat(_Request):
    """``response_format``: text, json_object, or json_schema (``{"name", "schema", "strict"}``)."""

    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None  # vLLM: the prompt ends inside the last message (assistant prefill)

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions or self.function_call not in (None, "none", "auto"):
            return "functions", "the deprecated functions / function_call fields are not supported: use tools / tool_choice"
        if self.response_format is not None and self.response_format.type not in ("text", "json_object", "json_schema"):
            return "response_format", f"response_format type {self.response_format.type!r} is not supported (text, json_object, json_schema)"
        return super().unsupported()


class TokenizeRequest(_Request):
    """POST /tokenize: exactly one of ``prompt`` or ``messages`` (vLLM's body) or ``content``
    (llama-server's, whose ``add_special`` defaults to false as there)."""

    model: str | None = None
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    content: str | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None  # llama-server's name for add_special_tokens
    add_generation_prompt: bool | None = None
    with_pieces: bool | None = None  # llama-server: each token as {"id", "piece"}

    def input_error(self) -> tuple[str, str] | None:
        """(param, why) when the inputs contradict each other (checked by the route, which names the field)."""
        given = [name for name in ("prompt", "messages", "content") if getattr(self, name) is not None]
        if len(given) != 1:
            return (given[1] if given else "prompt"), f"give exactly one of 'prompt', 'messages' or 'content' (got {given or 'none'})"
        if None not in (self.add_special, self.add_special_tokens) and self.add_special != self.add_special_tokens:
            return "add_special", "add_special and add_special_tokens disagree: they are one setting, give one of them"
        return None

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    @property
    def adds_special(self) -> bool:
        """Whether BOS and the like are added: as asked, else vLLM's default (yes) for ``prompt`` and
        llama-server's (no) for ``content``."""
        asked = self.add_special_tokens if self.add_special_tokens is not None else self.add_special
        return asked if asked is not None else self.content is None


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


def _unset(value: Any) -> bool:
    return value is None


def _optional(description: str | None = None) -> Any:
    """A field the OpenAI spec marks optional: left out of the JSON while None. Every other field is
    always sent, null included: clients index ``choice["finish_reason"]`` or ``choice["logprobs"]`` in
    every chunk (issue 46 §5), so nullable-but-required means null, not absent. (``exclude_if`` is
    checked in pydantic's core: a wrap serializer tripled the cost of a chunk.)"""
    return Field(None, exclude_if=_unset, description=description)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(_Response):
    """Legacy completions logprobs: parallel lists, one entry per token (with echo: prompt tokens first,
    the first of them null, as it has no context)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Response):
    """A /v1/completions body, and (object ``text_completion`` too, as OpenAI) each of its stream chunks:
    ``usage`` is left out of a chunk unless the client asked for it (``CompletionChunkWithUsage``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = _optional()


class CompletionChunkWithUsage(CompletionResponse):
    """A chunk of a stream with ``stream_options.include_usage``: ``"usage": null`` in every chunk but the
    last, as OpenAI sends it."""

    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCallModel(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallModel] | None = None
    reasoning_content: str | None = None  # the model's reasoning, split from content (vLLM / llama-server name)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(_Response):
    name: str | None = _optional()
    arguments: str | None = _optional()


class DeltaToolCall(_Response):
    """A fragment of a streamed tool call; fragments with the same index concatenate."""

    index: int
    id: str | None = _optional()
    type: Literal["function"] | None = _optional()
    function: DeltaFunctionCall | None = _optional()


class DeltaMessage(_Response):
    """What a chunk adds to a choice's message. ``content`` is always sent (null in a chunk of reasoning,
    logprobs or a call): clients read ``delta["content"]`` in every chunk until the finish (llama.cpp's
    server tests do); the other fields only when set."""

    role: Literal["assistant"] | None = _optional()
    content: str | None = None
    reasoning_content: str | None = _optional()
    tool_calls: list[DeltaToolCall] | None = _optional()


class FinishDelta(_Response):
    """The delta of the chunk that ends a choice: ``{}``, as OpenAI's (the finish carries no text)."""


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage | FinishDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """A streamed chat chunk: ``usage`` is left out unless the client asked for it (``ChatChunkWithUsage``)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = _optional()


class ChatChunkWithUsage(ChatCompletionChunk):
    """A chunk of a stream with ``stream_options.include_usage``: ``"usage": null`` in every chunk but the
    last, as OpenAI sends it."""

    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "cllm"
    max_model_len: int | None = None  # known while the model is loaded
    root: str | None = None  # the model's primary name (an alias card's root differs from its id)
    status: Literal["loaded", "loading", "unloaded", "unloading", "failed"] | None = None
    loaded: bool | None = None
    backend: str | None = None  # llama_cpp or torch


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenPiece(_Response):
    """A token with its text (llama-server's ``with_pieces``): ``piece`` is a string when the token's
    bytes are valid UTF-8 on their own, else the list of its byte values."""

    id: int
    piece: str | list[int]


class TokenizeResponse(_Response):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str  # vLLM's name
    content: str  # llama-server's name for the same text
