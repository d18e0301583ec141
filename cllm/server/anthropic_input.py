"""Messages API input as the chat path's input: system, content blocks, tools and tool_choice.

Field names in errors follow the request (``messages.2.content.1.type``), as Anthropic's own errors do.
"""
from __future__ import annotations

import json
from typing import Any

from cllm.server.anthropic_protocol import AnthropicMessage, CountTokensRequest
from cllm.server.errors import bad_request, unsupported
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


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{at}.tool_use_id: must be a non-empty string", param=f"{at}.tool_use_id")
    content = block.get("content", "")
    text = _text_blocks(content, f"{at}.content") if content is not None else ""
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _turn(i: int, message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages (first, as
    Anthropic requires them first), an assistant turn's tool_use blocks its tool_calls."""
    where = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.{j}"
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text: must be a string", param=f"{at}.text")
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier thinking is not shown to the model again (chat templates drop it too)
        else:
            raise unsupported(f"{at}.type: content block type {kind!r} is not supported in a {message.role} turn "
                               "(text, tool_use in assistant turns, tool_result in user turns, thinking)", f"{at}.type")
    out = list(results)
    if message.role == "assistant":
        out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
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
    return [ChatMessage(role=m["role"], content=m["content"], tool_calls=m.get("tool_calls"),
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
