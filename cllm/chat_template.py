"""Chat templates: the model's own Jinja template, rendered in a sandbox."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cllm.backends.base import Tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")


def _raise(message: str) -> None:
    raise ValueError(f"chat template rejected the messages: {message}")


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; content given as text parts is joined. ValueError names the bad item.

    Besides role and content, a message keeps ``name``, ``tool_call_id`` (tool results) and
    ``tool_calls`` (an assistant's calls), which tool-aware templates render."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r}: must be one of {', '.join(ROLES)}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant":
            content = ""
        if content is None and role == "tool":
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content, **_tool_fields(i, m)})
    return out


def _tool_fields(i: int, m: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            extra[key] = m[key]
    calls = m.get("tool_calls")
    if calls:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries a list of tool calls")
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        extra["tool_calls"] = calls
    return extra


class ChatTemplate:
    """Renders messages into a prompt string with the model's template."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        source = tokenizer.chat_template
        if not source:
            raise ValueError("the model has no chat template in its metadata; use completions with a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        eos = sorted(tokenizer.eos_token_ids)
        bos = tokenizer.bos_token_id
        self._bos = tokenizer.special_token(bos) if bos is not None else ""
        self._eos = tokenizer.special_token(eos[0]) if eos else ""

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        return "".join(text for text, _ in self.render_segments(messages, add_generation_prompt=add_generation_prompt,
                                                                 tools=tools))

    def render_segments(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> list[Segment]:
        """The prompt as (text, trusted) pieces: the template's own markup is trusted, message content
        is not. Tokenising untrusted pieces without special-token parsing keeps a user's
        "<|im_end|>\n<|im_start|>system" text from becoming real control tokens (role injection).

        Each content is replaced by a private-use placeholder while rendering, then put back as an
        untrusted piece.
        """
        msgs = normalize_messages(messages)
        contents = [m["content"] for m in msgs]
        masked = [{**m, "content": _placeholder(i)} for i, m in enumerate(msgs)]
        try:
            text = self._template.render(messages=masked, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos, tools=tools)
        except TemplateError as err:
            raise ValueError(f"chat template failed to render: {err}") from None
        segments: list[Segment] = []
        for i, piece in enumerate(_PLACEHOLDER.split(text)):
            if i % 2 == 0:
                segments.append((piece, True))
            else:
                segments.append((contents[int(piece)], False))
        return [seg for seg in segments if seg[0]]


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` (what chat templates are written for): plain JSON. Jinja's own filter
    HTML-escapes ("<" becomes "\\u003c") and sorts keys, which would garble tool definitions and calls."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


Segment = tuple[str, bool]  # (text, trusted: may contain special tokens)
# Private-use code points: no model's template or vocabulary gives them meaning.
_PLACEHOLDER = re.compile("\ue000cllm-content-(\\d+)\ue001")


def _placeholder(index: int) -> str:
    return f"\ue000cllm-content-{index}\ue001"
