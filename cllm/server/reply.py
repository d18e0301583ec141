"""One choice's reply read as the protocols need it: reasoning, content and tool calls.

Every chat-shaped route (chat completions, Responses, Messages) reads replies through
``ReplyStream``: text deltas go through the reasoning splitter first, its content through the
tool-call stream, and the non-streamed reply is the same stream fed the whole text at once, so
both ways give the same reasoning, content and calls. A harmony reply (gpt-oss) goes through
``HarmonyStream`` instead, which reads reasoning, content and calls out of its channels at once
(a forced call is still read from the content: the constraint writes it in the generic shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cllm.server.reasoning import ReasoningFormat, ReasoningSplitter
from cllm.tools import ToolCall, ToolPlan
from cllm.tools.harmony import HarmonyDelta, HarmonyStream
from cllm.tools.stream import ToolCallStream

NORMAL_FINISH = ("stop", "length")


@dataclass(slots=True, frozen=True)
class ReplyFormat:
    """How one request's replies are read."""

    plan: ToolPlan | None = None  # the request's tools, when calls are possible (plan.active)
    reasoning: ReasoningFormat | None = None  # the model's reasoning markers, when split
    reasoning_opened: bool = False  # the prompt left the reasoning block open
    harmony: bool = False  # the reply is in harmony channels, their markers kept in the text (gpt-oss)

    @property
    def tools_active(self) -> bool:
        return self.plan is not None and self.plan.active

    @property
    def plain(self) -> bool:
        """Nothing to read: the reply's text is its content as it comes."""
        return self.plan is None and self.reasoning is None and not self.harmony

    @property
    def harmony_calls(self) -> bool:
        """Calls come from harmony's commentary channel (tools active, not forced into the generic shape)."""
        return self.harmony and self.plan is not None and self.plan.active and not self.plan.choice.forced


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
        self._split = _splitter(fmt)  # reasoning (a harmony reply: and calls) out of the text
        plan = fmt.plan
        self._tools = ToolCallStream(plan) if plan is not None and plan.active and not fmt.harmony_calls else None
        self._held = ""  # with tools: trailing whitespace of the content, sent once more text follows it
        self.finished = False

    def feed(self, text: str) -> ReplyDelta:
        if not text:
            return ReplyDelta()
        if self._split is None:
            return ReplyDelta(content=self._content(text))
        split = self._split.feed(text)
        return ReplyDelta(split.reasoning, self._content(split.content))

    def finish(self) -> ReplyDelta:
        """Everything held back, and the calls; call once, when the choice ended normally."""
        self.finished = True
        out = ReplyDelta()
        if self._split is not None:
            split = self._split.finish()
            out.reasoning = split.reasoning
            out.content = self._content(split.content)
            if isinstance(split, HarmonyDelta):
                out.tool_calls = split.calls
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


def _splitter(fmt: ReplyFormat) -> ReasoningSplitter | HarmonyStream | None:
    """What reads reasoning (and, for harmony, calls) out of the reply; None when nothing is split."""
    if fmt.harmony:
        names = [t.name for t in fmt.plan.tools] if fmt.plan is not None and fmt.harmony_calls else ()
        return HarmonyStream(names, calls=fmt.harmony_calls, reasoning=fmt.reasoning is not None,
                             opened=fmt.reasoning_opened)
    if fmt.reasoning is not None:
        return ReasoningSplitter(fmt.reasoning, opened=fmt.reasoning_opened)
    return None


def read_unfinished(text: str, fmt: ReplyFormat) -> Reply:
    """A choice that ended early (timeout, abort, error) as it stands: its text as content, unparsed,
    except a harmony reply's, whose markers the server asked for and never hands out (its channels
    are read; nothing in it counts as a call)."""
    if not fmt.harmony:
        return Reply(None, text, [])
    read = ReplyStream(ReplyFormat(None, fmt.reasoning, fmt.reasoning_opened, True))
    first = read.feed(text)
    rest = read.finish()
    reasoning = first.reasoning + rest.reasoning
    return Reply(reasoning or None, first.content + rest.content, [])


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
    return Reply(reasoning or None, content, rest.tool_calls)
