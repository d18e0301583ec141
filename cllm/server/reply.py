"""One choice's reply read as the protocols need it: reasoning, content and tool calls.

Every chat-shaped route (chat completions, Responses, Messages) reads replies through
``ReplyStream``: text deltas go through the reasoning splitter first, its content through the
tool-call stream, and the non-streamed reply is the same stream fed the whole text at once, so
both ways give the same reasoning, content and calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cllm.server.reasoning import ReasoningFormat, ReasoningSplitter
from cllm.tools import ToolCall, ToolPlan
from cllm.tools.stream import ToolCallStream

NORMAL_FINISH = ("stop", "length")


@dataclass(slots=True, frozen=True)
class ReplyFormat:
    """How one request's replies are read."""

    plan: ToolPlan | None = None  # the request's tools, when calls are possible (plan.active)
    reasoning: ReasoningFormat | None = None  # the model's reasoning markers, when split
    reasoning_opened: bool = False  # the prompt left the reasoning block open

    @property
    def tools_active(self) -> bool:
        return self.plan is not None and self.plan.active


@dataclass(slots=True)
class ReplyDelta:
    """What a piece of the reply adds."""

    reasoning: str = ""  # reasoning text
    content: str = ""  # answer text
    tool_calls: list[ToolCall] = field(default_factory=list)  # complete calls (only when the reply ends)


@dataclass(slots=True)
class Reply:
    """A whole reply."""

    reasoning: str | None  # None when the model did not reason (or reasoning is not split)
    content: str  # answer text without the calls
    tool_calls: list[ToolCall]  # calls, in order


class ReplyStream:
    """Reads one choice's reply delta by delta."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self._reasoning = ReasoningSplitter(fmt.reasoning, opened=fmt.reasoning_opened) if fmt.reasoning else None
        self._tools = ToolCallStream(fmt.plan) if fmt.plan is not None and fmt.plan.active else None
        self._held = ""  # with tools: trailing whitespace of the content, sent once more text follows it
        self.finished = False

    def feed(self, text: str) -> ReplyDelta:
        if not text:
            return ReplyDelta()
        if self._reasoning is None:
            return ReplyDelta(content=self._content(text))
        split = self._reasoning.feed(text)
        return ReplyDelta(split.reasoning, self._content(split.content))

    def finish(self) -> ReplyDelta:
        """Everything held back, and the calls; call once, when the choice ended normally."""
        self.finished = True
        out = ReplyDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out.reasoning = split.reasoning
            out.content = self._content(split.content)
        if self._tools is not None:
            rest, calls = self._tools.finish()
            tail = self._held + rest
            self._held = ""
            # Whitespace between the text and a call is no content (the plain reply strips it too).
            out.content += tail.rstrip() if calls else tail
            out.tool_calls = calls
        return out

    def step(self, text: str, finish_reason: str | None) -> ReplyDelta:
        """``feed`` a delta and, when the choice ended normally (``finish_reason`` set), ``finish`` too:
        the delta's reasoning and content, and the calls (``tool_calls``) once it ended."""
        delta = self.feed(text)
        if finish_reason:
            rest = self.finish()
            delta.reasoning += rest.reasoning
            delta.content += rest.content
            delta.tool_calls = rest.tool_calls
        return delta

    def _content(self, text: str) -> str:
        if self._tools is None or not text:
            return text
        pending = self._held + self._tools.feed(text)
        body = pending.rstrip()
        self._held = pending[len(body):]
        return body


def read_reply(text: str, fmt: ReplyFormat) -> Reply:
    """A finished choice's text as reasoning, content and calls (content stripped when there are calls,
    as the chat API always did)."""
    stream = ReplyStream(fmt)
    first = stream.feed(text)
    rest = stream.finish()
    reasoning = first.reasoning + rest.reasoning
    content = first.content + rest.content
    if rest.tool_calls:
        content = content.strip()
    return Reply(reasoning if fmt.reasoning is not None and reasoning else None, content, rest.tool_calls)
