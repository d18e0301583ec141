"""gpt-oss's harmony format: a reply read as channels, streamed or whole.

A harmony reply is a run of messages, each ``HEADER <|message|> BODY END``. The header names the
channel (``<|channel|>analysis``), maybe a recipient (`` to=functions.get_weather``, before or after
the channel) and a content type (``<|constrain|>json`` or `` json``); END is ``<|end|>`` (more
messages follow), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call); the next message
starts with ``<|start|>assistant``. The chat template's generation prompt already wrote
``<|start|>assistant``, so a reply starts at a header::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The markers are control tokens, which decoding drops: for these replies the server has the engine
keep them in the text (``SamplingParams.skip_special_tokens=False``; llama.cpp shows them anyway),
and this reader takes every one of them out again.

Rules (the same streamed and not: a reply fed in any pieces reads the same as the whole reply):
- ``analysis`` is reasoning (content when reasoning is not split); ``final``, ``commentary`` without
  a recipient (a preamble) and text outside any message (a reply that starts without a header, or
  text after an end marker) are content.
- A message to ``functions.NAME`` is a tool call when NAME is a declared tool and its body is a JSON
  object; otherwise its body is text of its channel (a model's almost-call is never an error). The
  body of a possible call is held back until its message ends.
- A reply cut off inside a message (max_tokens) keeps what it has: an analysis cut off is reasoning,
  with empty content; an unfinished header is dropped.
- Two messages of the same kind are joined by a blank line; bodies are otherwise kept as written.
- While streaming, text that may be the start of a marker (or of a leading `` to=``) is held back, so
  no piece of a marker reaches reasoning, content or a call.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from cllm.tools.spec import ToolCall, make_call

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_ENDS = frozenset({END, RETURN, CALL})
_RECIPIENT_AT_START = "to="  # a header may begin with its recipient: " to=functions.f<|channel|>commentary json"
_RECIPIENT = re.compile(r"(?<![\w.])to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_FUNCTIONS = "functions."
_REASONING, _CONTENT, _CALL = "reasoning", "content", "call"  # where a message's body goes
_OPEN, _HEADER, _BODY = range(3)  # between messages (or before the first), in a header, in a body


def is_harmony(texts: Iterable[str]) -> bool:
    """Whether a chat template (or a vocabulary's control tokens) shows harmony's channel markers."""
    found = {m for text in texts for m in (CHANNEL, MESSAGE) if text and m in text}
    return len(found) == 2


@dataclass(slots=True)
class HarmonyDelta:
    """What a piece of the reply adds."""

    reasoning: str = ""  # analysis text
    content: str = ""  # answer text
    calls: list[ToolCall] = field(default_factory=list)  # complete calls (only when the reply ends)


class HarmonyStream:
    """One choice's harmony reply, fed piece by piece, read as reasoning, content and tool calls.

    ``names``: the declared tools a call may name (None: any); ``calls=False``: no message is a call.
    ``reasoning=False``: analysis is content. ``opened``: the prompt ended inside an analysis message
    (its header written), so the reply starts in its body. Work per piece is bounded by the piece
    and the longest marker (no rescanning of the reply)."""

    def __init__(self, names: Iterable[str] | None = None, *, calls: bool = True, reasoning: bool = True,
                 opened: bool = False) -> None:
        self._names: Collection[str] | None = frozenset(names) if names is not None else None
        self._calls_on = calls
        self._reasoning_on = reasoning
        self._buf = ""  # text not yet lexed: a possible partial marker
        self._state = _OPEN
        self._pending = ""  # _OPEN: text that may still turn out to be a header (whitespace, "to")
        self._header = ""  # _HEADER: the header so far (channel / constrain markers kept for parsing)
        self._kind = _CONTENT  # _BODY: where the body goes
        self._fresh = True  # _BODY: the message has written nothing yet
        self._call_name = ""  # _BODY of a call: the function called
        self._call_body: list[str] = []  # _BODY of a call: its arguments text so far
        self._written: set[str] = set()  # kinds that have text (a later message of the kind starts a paragraph)
        self._seen_marker = False  # a reply without any marker is handed out untouched
        self._calls: list[ToolCall] = []
        if opened:
            self._open_body(CHANNEL + "analysis")

    def feed(self, text: str) -> HarmonyDelta:
        """Add reply text; returns what can be handed out now."""
        out = HarmonyDelta()
        self._buf += text
        self._lex(out, final=False)
        return out

    def finish(self) -> HarmonyDelta:
        """The reply is complete: everything held, and the calls."""
        out = HarmonyDelta()
        self._lex(out, final=True)
        if self._state == _OPEN and (self._pending.strip() or not self._seen_marker):
            self._begin_text(out)
        if self._state == _BODY:
            self._close(out)
        self._state, self._pending, self._header = _OPEN, "", ""
        out.calls, self._calls = self._calls, []
        return out

    # ---- lexing: text and markers ----------------------------------------------------------------

    def _lex(self, out: HarmonyDelta, *, final: bool) -> None:
        buf = self._buf
        while buf:
            at = buf.find("<|")
            if at < 0:
                keep = 1 if buf.endswith("<") and not final else 0  # maybe the start of a marker
                self._text(buf[:len(buf) - keep], out)
                buf = buf[len(buf) - keep:]
                break
            if at:
                self._text(buf[:at], out)
                buf = buf[at:]
            marker = next((m for m in MARKERS if buf.startswith(m)), None)
            if marker is not None:
                self._marker(marker, out)
                buf = buf[len(marker):]
            elif not final and any(m.startswith(buf) for m in MARKERS):
                break  # a marker may be arriving
            else:
                self._text("<|", out)  # no marker: plain text
                buf = buf[2:]
        self._buf = buf

    def _text(self, text: str, out: HarmonyDelta) -> None:
        if not text:
            return
        if self._state == _HEADER:
            self._header += text
        elif self._state == _BODY:
            self._write(text, out)
        else:
            self._pending += text
            self._decide_open(out)

    def _decide_open(self, out: HarmonyDelta) -> None:
        """Between messages: a header (leading `` to=``) or text before any header (content)."""
        stripped = self._pending.lstrip()
        if stripped.startswith(_RECIPIENT_AT_START):
            self._state, self._header, self._pending = _HEADER, self._pending, ""
        elif stripped and not _RECIPIENT_AT_START.startswith(stripped):
            self._begin_text(out)
        # else whitespace, or maybe a recipient so far: wait

    def _begin_text(self, out: HarmonyDelta) -> None:
        """Text outside any message is the answer's."""
        pending, self._pending = self._pending, ""
        self._state, self._kind, self._fresh = _BODY, _CONTENT, True
        self._write(pending, out)

    def _marker(self, marker: str, out: HarmonyDelta) -> None:
        self._seen_marker = True
        if self._state == _OPEN:
            if self._pending.strip():
                self._begin_text(out)  # "t<|…": the text was no recipient after all
            self._pending = ""
        if self._state == _BODY:
            if marker in (MESSAGE, CONSTRAIN):
                return  # stray header markers inside a body are dropped
            self._close(out)
        if self._state == _HEADER and marker in (CHANNEL, CONSTRAIN):
            self._header += marker
        elif marker == MESSAGE:
            self._open_body(self._header if self._state == _HEADER else "")
        elif marker == START:
            self._state, self._header = _HEADER, ""
        elif marker in (CHANNEL, CONSTRAIN):
            self._state, self._header = _HEADER, marker
        else:  # an end marker: the message (or the unfinished header) is over
            self._state, self._header = _OPEN, ""

    # ---- messages --------------------------------------------------------------------------------

    def _open_body(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1)[len(_FUNCTIONS):] if recipient and recipient.group(1).startswith(_FUNCTIONS) else ""
        if name and self._calls_on and (self._names is None or name in self._names):
            self._kind, self._call_name, self._call_body = _CALL, name, []
        elif channel is not None and channel.group(1) == "analysis" and self._reasoning_on:
            self._kind = _REASONING
        else:
            self._kind = _CONTENT
        self._state, self._header, self._fresh = _BODY, "", True

    def _write(self, text: str, out: HarmonyDelta) -> None:
        if not text:
            return
        if self._kind == _CALL:
            self._call_body.append(text)
            return
        if self._fresh and self._kind in self._written:
            text = "\n\n" + text
        self._fresh = False
        self._written.add(self._kind)
        if self._kind == _REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: HarmonyDelta) -> None:
        """The message in _BODY ended (an end marker, a new header, or the end of the reply)."""
        if self._kind == _CALL:
            body = "".join(self._call_body)
            call = _call(self._call_name, body)
            if call is not None:
                self._calls.append(call)
            else:  # no call after all (not a JSON object, or cut off): its text is the answer's
                self._kind = _CONTENT
                self._write(body, out)
            self._call_body = []
        self._state = _OPEN


def _call(name: str, body: str) -> ToolCall | None:
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return make_call(name, arguments) if isinstance(arguments, dict) else None


def read_harmony(text: str, names: Iterable[str] | None = None, *, calls: bool = True,
                 reasoning: bool = True) -> HarmonyDelta:
    """A whole reply read (what streaming the same text piece by piece adds up to)."""
    stream = HarmonyStream(names, calls=calls, reasoning=reasoning)
    first = stream.feed(text)
    rest = stream.finish()
    return HarmonyDelta(first.reasoning + rest.reasoning, first.content + rest.content, rest.calls)
