"""Incremental, UTF-8-safe detokenisation with stop strings that never leak.

Tokens arrive one at a time as raw bytes. An incremental UTF-8 decoder holds
back an incomplete multi-byte character until its last byte arrives, so no
U+FFFD ever appears mid-stream for text that is valid once complete. Text that
could be the start of a stop string is held back too, until it is clear
whether the stop string follows.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence

from cllm.backends.base import Tokenizer


class IncrementalDetokenizer:
    """Per-sequence text state: full text, what has been emitted, stop-string matching."""

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffered = False  # the decoder holds the first bytes of an incomplete character
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self.text = ""  # decoded text, stop string cut off once matched
        self._emitted = 0  # chars of self.text already handed out
        self.stopped_on: str | None = None  # the stop string matched, if any

    @property
    def text_length(self) -> int:
        """Characters decoded so far (a partial UTF-8 character counts once it completes)."""
        return len(self.text)

    def add_token(self, token_id: int, *, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if this token completed one (only looked for
        when ``check_stop``; the scan covers the new text plus a stop string's length before it)."""
        if self.stopped_on is not None:
            return self.stopped_on
        before = len(self.text)
        data = self._tokenizer.token_bytes(token_id)
        if self._buffered:
            self.text += self._decode(data)
        else:
            try:  # nearly every token: complete UTF-8 on its own, which the decoder would return whole
                self.text += data.decode()  # (a fifth of the time of the codecs decoder's Python)
            except UnicodeDecodeError:
                self.text += self._decode(data)
        return self._check_stop(before) if check_stop else None

    def _decode(self, data: bytes) -> str:
        text = self._decoder.decode(data)
        self._buffered = bool(self._decoder.getstate()[0])
        return text

    def finish(self) -> None:
        """End of sequence: flush an incomplete trailing character (as U+FFFD)."""
        if self.stopped_on is None:
            self.text += self._decoder.decode(b"", final=True)
        self._stop = []

    def _check_stop(self, before: int) -> str | None:
        if not self._stop:
            return None
        longest = max(len(s) for s in self._stop)
        start = max(0, before - longest + 1)
        hits = [(self.text.find(s, start), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stopped_on = stop
        self._stop = []
        return stop

    def _held_back(self) -> int:
        """Chars at the end of the text that may be the beginning of a stop string."""
        held = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take_delta(self) -> str:
        """Text that is final and not yet handed out."""
        visible = len(self.text) - self._held_back()
        if visible <= self._emitted:
            return ""
        delta = self.text[self._emitted:visible]
        self._emitted = visible
        return delta
