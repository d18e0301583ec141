"""ToolCallStream: one choice's streamed reply split into content deltas and, at the end, calls."""
from __future__ import annotations

from cllm.tools.plan import ToolPlan
from cllm.tools.spec import ToolCall


class ToolCallStream:
    """Content streams as it comes until a tool call may be starting; from there the text is held
    back, and at the end parsed: calls come out whole, anything that was no call as content.
    The non-streamed reply is ``plan.parse`` of the same text, so both give the same calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._parser = plan.stream_parser()
        self._text = ""
        self._sent = 0  # characters of _text already streamed as content

    def feed(self, delta: str) -> str:
        """Add new text; returns the content that can be streamed now."""
        self._text += delta
        if self._plan.choice.forced:
            return ""  # the whole reply is the call
        start = self._parser.call_start(self._text)
        end = start if start is not None else len(self._text) - self._parser.partial_marker(self._text)
        return self._take(end)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not streamed yet, the calls) once the reply is complete."""
        parsed = self._plan.parse(self._text)
        if not parsed.tool_calls:
            return self._take(len(self._text)), []
        start = self._parser.call_start(self._text) or 0
        return self._take(start), parsed.tool_calls

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece = self._text[self._sent:end]
        self._sent = end
        return piece
