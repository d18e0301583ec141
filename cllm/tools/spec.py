"""OpenAI tool definitions, tool_choice and tool calls as plain data, validated."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True, frozen=True)
class ToolFunction:
    """One callable function the model may use."""

    name: str  # function name the model calls it by
    description: str | None  # what it does (shown to the model)
    parameters: dict[str, Any]  # JSON Schema of its arguments object

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry (what chat templates expect in ``tools``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """``tool_choice``: whether and which tool the model must call."""

    mode: Literal["none", "auto", "required", "function"]  # OpenAI's modes; "function" = the named one
    name: str | None = None  # the function forced by mode "function"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(slots=True)
class ToolCall:
    """One call the model made."""

    id: str  # "call_…", unique per call
    name: str  # the function called
    arguments: str  # its arguments as JSON text (OpenAI sends a string)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> ToolCall:
    """A ToolCall from parsed output; arguments re-serialised compactly (a dict, or JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(new_call_id(), name, arguments)
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def parse_tools(raw: Any) -> list[ToolFunction]:
    """``tools`` (OpenAI shape) as ToolFunctions; ValueError naming the bad entry."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"invalid tools={raw!r}: must be a list of {{type: function, function: {{...}}}}")
    tools = [_tool(i, entry) for i, entry in enumerate(raw)]
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"invalid tools: function name {dupes[0]!r} is defined twice")
    return tools


def _tool(i: int, entry: Any) -> ToolFunction:
    if not isinstance(entry, dict) or entry.get("type", "function") != "function" or not isinstance(entry.get("function"), dict):
        raise ValueError(f"invalid tools[{i}]={entry!r}: must be {{\"type\": \"function\", \"function\": {{...}}}}")
    fn = entry["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"invalid tools[{i}].function.name={name!r}: must be 1-64 letters, digits, _ . or -")
    params = fn.get("parameters")
    if params is None:
        params = dict(_EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise ValueError(f"invalid tools[{i}].function.parameters={params!r}: must be a JSON Schema object")
    if params.get("type", "object") != "object":
        raise ValueError(f"invalid tools[{i}].function.parameters={params!r}: must be a JSON Schema of type "
                         "\"object\" (arguments are a JSON object), as on OpenAI")
    if "type" not in params:
        # `{}` (any JSON) would let a forced call's arguments be a number or a list, which is no
        # call: the arguments are an object (issue 27 item 3).
        params = {"type": "object", **params}
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ValueError(f"invalid tools[{i}].function.description={desc!r}: must be a string")
    return ToolFunction(name, desc, params)


def parse_tool_choice(raw: Any, tools: list[ToolFunction]) -> ToolChoice:
    """``tool_choice`` (string or ``{"type": "function", "function": {"name": …}}``)."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise ValueError(f"invalid tool_choice={raw!r}: must be none, auto, required or a named function")
        choice = ToolChoice(raw)  # type: ignore[arg-type]
    elif isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        choice = ToolChoice("function", raw["function"].get("name"))
        if choice.name not in {t.name for t in tools}:
            raise ValueError(f"invalid tool_choice={raw!r}: names function {choice.name!r}, which is not in tools")
    else:
        raise ValueError(f"invalid tool_choice={raw!r}: must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if choice.forced and not tools:
        raise ValueError(f"invalid tool_choice={raw!r}: requires tools")
    return choice
