"""Reading tool calls out of model text, one parser per common format.

Each parser knows where a call starts in the text (``call_start``, for streaming: content before
it is streamed, the call itself is held back and parsed whole) and how to parse it. A text that
does not parse as a call is plain content: with ``tool_choice: auto`` a small model often writes
almost-calls, and those must come back as text, never as an error.

A call must name one of the request's declared tools (``names``): a reply that is plain JSON data
(``{"name": "Alice", "age": 30}``) is the answer, not a call of an undeclared function "Alice"
(issue 27 item 3). A call object holds only a name and its arguments.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cllm.tools.harmony import MARKERS as HARMONY_MARKERS
from cllm.tools.harmony import is_harmony, read_harmony
from cllm.tools.spec import ToolCall, make_call


@dataclass(slots=True)
class ParsedOutput:
    """A model reply split into text and tool calls."""

    content: str | None  # text outside the calls (None when there is none)
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls, in order


class ToolParser(ABC):
    """One tool-call format. ``names``: the declared tools a call may name (None: any name, for
    reading a format without a request)."""

    name: str = ""
    # Strings that open a call anywhere in the text.
    markers: tuple[str, ...] = ()
    # The call may also be bare JSON at the very start of the reply.
    json_at_start: bool = False

    def __init__(self, names: Iterable[str] | None = None) -> None:
        self.names = frozenset(names) if names is not None else None

    def call_start(self, text: str) -> int | None:
        """Index where a (possibly still incomplete) call begins, or None."""
        starts = [text.find(m) for m in self.markers if m in text]
        if self.json_at_start:
            stripped = text.lstrip()
            if stripped[:1] in ("{", "["):
                starts.append(len(text) - len(stripped))
        return min(starts) if starts else None

    def partial_marker(self, text: str) -> int:
        """How many trailing characters could be the start of a marker (held back while streaming)."""
        if self.json_at_start and not text.strip():
            return len(text)
        best = 0
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    best = max(best, k)
                    break
        return best

    def parse(self, text: str) -> ParsedOutput:
        start = self.call_start(text)
        if start is None:
            return ParsedOutput(text or None)
        calls = self._calls(text[start:])
        if not calls or (self.names is not None and any(c.name not in self.names for c in calls)):
            return ParsedOutput(text or None)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)

    @abstractmethod
    def _calls(self, region: str) -> list[ToolCall]:
        """The calls in ``region`` (the text from the first marker on); [] if it is not a call."""


class HermesParser(ToolParser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated."""

    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, region: str) -> list[ToolCall]:
        calls = [_named_call(_json(m.group(1))) for m in self._BLOCK.finditer(region)]
        return [] if not calls or None in calls else calls  # type: ignore[return-value]


class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11). The marker is a control token that decoding may drop,
    so a bare JSON list at the start is read too."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    json_at_start = True

    def _calls(self, region: str) -> list[ToolCall]:
        body = region.replace("[TOOL_CALLS]", "", 1).strip()
        if "[ARGS]" in body:
            calls = []
            for part in body.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                parsed = _json(args)
                if not name.strip() or not isinstance(parsed, dict):
                    return []
                calls.append(make_call(name.strip(), parsed))
            return calls
        return _call_list(_json(body))


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON tool calls: ``<|python_tag|>{"name": ..., "parameters": {...}}``, or the bare
    object at the start; several separated by ";"."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    json_at_start = True

    def _calls(self, region: str) -> list[ToolCall]:
        body = region.replace("<|python_tag|>", "", 1).strip()
        whole = _json(body)
        if whole is not None:
            return _call_list(whole if isinstance(whole, list) else [whole])
        pieces = [_named_call(_json(p)) for p in body.split(";") if p.strip()]
        return [] if not pieces or None in pieces else pieces  # type: ignore[return-value]


class GenericParser(ToolParser):
    """cllm's own format for templates that cannot render tools (as llama.cpp's generic format):
    the reply is ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``. A forced call
    (tool_choice required / named) is constrained to exactly this shape."""

    name = "generic"
    json_at_start = True

    def _calls(self, region: str) -> list[ToolCall]:
        # Only the wrapper makes a call: a bare object or list at the start is the reply's data.
        obj = _json(region.strip())
        if not isinstance(obj, dict) or len(obj) != 1:
            return []
        if "tool_calls" in obj:
            return _call_list(obj["tool_calls"])
        if "tool_call" in obj:  # llama.cpp's generic format names a single call so
            return _call_list([obj["tool_call"]])
        return []


class HarmonyParser(ToolParser):
    """gpt-oss's harmony: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
    among the reply's other channels (cllm.tools.harmony reads them; a chat reply is read there
    whole, reasoning included: cllm.server.reply). Here: the calls, and the content around them."""

    name = "harmony"
    markers = (*HARMONY_MARKERS, " to=")  # content streams up to the first header

    def parse(self, text: str) -> ParsedOutput:
        read = read_harmony(text, self.names)
        content = read.content.strip() if read.calls else read.content
        return ParsedOutput(content or None, read.calls)

    def _calls(self, region: str) -> list[ToolCall]:
        return read_harmony(region, self.names).calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser, GenericParser, HarmonyParser)
}


def parser_for_template(source: str | None) -> str:
    """The parser a chat template's own tool format needs ("generic" when it has none)."""
    text = source or ""
    if is_harmony([text]):
        return "harmony"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "generic"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


# The keys a call object may have: anything else means the JSON is data, not a call.
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})


def _named_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not obj.keys() <= _CALL_KEYS or obj.get("type", "function") != "function":
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = _json(args)
    if not isinstance(args, dict):  # arguments are an object (the schema of every tool says so)
        return None
    return make_call(obj["name"], args)


def _call_list(obj: Any) -> list[ToolCall]:
    if not isinstance(obj, list) or not obj:
        return []
    calls = [_named_call(item) for item in obj]
    return [] if None in calls else calls  # type: ignore[return-value]
