"""ToolPlan: how one chat request's tools reach the model and how its reply is read back."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from cllm.tools.parsers import PARSERS, ParsedOutput, ToolParser, parser_for_template
from cllm.tools.spec import ToolChoice, ToolFunction, parse_tool_choice, parse_tools

# Told to the model when its chat template cannot render tools (llama.cpp's generic format does
# the same); the forced-call schema below produces exactly this shape.
_GENERIC_PROMPT = (
    "You can call these tools:\n{tools}\n\n"
    "To call tools, reply with only a JSON object of this form and nothing else:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}'
)


@dataclass(slots=True)
class ToolPlan:
    """The tools of one request, and what rendering and parsing do with them."""

    tools: list[ToolFunction]  # declared functions
    choice: ToolChoice  # none / auto / required / a named function
    parallel: bool  # parallel_tool_calls: several calls in one reply allowed
    parser: ToolParser  # reads calls out of free (auto) text
    native: bool  # the chat template renders `tools` itself
    max_calls: int = 4  # most calls a forced reply may hold when parallel calls are allowed

    @property
    def active(self) -> bool:
        """Whether replies may contain tool calls at all."""
        return bool(self.tools) and self.choice.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` for the Jinja template (None: the template is not told about tools)."""
        return [t.to_openai() for t in self.tools] if self.native and self.active else None

    def forced_schema(self) -> dict[str, Any] | None:
        """For required / named tool_choice: the JSON Schema the reply is constrained to, so the
        call is always valid JSON for the function's parameters."""
        if not self.choice.forced:
            return None
        chosen = [t for t in self.tools if self.choice.mode == "required" or t.name == self.choice.name]
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]}, "arguments": t.parameters},
                  "required": ["name", "arguments"]} for t in chosen]
        calls: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        calls["maxItems"] = self.max_calls if self.parallel and self.choice.mode == "required" else 1
        return {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template gets them: tool-call arguments as objects (what templates
        expect); for a template without tool support, the tools described in the system message
        and earlier calls written in the generic format."""
        out = [_with_object_arguments(m) for m in messages]
        if self.native:
            return out
        out = [_generic_assistant(m) for m in out]
        if not self.active:
            return out
        description = _GENERIC_PROMPT.format(tools=json.dumps([t.to_openai()["function"] for t in self.tools], indent=1, ensure_ascii=False))
        if out and out[0].get("role") in ("system", "developer"):
            first = dict(out[0])
            first["content"] = f"{first.get('content') or ''}\n\n{description}".lstrip()
            return [first, *out[1:]]
        return [{"role": "system", "content": description}, *out]

    def parse(self, text: str) -> ParsedOutput:
        """The reply as content and calls (no calls unless tools are active)."""
        if not self.active:
            return ParsedOutput(text)
        return self.stream_parser().parse(text)

    def missing_call(self, text: str, finish_reason: str | None) -> str | None:
        """Why a forced reply (tool_choice required / named) holds no call, or None when it holds one
        or no call was forced. The grammar makes every reply it completes a call, so only a cut can
        leave one out: max_tokens (finish "length"), or the request's own stop strings / stop_token_ids."""
        if not (self.active and self.choice.forced) or self.parse(text).tool_calls:
            return None
        if finish_reason == "length":
            return ("the forced tool call was cut off by max_tokens before it was complete: raise max_tokens "
                    "(or bound the tool's parameters: maxLength, maxItems, enum)")
        return ("the forced tool call was cut off before it was complete by the request's stop strings or "
                "stop_token_ids: leave them out with tool_choice required or a named function")

    def stream_parser(self) -> ToolParser:
        """The parser that reads the reply (and decides what streams as content): a forced reply
        is all call, in the generic shape its schema constrains it to."""
        return PARSERS["generic"](self.parser.names) if self.choice.forced else self.parser


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, template_source: str | None,
               parser_name: str = "auto", max_parallel_calls: int = 4) -> ToolPlan | None:
    """The plan for a request's ``tools`` / ``tool_choice``; None when it has no tools.
    ValueError names the bad field."""
    functions = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, functions)
    if not functions:
        return None
    name = parser_for_template(template_source) if parser_name == "auto" else parser_name
    if name not in PARSERS:
        raise ValueError(f"invalid tool_call_parser={name!r}: must be auto or one of {', '.join(PARSERS)}")
    native = name != "generic" and _renders_tools(template_source)
    parser = PARSERS[name](t.name for t in functions)  # a call must name a declared tool
    return ToolPlan(functions, choice, parallel_tool_calls is not False, parser, native, max_parallel_calls)


def _renders_tools(source: str | None) -> bool:
    if not source:
        return False
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return "tools" in meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(source))
    except Exception:  # a template jinja cannot parse fails later, with its own message
        return False


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls or not isinstance(calls, list):
        return message
    fixed = copy.deepcopy(message)
    for call in fixed["tool_calls"]:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # left as text; the template shows it as given
    return fixed


def _well_formed(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls)


def _generic_assistant(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with tool_calls, as the generic format's text (the template shows only content)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls or not _well_formed(calls):
        return message  # a malformed list is left for the template's message check to name
    body = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})} for c in calls]
    text = json.dumps({"tool_calls": body}, ensure_ascii=False)
    content = message.get("content") or ""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{text}" if content else text
    return out
