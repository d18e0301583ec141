"""Reasoning output: a thinking model's reasoning split from its answer.

Reasoning models write their thinking between markers before the answer: ``<think>…</think>``
(DeepSeek-R1 and its distills, Qwen3, QwQ, GLM-4.5, MiniMax, ERNIE, Hunyuan), ``[THINK]…[/THINK]``
(Mistral's Magistral), ``<seed:think>…</seed:think>`` (ByteDance Seed-OSS) or ``◁think▷…◁/think▷``
(Kimi). vLLM, SGLang and llama-server return that text apart (``reasoning_content``); so does cllm.

Rules (the same streamed and not):
- Reasoning is a block at the start of the reply. It opens with the start marker, or is open from
  the first token when the chat template's generation prompt already wrote the start marker
  (DeepSeek-R1's and Qwen3's templates do; the model then writes only ``…</think>``).
- A reply that starts with anything else is all content (a later ``<think>`` is content).
- A reply that ends inside the block (max_tokens) is all reasoning, as vLLM's parsers.
- Whitespace around the reasoning and before the answer is dropped (llama-server does the same).
- While streaming, text that may be the start of a marker is held back, so a partial marker never
  reaches ``content`` or ``reasoning_content``.

gpt-oss (``harmony``) writes no block but channels: ``<|channel|>analysis<|message|>…<|end|>`` is its
reasoning, ``<|channel|>final<|message|>…`` its answer, ``<|channel|>commentary to=functions.NAME …``
a tool call. Those replies are read by cllm.tools.harmony, not by the splitter here; the server
keeps the markers (control tokens, which decoding drops otherwise) in their text for that.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from cllm.tools.harmony import CHANNEL, END, MESSAGE, is_harmony

# Parser names (vLLM's where it has one) -> (start marker, end marker).
MARKERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "kimi": ("◁think▷", "◁/think▷"),
}
HARMONY = "harmony"  # gpt-oss's channels (cllm.tools.harmony); the markers say where analysis starts and ends
HARMONY_MARKERS = (f"{CHANNEL}analysis{MESSAGE}", END)
PARSER_NAMES = ("auto", "none", *MARKERS, HARMONY)


@dataclass(slots=True, frozen=True)
class ReasoningFormat:
    """How one model marks its reasoning."""

    name: str  # parser name (a MARKERS key, or HARMONY)
    start: str  # opens the block
    end: str  # closes it

    @property
    def harmony(self) -> bool:
        """Channels, not a block: the reply is read by cllm.tools.harmony."""
        return self.name == HARMONY

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves the block open (the template wrote the start)."""
        tail = prompt_tail.rstrip()
        return tail.endswith(self.start)


def parser_for_template(source: str | None, control_tokens: Callable[[], Collection[str]] | None = None) -> str:
    """The reasoning parser a chat template's markers call for ("none" when it shows none).
    ``control_tokens``: the vocabulary's control tokens, read only when the template shows no
    markers (a gpt-oss model served with another template still writes harmony)."""
    text = source or ""
    if is_harmony([text]):
        return HARMONY
    if "<seed:think>" in text:
        return "seed_oss"
    if "[THINK]" in text:
        return "mistral"
    if "◁think▷" in text:
        return "kimi"
    if "</think>" in text:
        return "deepseek_r1"
    if control_tokens is not None and is_harmony(control_tokens()):
        return HARMONY
    return "none"


def resolve_format(setting: str, template_source: str | None,
                   control_tokens: Callable[[], Collection[str]] | None = None) -> ReasoningFormat | None:
    """The format for a ``reasoning_parser`` setting (auto: from the template, or the vocabulary's
    ``control_tokens`` for harmony); None when off. ValueError names a bad setting."""
    if setting not in PARSER_NAMES:
        raise ValueError(f"invalid reasoning_parser={setting!r}: must be one of {', '.join(PARSER_NAMES)}")
    name = parser_for_template(template_source, control_tokens) if setting == "auto" else setting
    if name == "none":
        return None
    start, end = HARMONY_MARKERS if name == HARMONY else MARKERS[name]
    return ReasoningFormat(name, start, end)


@dataclass(slots=True)
class ReasoningDelta:
    """What one piece of reply text adds: reasoning and content (either may be empty)."""

    reasoning: str = ""
    content: str = ""


_UNDECIDED, _REASONING, _AFTER, _CONTENT = range(4)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's reply, fed piece by piece, split into reasoning and content deltas.

    Work per piece is bounded by the marker length plus the piece (no rescanning of the reply)."""

    def __init__(self, fmt: ReasoningFormat, *, opened: bool = False) -> None:
        self._fmt = fmt
        self._state = _REASONING if opened else _UNDECIDED
        self._buf = ""  # text not yet handed out (a possible marker, trailing whitespace)
        self._reasoning_started = False  # some reasoning was handed out (leading whitespace is gone)

    def feed(self, text: str) -> ReasoningDelta:
        """Add reply text; returns what can be handed out now."""
        self._buf += text
        out = ReasoningDelta()
        self._advance(out)
        return out

    def finish(self) -> ReasoningDelta:
        """The reply is complete: hand out everything held."""
        out = ReasoningDelta()
        self._advance(out)
        buf, self._buf = self._buf, ""
        if self._state == _UNDECIDED:
            out.content += buf
        elif self._state == _REASONING:
            out.reasoning += self._reasoning_text(buf).rstrip()
        elif self._state == _CONTENT:
            out.content += buf
        self._state = _CONTENT
        return out

    def _advance(self, out: ReasoningDelta) -> None:
        while True:
            before = self._state
            if self._state == _UNDECIDED:
                self._undecided()
            if self._state == _REASONING:
                self._reasoning(out)
            if self._state == _AFTER:
                stripped = self._buf.lstrip()
                if stripped:
                    self._buf = stripped
                    self._state = _CONTENT
                else:
                    self._buf = ""
            if self._state == _CONTENT:
                out.content += self._buf
                self._buf = ""
            if self._state == before:
                return

    def _undecided(self) -> None:
        start = self._fmt.start
        stripped = self._buf.lstrip()
        if stripped.startswith(start):
            self._buf = stripped[len(start):]
            self._state = _REASONING
        elif not start.startswith(stripped):
            self._state = _CONTENT  # the buffer is handed out whole: a reply without reasoning is untouched
        # else: whitespace or the start of the marker so far; wait for more

    def _reasoning(self, out: ReasoningDelta) -> None:
        end = self._fmt.end
        at = self._buf.find(end)
        if at >= 0:
            out.reasoning += self._reasoning_text(self._buf[:at]).rstrip()
            self._buf = self._buf[at + len(end):]
            self._state = _AFTER
            return
        # Hold back a possible partial end marker and trailing whitespace (it may end the block).
        keep = _partial_suffix(self._buf, end)
        body = self._buf[:len(self._buf) - keep]
        ready = body.rstrip()
        piece = self._reasoning_text(ready)
        out.reasoning += piece
        self._buf = self._buf[len(ready):]

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            if text:
                self._reasoning_started = True
        return text


def split_reasoning(text: str, fmt: ReasoningFormat, *, opened: bool = False) -> ReasoningDelta:
    """A whole reply split (what streaming the same text piece by piece adds up to)."""
    splitter = ReasoningSplitter(fmt, opened=opened)
    first = splitter.feed(text)
    rest = splitter.finish()
    return ReasoningDelta(first.reasoning + rest.reasoning, first.content + rest.content)
