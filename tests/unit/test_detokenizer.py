"""Incremental detokenisation: multi-byte safety and stop strings that never leak."""
from __future__ import annotations

from cllm.detokenizer import IncrementalDetokenizer
from tests.unit.fakes import ByteTokenizer

EURO = [60, 61, 62]  # the three bytes of "€"


def stream(tokens, **kw):
    d = IncrementalDetokenizer(ByteTokenizer(), **kw)
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
