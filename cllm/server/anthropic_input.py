"""Messages API input as the chat path's input: system, content blocks, tools and tool_choice.

Field names in errors follow the request (``messages.2.content.1.type``), as Anthropic's own errors do.
"""
from __future__ import annotations

import json
from typing import Any

from cllm.server.anthropic_protocol import AnthropicMessage, CountTokensRequest
from cllm.server.errors import bad_request, unsupported
from cllm.server.images import chat_content
from cllm.server.protocol import ChatMessage


def _text_blocks(blocks: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise unsupported(f"{at}.type: block type {kind!r} is not supported here (text only)", f"{at}.type")
        if not isinstance(block.get("text"), str):
            raise bad_request(f"{at}.text: must be a string", param=f"{at}.text")
        texts.append(block["text"])
    return "".join(texts)


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    return None if system is None else _text_blocks(system, "system")


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.id: must be a non-empty string", param=f"{at}.id")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{at}.name: must be a non-empty string", param=f"{at}.name")
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.input: must be an object", param=f"{at}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_block(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block (base64 or url source) as chat's image_url part; the image is fetched (if allowed)
    and checked later with the chat path's (cllm.server.images), named as ``at``."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _MEDIA_TYPES:
            raise bad_request(f"{at}.source.media_type: must be one of {', '.join(_MEDIA_TYPES)}",
                              param=f"{at}.source.media_type")
        if not isinstance(data, str) or not data:
            raise bad_request(f"{at}.source.data: must be the image as a non-empty base64 string", param=f"{at}.source.data")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{at}.source.url: must be a non-empty string", param=f"{at}.source.url")
    else:
        raise unsupported(f"{at}.source.type: image source type {kind!r} is not supported (base64, url)",
                          f"{at}.source.type")
    return {"type": "image_url", "image_url": {"url": url}, "where": at}


def _parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts joined into a string; with an image among them, the parts as they are."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _result_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: a string, or text and image blocks."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text and image blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_block(block, at))
        elif kind == "text":
            raise bad_request(f"{at}.text: must be a string", param=f"{at}.text")
        else:
            raise unsupported(f"{at}.type: block type {kind!r} is not supported in a tool_result (text, image)", f"{at}.type")
    return _parts_content(parts)


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.tool_use_id: must be a non-empty string", param=f"{at}.tool_use_id")
    content = _result_content(block.get("content", ""), f"{at}.content")
    if block.get("is_error") is True:
        content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error: "}, *content]
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _turn(i: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages (first, as
    Anthropic requires them first), an assistant turn's tool_use blocks its tool_calls."""
    where = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    parts: list[dict[str, Any]] = []  # the turn's own text (and, in a user turn, image) parts
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text: must be a string", param=f"{at}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and message.role == "user":
            parts.append(_image_block(block, at))
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier thinking is not shown to the model again (chat templates drop it too)
        else:
            raise unsupported(f"{at}.type: content block type {kind!r} is not supported in a {message.role} turn "
                               "(text; image and tool_result in user turns; tool_use and thinking in assistant turns)",
                               f"{at}.type")
    out = list(results)
    if message.role == "assistant":
        out.append({"role": "assistant", "content": _parts_content(parts), **({"tool_calls": calls} if calls else {})})
    elif parts or not results:
        out.append({"role": "user", "content": _parts_content(parts)})
    return out


def chat_messages(body: CountTokensRequest) -> list[ChatMessage]:
    """The conversation (system first) as the chat path's messages."""
    if not body.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    plain: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        plain.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        plain += _turn(i, message)
    return [ChatMessage(role=m["role"], content=chat_content(m["content"]), tool_calls=m.get("tool_calls"),
                        tool_call_id=m.get("tool_call_id")) for m in plain]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools (``{name, description, input_schema}``) as chat tools; server tools are a 400."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise unsupported(f"tools.{i}.type: tool type {kind!r} is not supported: only client tools "
                               "(name, description, input_schema); server tools run on Anthropic's servers",
                               f"tools.{i}.type")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools.{i}.input_schema: must be a JSON Schema object", param=f"tools.{i}.input_schema")
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic ``tool_choice`` as chat's (tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name: must name a tool in tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(f"tool_choice.type: {kind!r} is not one of auto, any, tool, none", param="tool_choice.type")
