"""Incremental detokenisation: multi-byte safety and stop strings that never leak."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

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
