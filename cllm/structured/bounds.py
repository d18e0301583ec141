"""Default bounds on what a JSON grammar lets a model write without end (issue 27 item 11).

xgrammar's JSON-schema grammar lets an integer grow digit by digit forever (``[1-9] [0-9]*``), and
a string run spaces or escapes forever. A small model that prefers "1" after "1" then writes
``"population": 1111…`` until max_tokens, where llama-server stops: llama.cpp's
json-schema-to-grammar bounds a number's integral part to 16 digits and its fraction and exponent to
16. We take xgrammar's grammar for the schema and bound it the same way before compiling it:

- integral part at most 16 digits, fraction and exponent at most 16 (more when the schema's own
  ``minimum`` / ``maximum`` / ``exclusive*`` need more digits: a schema bound overrides the default);
- in a string without ``maxLength``: at most 20 spaces or escape sequences in a row (``\\n\\n\\n…``,
  ``"     …"``); anything else between them resets the run.
"""
from __future__ import annotations

import json
import re
from typing import Any

# llama.cpp's json-schema-to-grammar: integral-part [0-9]{1,16} (first digit non-zero), decimal-part
# [0-9]{1,16}.
DEFAULT_NUMBER_DIGITS = 16
# At most this many spaces / escapes in a row inside an unbounded string (llama.cpp's `space` rule
# allows 20 indentation characters).
DEFAULT_BLANK_RUN = 20

_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_RULE = re.compile(r"^(\w+) ::= (.*)$")
_DIGIT_BODY = "(([0-9]))"
# `X{a, -1}`: at least a repetitions, no upper bound.
_OPEN_REPEAT = re.compile(r"(\[1-9\] )?(\w+)\{(\d+), -1\}")
_OPEN_DIGITS = re.compile(r"\[1-9\] \[0-9\]\*")
# xgrammar's unbounded JSON string body (0.2.x); replaced by the bounded rules below.
_STRING_SUB = ('basic_string_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] basic_string_sub) | '
               '("\\\\" basic_escape basic_string_sub)) (=([ \\n\\r\\t]* [,}\\]:]))')


def _bounded_string_rules(run: int) -> str:
    return "\n".join((
        f'basic_string_sub ::= (("\\"") | (basic_string_char basic_string_sub) | '
        f'(basic_string_blank{{1, {run}}} basic_string_after_blank)) (=([ \\n\\r\\t]* [,}}\\]:]))',
        'basic_string_after_blank ::= (("\\"") | (basic_string_char basic_string_sub))',
        'basic_string_char ::= (([^\\0-\\x1f\\"\\\\\\r\\n ]))',
        'basic_string_blank ::= ((" ") | ("\\\\" basic_escape))',
    ))


def number_digits(schema: Any, default: int = DEFAULT_NUMBER_DIGITS) -> int:
    """Digits a number may have: the default, or what the schema's largest explicit bound needs."""
    widest = default
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _BOUND_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    widest = max(widest, len(str(int(abs(value)))) + 1)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return widest


def bound_grammar(ebnf: str, *, digits: int = DEFAULT_NUMBER_DIGITS, blank_run: int = DEFAULT_BLANK_RUN) -> str:
    """``ebnf`` (xgrammar's grammar of a JSON schema) with numbers and unbounded strings bounded."""
    lines = ebnf.splitlines()
    digit_rules = set()
    for line in lines:
        match = _RULE.match(line)
        if match and match.group(2).strip() == _DIGIT_BODY:
            digit_rules.add(match.group(1))

    def cap(match: re.Match[str]) -> str:
        lead, name, least = match.group(1) or "", match.group(2), int(match.group(3))
        if name not in digit_rules:
            return match.group(0)
        most = digits - 1 if lead else digits  # after a leading [1-9] digit, one fewer
        return f"{lead}{name}{{{least}, {max(least, most)}}}"

    out = []
    for line in lines:
        if line == _STRING_SUB:
            out.append(_bounded_string_rules(blank_run))
            continue
        line = _OPEN_DIGITS.sub(f"[1-9] [0-9]{{0, {digits - 1}}}", line)
        out.append(_OPEN_REPEAT.sub(cap, line))
    return "\n".join(out)


def bounded_json_grammar(schema_text: str, *, strict_mode: bool = True, any_whitespace: bool = False) -> str:
    """The EBNF grammar of a JSON schema (xgrammar's converter), bounded as this module says."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace, strict_mode=strict_mode)
    try:
        schema = json.loads(schema_text)
    except ValueError:
        schema = None
    return bound_grammar(str(grammar), digits=number_digits(schema))
