"""What one output constraint may cost (issue 27 item 12): a client sending many distinct, large or
deeply nested ``json_schema`` / ``grammar`` bodies must not be a CPU or memory denial of service.

- Before any work: the constraint's text size and nesting depth are checked (ValueError naming
  the field: HTTP 400).
- Compiling runs in a small pool of its own, with a time budget: past it the request fails
  (``CompileTimeoutError``, 400) while the compile finishes in the background (xgrammar cannot be
  interrupted; the pool bounds how many run at once, and the client stays charged until it ends).
- A compiled grammar larger than ``max_grammar_bytes`` is refused; the cache keeps at most
  ``cache_bytes`` of them (their per-state token masks are megabytes each: 128 schemas of a dozen
  fields held ~680 MB before, which is where the fuzz run's RSS went).
- Who pays: the server charges each cold compile to the client that caused it (``CompilePayer``, set
  for the request's context by ``cllm.server.client_quota``), so one client cannot occupy the pool.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cllm.errors import QueueFullError


@dataclass(slots=True, frozen=True)
class ConstraintLimits:
    """Bounds on one constraint and on all compiled grammars together."""

    max_text_bytes: int = 256 * 1024  # a json_schema / grammar / regex / choice list's text (UTF-8)
    max_depth: int = 40  # JSON nesting of a schema (a forced tool call adds 8); () nesting of a grammar / regex
    compile_timeout_s: float = 10.0  # one compile, queueing included
    compile_threads: int = 2  # compiles running at once (each uses up to 8 xgrammar threads)
    max_grammar_bytes: int = 64 << 20  # one compiled grammar (xgrammar's memory_size_bytes)
    cache_bytes: int = 128 << 20  # all cached compiled grammars together
    keep_newest: int = 4  # cached grammars kept past cache_bytes (a request compiles, then the engine adds it)


DEFAULT_LIMITS = ConstraintLimits()


class CompileTimeoutError(ValueError):
    """A constraint took longer than the compile budget: the request fails with HTTP 400."""


class CompileBusyError(QueueFullError):
    """Every compile thread stayed busy for the whole budget: HTTP 429, retry later."""


class CompilePayer(Protocol):
    """Who a cold compile is charged to. ``begin_compile`` raises (an HTTP 429 error) when the payer
    is over its share, else returns the function that ends the charge."""

    def begin_compile(self) -> Callable[[], None]: ...


# The payer of compiles made in this context: the server sets it per request (client_quota.py); the
# compile's worker thread inherits it through asyncio.to_thread. None (Python API, engine thread):
# nobody is charged.
_PAYER: contextvars.ContextVar[CompilePayer | None] = contextvars.ContextVar("cllm_compile_payer", default=None)


def charge_compiles_to(payer: CompilePayer | None) -> None:
    """Charge the cold compiles of the current context (one request) to ``payer``."""
    _PAYER.set(payer)


def current_payer() -> CompilePayer | None:
    return _PAYER.get()


def check_constraint(kind: str, text: str, limits: ConstraintLimits) -> None:
    """ValueError naming the constraint when its text is too large or too deeply nested."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > limits.max_text_bytes:
        raise ValueError(f"invalid {kind}=<{size} bytes>: larger than the {limits.max_text_bytes} bytes this server "
                         f"compiles; send a smaller {_what(kind)}")
    if kind in ("json_schema", "choice"):
        depth = json_depth(text)
    else:
        depth = paren_depth(text, quotes='"[' if kind == "grammar" else "[")
    if depth > limits.max_depth:
        raise ValueError(f"invalid {kind}=<nested {depth} levels deep>: deeper than the {limits.max_depth} levels "
                         f"this server compiles; flatten the {_what(kind)}")


def _what(kind: str) -> str:
    return {"json_schema": "JSON schema (response_format, or a tool's parameters)", "grammar": "grammar",
            "regex": "regular expression", "choice": "choice list"}.get(kind, kind)


def json_depth(text: str) -> int:
    """Deepest nesting of objects / arrays in JSON ``text`` (brackets inside strings not counted);
    iterative, so a hostile document cannot exhaust the stack."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def paren_depth(text: str, quotes: str = '"[') -> int:
    """Deepest ``(`` nesting of a grammar or regex, outside ``quotes`` (a grammar's "literals",
    character classes)."""
    depth = deepest = 0
    quote: str | None = None  # '"' inside a grammar literal, "[" inside a character class
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote is not None:
            if (quote == '"' and ch == '"') or (quote == "[" and ch == "]"):
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def grammar_bytes(compiled: Any) -> int:
    """Memory a compiled grammar holds (0 when xgrammar cannot say)."""
    try:
        return int(compiled.memory_size_bytes)
    except (AttributeError, TypeError, ValueError):
        return 0

