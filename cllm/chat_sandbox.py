"""The Jinja sandbox chat templates run in: what transformers' ``apply_chat_template`` gives them.

Templates are written against transformers' environment, so anything less fails real templates
("'strftime_now' is undefined" on gpt-oss, Mistral Small 3.x, Granite 3.3). Given here, as there:
``raise_exception``, ``strftime_now``, a JSON ``tojson`` filter, a ``dict`` constructor, a
``namespace`` that rejects private attribute names, the loop controls (``{% break %}``,
``{% continue %}``) and the ``{% generation %}`` block (rendered as its body). The environment is an
ImmutableSandboxedEnvironment: templates come with model files and are untrusted code.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(ValueError):
    """The template itself refused the messages (its ``raise_exception``)."""


def compile_template(source: str) -> jinja2.Template:
    """The template, compiled in the sandbox; ValueError if its syntax is broken."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not compile (line {err.lineno}: {err.message}); "
                         f"fix it or give another with the chat_template setting") from None


def _raise(message: str) -> None:
    raise TemplateRaised(f"chat template rejected the messages: {message}")


def _strftime_now(fmt: str) -> str:
    """Today's date in the template's format (Llama 3.x, gpt-oss and Granite print it in the system turn)."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` (what chat templates are written for): plain JSON. Jinja's own filter
    HTML-escapes ("<" becomes "\\u003c") and sorts keys, which would garble tool definitions and calls."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    """``dict(...)`` for templates, without handing them the ``dict`` type itself (its attributes
    lead out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing names that start with "_" (dunder attributes reach CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick: namespace(self=...) works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace "
                                                  f"(names starting with '_' are refused)")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks the assistant's tokens for training masks in
    transformers; for inference it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
