"""Incremental, UTF-8-safe detokenisation with stop strings that never leak.

Tokens arrive one at a time as raw bytes. An incremental UTF-8 decoder holds
back an incomplete multi-byte character until its last byte arrives, so no
U+FFFD ever appears mid-stream for text that is valid once complete. Text that
could be the start of a stop string is held back too, until it is clear
whether the stop string follows.

The text is kept as a short tail, where new text lands, stop strings are looked
for and deltas are cut, and the pieces before it (handed out, and further back
than any stop string reaches): appending to one growing string copied the whole
text at every token, which for long outputs is quadratic (a 7 kB text: 0.9 µs a
token; 256 such streams, a fifth of an engine step).

How much to hold back is kept per stop string by a Knuth-Morris-Pratt matcher fed
each token's new text, which also tells when a whole stop string ended: trying
every prefix length against the end of the text cost the square of the stop
string's length per token (16 stop strings of 60 k characters: 0.07-0.21 s of
engine time a token, issue 46 item 2), and scanning a stop string's length of
text for a match at every token cost ~1 ms a token there; now ~15 µs, and
2-3 µs a token with one or two short stop strings (5.5 µs before).
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence

from cllm.backends.base import Tokenizer

TAIL_CHARS = 512  # the tail is trimmed once it is longer than this (and the longest stop string)


class StopPrefixMatcher:
    """The longest prefix of one stop string that ends the text fed so far (a KMP automaton).

    Feeding costs amortised O(1) a character: the state rises by at most one per character and
    every fall-back lowers it. The prefix function (borders of the stop string's prefixes) is built
    only as far as the state has reached, so a long stop string the text never approaches costs
    nothing up front either.
    """

    __slots__ = ("_stop", "_state", "_borders")

    def __init__(self, stop: str) -> None:
        self._stop = stop
        self._state = 0  # length of the longest prefix of the stop string that ends the text (may be all of it)
        self._borders = [0]  # _borders[i]: longest proper border of stop[: i + 1], built on demand

    def _border(self, length: int) -> int:
        """The longest proper prefix of ``stop[:length]`` that is also its suffix (``length`` >= 1)."""
        borders, stop = self._borders, self._stop
        while len(borders) < length:
            i = len(borders)
            k, c = borders[i - 1], stop[i]
            while k and stop[k] != c:
                k = borders[k - 1]
            borders.append(k + 1 if stop[k] == c else 0)
        return borders[length - 1]

    def feed(self, text: str) -> bool:
        """Advance over ``text``, appended to the text fed before; whether a whole stop string ended in it."""
        stop, state = self._stop, self._state
        if not state and stop[0] not in text:
            return False  # nothing in ``text`` can start the stop string (the usual case, in C)
        if state and state + len(text) <= len(stop) and stop.startswith(text, state):
            self._state = state + len(text)  # the partial match goes on: nothing longer can end the text
            return self._state == len(stop)
        whole = False
        for c in text:
            while state and (state == len(stop) or stop[state] != c):
                state = self._border(state)
            if stop[state] == c:
                state += 1
                whole = whole or state == len(stop)
        self._state = state
        return whole

    def held(self) -> int:
        """Characters at the end of the text that may begin the stop string (shorter than it)."""
        return self._state if self._state < len(self._stop) else self._border(self._state)


class IncrementalDetokenizer:
    """Per-sequence text state: full text, what has been emitted, stop-string matching."""

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, end_ids: frozenset[int] = frozenset()) -> None:
        """``skip_special_tokens=False``: a control token (no bytes of its own) shows as its special-token
        text ("<|channel|>"), except the ``end_ids`` that end the output (EOS, stop token ids)."""
        self._tokenizer = tokenizer
        self._show_special = not skip_special_tokens
        self._end_ids = end_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffered = False  # the decoder holds the first bytes of an incomplete character
        self._stop = [s for s in stop if s]
        self._matchers = [StopPrefixMatcher(s) for s in self._stop]  # how much to hold back, per stop string
        self._include_stop = include_stop
        self._longest = max((len(s) for s in self._stop), default=0)
        self._head: list[str] = []  # the text before the tail (handed out, beyond any stop string's reach)
        self._head_length = 0
        self._tail = ""  # the rest of the decoded text; stop string cut off once matched
        self._emitted = 0  # chars of the whole text already handed out (never before the tail's start)
        self._unchecked = False  # the last token was added without a stop check (see add_token)
        self.stopped_on: str | None = None  # the stop string matched, if any

    @property
    def text(self) -> str:
        """The decoded text (stop string cut off once matched): joined, so a read costs its length."""
        return "".join(self._head) + self._tail if self._head else self._tail

    @property
    def text_length(self) -> int:
        """Characters decoded so far (a partial UTF-8 character counts once it completes)."""
        return self._head_length + len(self._tail)

    def add_token(self, token_id: int, *, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string if this token completed one (only looked for
        when ``check_stop``; the scan covers the new text plus a stop string's length before it)."""
        if self.stopped_on is not None:
            return self.stopped_on
        before = len(self._tail)
        data = self._tokenizer.token_bytes(token_id)
        if not data and self._show_special and token_id not in self._end_ids:
            data = self._tokenizer.special_token(token_id).encode()
        if self._buffered:
            new = self._decode(data)
        else:
            try:  # nearly every token: complete UTF-8 on its own, which the decoder would return whole
                new = data.decode()  # (a fifth of the time of the codecs decoder's Python)
            except UnicodeDecodeError:
                new = self._decode(data)
        self._tail += new
        ended = False  # a whole stop string ended in the new text
        if new:
            for matcher in self._matchers:
                ended = matcher.feed(new) or ended
        stop = None
        # The scan (C, but over a stop string's length a token) only when it can find something: when every
        # token was checked, anything it finds ends in the new text, which the matchers saw. After unchecked
        # tokens (min_tokens) it may find a shorter stop string before them, as it always did.
        if check_stop and self._stop and (ended or self._unchecked):
            stop = self._check_stop(before)
        self._unchecked = not check_stop
        if len(self._tail) > TAIL_CHARS + self._longest:
            self._trim()
        return stop

    def _trim(self) -> None:
        """Move to the head what of the tail is handed out and further back than a stop string reaches."""
        cut = min(self._emitted - self._head_length, len(self._tail) - self._longest)
        if cut > 0:
            self._head.append(self._tail[:cut])
            self._head_length += cut
            self._tail = self._tail[cut:]

    def _decode(self, data: bytes) -> str:
        text = self._decoder.decode(data)
        self._buffered = bool(self._decoder.getstate()[0])
        return text

    def finish(self) -> None:
        """End of sequence: flush an incomplete trailing character (as U+FFFD); the text becomes one string."""
        if self.stopped_on is None:
            self._tail += self._decoder.decode(b"", final=True)
        self._stop, self._matchers = [], []
        if self._head:
            self._tail, self._head, self._head_length = self.text, [], 0

    def _check_stop(self, before: int) -> str | None:
        """The first stop string in the tail's new text (``before``: its length before the token)."""
        if not self._stop:
            return None
        start = max(0, before - self._longest + 1)  # (the tail always holds a stop string's length before)
        hits = [(self._tail.find(s, start), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self._tail = self._tail[: index + len(stop)] if self._include_stop else self._tail[:index]
        self.stopped_on = stop
        self._stop, self._matchers = [], []
        return stop

    def _held_back(self) -> int:
        """Chars at the end of the text that may be the beginning of a stop string (never more than the
        tail holds: it keeps the longest stop string's length once trimmed, and is all the text before)."""
        return max(m.held() for m in self._matchers)

    def take_delta(self) -> str:
        """Text that is final and not yet handed out."""
        visible = len(self._tail) - (self._held_back() if self._stop else 0)
        emitted = self._emitted - self._head_length
        if visible <= emitted:
            return ""
        self._emitted = self._head_length + visible
        return self._tail[emitted:visible]
