"""Responses API input as the chat path's input: items -> chat messages, tools, tool_choice, text.format.

Every check names the field in the client's terms (``input[3].content[1].type``); what cannot be
served (file inputs, built-in tools such as web search) is a 400 ``unsupported_parameter``. ``input_image``
parts become chat image_url parts, loaded and checked with the chat path's (cllm.server.images).
"""
from __future__ import annotations

import json
from typing import Any

from cllm.server.errors import bad_request, unsupported
from cllm.server.images import chat_content
from cllm.server.protocol import ChatMessage, ResponseFormat
from cllm.server.responses_protocol import ResponsesRequest

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "custom", "shell", "apply_patch")


def _content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A message's content (a string or a list of parts) as one string, or, when it holds images, as chat
    parts (text, and image_url naming its ``where`` in the request: cllm.server.images.chat_content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"invalid {param}: must be a string or a list of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"invalid {where}: must be an object with a 'type'", param=where)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"invalid {where}.text: must be a string", param=f"{where}.text")
            parts.append({"type": "text", "text": text})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            parts.append(_input_image(part, where))
        else:
            raise unsupported(f"content part type {kind!r} is not supported (input_text, output_text, input_image)",
                               f"{where}.type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _input_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part as chat's image_url part (the image is fetched and checked later, with the rest)."""
    if part.get("file_id") is not None:
        raise unsupported(f"{where}.file_id: file inputs are not supported (no files API): send the image as "
                          "image_url, a data: URL", f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"invalid {where}.image_url: must be a data: URL or an http(s) URL", param=f"{where}.image_url")
    detail = part.get("detail")
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if isinstance(detail, str) else {})},
            "where": where}


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"invalid {where}.{key}: must be a non-empty string", param=f"{where}.{key}")
    return value


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = item.get("arguments", "")
    if isinstance(arguments, (dict, list)):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise bad_request(f"invalid {where}.arguments: must be a JSON string", param=f"{where}.arguments")
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}


def _call_output(item: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content(output, f"{where}.output")
    raise bad_request(f"invalid {where}.output: must be a string or a list of content parts", param=f"{where}.output")


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (plain dicts, JSON as the response store keeps them: role, content (a string,
    or with images a list of parts), tool_calls, tool_call_id). Consecutive
    ``function_call`` items join the assistant message before them, as chat templates expect."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not raw:
        raise bad_request("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"invalid {where}.role={role!r}: must be one of {', '.join(_ROLES)}", param=f"{where}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _call_output(item, where)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again (chat templates drop it too)
        elif kind == "item_reference":
            raise unsupported("item_reference inputs are not supported: send the items, or use previous_response_id",
                               f"{where}.type")
        else:
            raise unsupported(f"input item type {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", f"{where}.type")
    return messages


def chat_messages(plain: list[dict[str, Any]]) -> list[ChatMessage]:
    """Plain chat messages as the chat path's models."""
    out = []
    for m in plain:
        out.append(ChatMessage(role=m["role"], content=chat_content(m.get("content") or ""), tool_calls=m.get("tool_calls"),
                               tool_call_id=m.get("tool_call_id")))
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses ``tools`` (flat: ``{type, name, description, parameters, strict}``) as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            if kind in _BUILTIN_TOOLS or isinstance(kind, str):
                raise unsupported(f"tool type {kind!r} is not supported: only function tools (built-in tools such "
                                   "as web search run on OpenAI's servers)", f"tools[{i}].type")
            raise bad_request(f"invalid tools[{i}].type: must be 'function'", param=f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """Responses ``tool_choice`` (``{"type": "function", "name": …}`` for a named one) as chat's."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("invalid tool_choice.name: must name a function in tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if choice.get("type") == "allowed_tools":
        raise unsupported("tool_choice allowed_tools is not supported: send only the tools allowed", "tool_choice.type")
    raise unsupported(f"tool_choice type {choice.get('type')!r} is not supported (none, auto, required, or "
                       "{\"type\": \"function\", \"name\": ...})", "tool_choice.type")


def chat_response_format(body: ResponsesRequest) -> ResponseFormat | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format json_schema needs a 'schema'", param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema={"name": fmt.name or "response", "schema": fmt.schema_,
                                                               "strict": bool(fmt.strict)})
    raise unsupported(f"text.format type {fmt.type!r} is not supported (text, json_object, json_schema)",
                       "text.format.type")
