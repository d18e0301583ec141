"""Incremental detokenisation: multi-byte safety and stop strings that never leak."""
from __future__ import annotations

import codecs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cllm import detokenizer
from cllm.detokenizer import IncrementalDetokenizer
from tests.unit.fakes import ByteTokenizer

EURO = [60, 61, 62]  # the three bytes of "€"


def stream(tokens, tokenizer=None, **kw):
    d = IncrementalDetokenizer(tokenizer or ByteTokenizer(), **kw)
    deltas = []
    for t in tokens:
        d.add_token(t)
        deltas.append(d.take_delta())
    d.finish()
    deltas.append(d.take_delta())
    return d, deltas


def test_multibyte_char_is_never_split():
    d, deltas = stream([0] + EURO + [1])
    assert deltas[:5] == ["a", "", "", "€", "b"]
    assert "\ufffd" not in "".join(deltas) and d.text == "a€b"


def test_incomplete_tail_flushes_as_replacement_at_end():
    d, deltas = stream([0, 60, 61])
    assert "".join(deltas) == "a\ufffd"


def test_stop_string_is_cut_and_never_leaks():
    d, deltas = stream([0, 1, 2, 3, 4], stop=["cd"])
    assert d.stopped_on == "cd" and d.text == "ab"
    assert "".join(deltas) == "ab" and "c" not in "".join(deltas)


def test_partial_stop_prefix_is_released_when_not_a_stop():
    _, deltas = stream([0, 1, 2, 4], stop=["cd"])
    assert deltas[2] == "" and deltas[3] == "ce"


def test_stop_string_across_multibyte_and_include_stop():
    d, _ = stream([0] + EURO + [1], stop=["€b"], include_stop=True)
    assert d.text == "a€b"


class _RawBytes(ByteTokenizer):
    """Token i is the single byte i (0-255): any byte sequence, valid UTF-8 or not."""

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


class _Pieces(ByteTokenizer):
    """Each token is one of a few multi-byte pieces: whole characters, split ones and invalid bytes."""

    PIECES = [b"a", b"\xe2\x82", b"\xac", "€".encode(), b"\xff", b"\x80b", "é".encode(), b"\xc3", b"\xa9z", b""]

    def token_bytes(self, token_id: int) -> bytes:
        return self.PIECES[token_id]


@given(st.lists(st.integers(0, 255), max_size=40))
def test_text_equals_a_whole_decode_with_replacement_for_any_bytes(tokens):
    """Token by token, complete characters go straight through and the rest through the incremental
    decoder: the text is always what decoding all the bytes at once with errors="replace" gives."""
    d = IncrementalDetokenizer(_RawBytes())
    for t in tokens:
        d.add_token(t)
    d.finish()
    assert d.text == bytes(tokens).decode("utf-8", errors="replace")


@given(st.lists(st.integers(0, len(_Pieces.PIECES) - 1), max_size=30))
def test_multi_byte_pieces_decode_as_the_whole_stream(tokens):
    d, streamed = stream(tokens, _Pieces())
    whole = b"".join(_Pieces.PIECES[t] for t in tokens).decode("utf-8", errors="replace")
    assert d.text == whole and "".join(streamed) == whole


def _reference(tokens: list[int], stop: list[str], include: bool) -> tuple[str, str | None]:
    """The whole-string algorithm: append each token's text to one string, look for a stop string in
    the new text (and a stop string's length before it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    longest = max(len(s) for s in stop)
    for t in tokens:
        before = len(text)
        text += decoder.decode(ByteTokenizer().token_bytes(t))
        hits = [(text.find(s, max(0, before - longest + 1)), s) for s in stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            return (text[: i + len(s)] if include else text[:i]), s
    return text + decoder.decode(b"", final=True), None


@pytest.fixture()
def monkeypatch_tail(monkeypatch):
    monkeypatch.setattr(detokenizer, "TAIL_CHARS", 3)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=300)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 3, 23, 24, 25, 60, 61, 62]), st.booleans()), max_size=120),
       st.lists(st.sampled_from(["bc", "xyz", "€b", "dab", "cccc"]), min_size=1, max_size=3), st.booleans())
def test_long_text_with_a_short_tail_keeps_stop_strings_and_deltas_exact(monkeypatch_tail, steps, stop, include):
    """With the tail trimmed every few characters, stop strings that straddle the trimmed part are still
    found, nothing past a stop string is handed out, and the deltas (taken after some tokens only, as
    a reader that falls behind or a hand-off's replay does) add up to the text."""
    d = IncrementalDetokenizer(ByteTokenizer(), stop=stop, include_stop=include)
    streamed = ""
    for token, take in steps:
        d.add_token(token)
        if take:
            streamed += d.take_delta()
        if d.stopped_on is not None:
            break
    d.finish()
    streamed += d.take_delta()
    text, stopped = _reference([t for t, _ in steps], stop, include)
    assert (d.text, d.stopped_on) == (text, stopped)
    assert streamed == d.text
