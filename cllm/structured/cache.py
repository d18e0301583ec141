"""GrammarCache: compile a request's output constraint once per key, keep the most recent ones."""
from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
from typing import Any

from cllm.backends.base import Tokenizer
from cllm.sampling.params import SamplingParams
from cllm.structured.bounds import bounded_json_grammar
from cllm.structured.vocab import tokenizer_info

# Compiled JSON output is compact (", " and ": " separators, no free whitespace): a small model
# left free to emit whitespace can pad forever and never close the object.
_JSON_OPTIONS = {"any_whitespace": False}
# OpenAI's json_object mode: any JSON object (strict mode would make properties-less objects empty).
_ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


class GrammarCache:
    """Thread-safe LRU of compiled grammars keyed by ``SamplingParams.constraint_key``.

    Compiling runs in the caller's thread (AsyncLLM calls it off the event loop, before the
    request reaches the engine loop), so a cold compile never stalls running streams.
    """

    def __init__(self, tokenizer: Tokenizer, capacity: int) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use (vocabulary scan)
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self.hits = 0  # lookups served from the cache
        self.misses = 0  # compilations
        self.compile_seconds = 0.0  # total time spent compiling

    def get(self, params: SamplingParams) -> Any | None:
        """The compiled grammar for ``params`` (None when unconstrained); ValueError naming the
        constraint when it does not compile."""
        key = params.constraint_key
        if key is None:
            return None
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return compiled
        start = time.perf_counter()
        compiled = self._compile(key, params)
        with self._lock:
            self.misses += 1
            self.compile_seconds += time.perf_counter() - start
            self._compiled[key] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ValueError("constrained decoding (response_format, grammar, forced tool calls) needs "
                                     "the xgrammar package: pip install 'cllm[structured]'") from None

                # Our LRU bounds memory; xgrammar's own cache would keep every grammar ever seen.
                # Compiling (the per-state token masks) is parallel: a bounded schema (maxLength,
                # nested arrays) takes seconds on one core.
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self._tokenizer),
                                                     max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)
            return self._compiler

    def _compile(self, key: tuple[str, str], params: SamplingParams) -> Any:
        kind, text = key
        compiler = self.compiler()
        try:
            # JSON goes through xgrammar's schema converter, then gets llama.cpp's default bounds on
            # numbers and string blank runs (bounds.py), so a small model cannot ramble to max_tokens.
            if kind == "json_schema":
                return compiler.compile_grammar(bounded_json_grammar(text, **_JSON_OPTIONS))
            if kind == "json_object":
                return compiler.compile_grammar(bounded_json_grammar(_ANY_OBJECT, strict_mode=False, **_JSON_OPTIONS))
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(choice_grammar(params.choice or []))
        except Exception as err:  # xgrammar raises RuntimeError and its own types: all mean "does not compile"
            shown = text if len(text) <= 120 else text[:117] + "..."
            raise ValueError(f"invalid {kind}={shown!r}: it does not compile: {_first_line(err)}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(err: BaseException) -> str:
    """xgrammar's message without its "[hh:mm:ss] /project/cpp/file.cc:123: " prefix."""
    lines = [_SOURCE_PREFIX.sub("", line.strip()) for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:3])[:500] if lines else type(err).__name__


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
