"""Issue 27 items 11 and 12: JSON grammars bound numbers and blank runs by default (as llama.cpp's
json-schema-to-grammar), schema bounds override them; hostile constraints are refused or bounded
(size, depth, compile time, cache memory, compiles per client)."""
from __future__ import annotations

import json

import pytest

from cllm.sampling.params import SamplingParams

xgr = pytest.importorskip("xgrammar")

from cllm.structured.cache import GrammarCache  # noqa: E402


class ByteVocab:
    """Every byte is a token (id = byte value), 256 is EOS: any text can be written."""

    vocab_size = 257
    eos_token_ids = frozenset({256})

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == 256 else bytes([token_id])


def accepts(params: SamplingParams, text: str, *, complete: bool = False) -> bool:
    """Whether the compiled constraint accepts ``text`` (as a prefix, or as a complete reply)."""
    matcher = xgr.GrammarMatcher(GrammarCache(ByteVocab(), 4).get(params))
    ok = all(matcher.accept_token(b) for b in text.encode())
    return ok and (not complete or matcher.accept_token(256))


CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"], "additionalProperties": False}
HEAD = '{"name": "Paris", "country": "France", "population": '


# ---- item 11: default bounds ----------------------------------------------------------------------


def test_integer_has_at_most_16_digits_by_default():
    city = SamplingParams(json_schema=CITY)
    assert accepts(city, HEAD + "1" * 16 + "}", complete=True)
    assert not accepts(city, HEAD + "1" * 17)  # the 17th digit is refused: the object must close


@pytest.mark.parametrize("bound", [{"maximum": 10 ** 18}, {"minimum": 10 ** 17}, {"minimum": 0, "maximum": 10 ** 18}])
def test_schema_bounds_override_the_default(bound):
    """18 digits, past the default 16, where the schema's own bound allows them (xgrammar takes
    integer bounds up to int64)."""
    schema = json.loads(json.dumps(CITY))
    schema["properties"]["population"].update(bound)
    assert accepts(SamplingParams(json_schema=schema), HEAD + "1" * 18 + "}", complete=True)


def test_number_fraction_and_exponent_are_bounded():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = SamplingParams(json_schema=schema)
    assert accepts(params, '{"x": -1234567890123456.1234567890123456e1234567890123456}', complete=True)
    assert not accepts(params, '{"x": 1.' + "2" * 17)
    assert not accepts(params, '{"x": 1e' + "2" * 17)
    assert not accepts(params, '{"x": ' + "9" * 17)


def test_unbounded_strings_bound_runs_of_spaces_and_escapes():
    city = SamplingParams(json_schema=CITY)
    assert accepts(city, '{"name": "a' + " " * 20 + 'b' + "\\n" * 20 + '"')
    assert not accepts(city, '{"name": "a' + " " * 21)
    assert not accepts(city, '{"name": "' + "\\n" * 21)
    assert not accepts(city, '{"name": "' + " \\t" * 11)  # mixed blanks are one run
    assert accepts(city, '{"name": "' + " x" * 200 + '"')  # text of any length still fits
    bounded = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}}, "required": ["s"]}
    assert accepts(SamplingParams(json_schema=bounded), '{"s": "' + " " * 30 + '"}', complete=True)  # maxLength rules


def test_json_object_mode_is_bounded_too():
    params = SamplingParams(json_object=True)
    assert accepts(params, '{"n": ' + "7" * 16 + "}", complete=True)
    assert not accepts(params, '{"n": ' + "7" * 17)
