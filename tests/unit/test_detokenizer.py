"""Incremental detokenisation: multi-byte safety and stop strings that never leak."""
from __future__ import annotations

import codecs
import sys
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


def _held_back_reference(text: str, stops: list[str]) -> int:
    """Every prefix length of every stop string tried against the end of the text (the quadratic
    algorithm the matcher replaced, issue 46 item 2): what must be held back."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=400)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 60, 61, 62]), st.booleans()), max_size=80),
       st.lists(st.text(alphabet="abc€", min_size=1, max_size=9), min_size=1, max_size=4))
def test_the_held_back_text_is_the_longest_stop_prefix_that_ends_the_text(monkeypatch_tail, steps, stop):
    """Over an alphabet small enough for stop strings to overlap themselves and each other ("abab",
    "aab"), with stop checks skipped for some tokens (min_tokens) so that whole stop strings sit in
    the text, and the tail trimmed every few characters: after every token exactly the longest
    beginning of a stop string is held back, and the stop string found is the whole-string scan's."""
    d = IncrementalDetokenizer(ByteTokenizer(), stop=stop)
    for token, check in steps:
        d.add_token(token, check_stop=check)
        if d.stopped_on is not None:
            break
        d.take_delta()
        assert d.text_length - d._emitted == _held_back_reference(d.text, stop)
    assert (d.text, d.stopped_on) == _reference_checked(steps, stop)


def _reference_checked(steps: list[tuple[int, bool]], stop: list[str]) -> tuple[str, str | None]:
    """_reference with some tokens unchecked: the whole-string scan after every checked token."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = ""
    longest = max(len(s) for s in stop)
    for t, check in steps:
        before = len(text)
        text += decoder.decode(ByteTokenizer().token_bytes(t))
        hits = [(text.find(s, max(0, before - longest + 1)), s) for s in stop] if check else []
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            return text[:i], s
    return text, None


class _OperationCounter:
    """Counts the Python lines run in cllm/detokenizer.py and the C functions they call: a measure of
    work that the machine's load cannot change."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: tuple = (None, None)

    def _trace(self, frame, event, arg):
        if frame.f_code.co_filename != detokenizer.__file__:
            return None
        if event == "line":
            self.count += 1
        return self._trace

    def _profile(self, frame, event, arg):
        if event == "c_call" and frame.f_code.co_filename == detokenizer.__file__:
            self.count += 1

    def __enter__(self) -> _OperationCounter:
        self._saved = sys.gettrace(), sys.getprofile()  # (a coverage run's tracer, given back after)
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._saved[0])
        sys.setprofile(self._saved[1])


def _operations(stops: list[str], tokens: list[int]) -> int:
    d = IncrementalDetokenizer(ByteTokenizer(), stop=stops)
    with _OperationCounter() as counter:
        for t in tokens:
            d.add_token(t)
            d.take_delta()
    assert d.stopped_on is None
    return counter.count


@pytest.mark.parametrize("workload", ["unrelated", "almost-matching", "periodic"])
def test_holding_back_costs_the_same_per_token_whatever_the_stop_length(workload):
    """Issue 46 item 2: 16 stop strings of 60 k characters cost 0.07-0.21 s of engine time a token,
    because every prefix length of every stop string was tried against the end of the text. Counted
    in operations (lines and C calls), a stream of 1,200 tokens against stop strings of 100 and of
    1,000 characters: the work per token must not grow with the stop length (the quadratic algorithm
    did 7x the operations at the longer length on unrelated text), and stays under a fixed bound per
    token and stop string on text that keeps almost matching (the matcher's own worst case)."""
    counts = {}
    for length in (100, 1000):
        if workload == "unrelated":  # "xy…" never starts in text of a-d
            stops, tokens = ["xy" * (length // 2)] * 4, [i % 4 for i in range(1200)]
        elif workload == "almost-matching":  # "aaa…ab" against "aaaa…": a partial match as long as it can be
            stops, tokens = ["a" * (length - 1) + "b"] * 4, [0] * 1200
        else:  # "abab…abc" against "abab…": the prefix held back keeps falling back by two
            stops, tokens = ["ab" * (length // 2 - 1) + "c"] * 4, [i % 2 for i in range(1200)]
        counts[length] = _operations(stops, tokens)
    assert counts[1000] < 1.5 * counts[100], counts
    assert counts[1000] < 60 * 1200 * 4, counts
