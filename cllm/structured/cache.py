"""GrammarCache: compile a request's output constraint once per key, keep the most recent ones."""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import threading
import time
from typing import Any

from cllm.backends.base import Tokenizer
from cllm.sampling.params import SamplingParams
from cllm.structured.bounds import bounded_json_grammar
from cllm.structured.limits import (
    DEFAULT_LIMITS,
    CompileBusyError,
    CompileTimeoutError,
    ConstraintLimits,
    check_constraint,
    current_payer,
    grammar_bytes,
)
from cllm.structured.vocab import tokenizer_info

# Compiled JSON output is compact (", " and ": " separators, no free whitespace): a small model
# left free to emit whitespace can pad forever and never close the object.
_JSON_OPTIONS = {"any_whitespace": False}
# OpenAI's json_object mode: any JSON object (strict mode would make properties-less objects empty).
_ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": True})


class GrammarCache:
    """Thread-safe LRU of compiled grammars keyed by ``SamplingParams.constraint_key``, bounded by
    count and by memory.

    A cold compile runs in the cache's own small pool, waited for with a time budget (limits.py);
    callers call ``get`` off the event loop (AsyncLLM uses a thread, before the request reaches the
    engine loop), so a cold compile never stalls running streams. Concurrent requests for the same
    constraint share one compile.
    """

    def __init__(self, tokenizer: Tokenizer, capacity: int, limits: ConstraintLimits = DEFAULT_LIMITS) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self.limits = limits
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use (vocabulary scan)
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of each cached grammar
        self._inflight: dict[tuple[str, str], concurrent.futures.Future] = {}  # compiles running or queued
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the compile threads, on first use
        self.cached_bytes = 0  # memory of the cached grammars together
        self.hits = 0  # lookups served from the cache
        self.misses = 0  # compilations
        self.compile_seconds = 0.0  # total time spent compiling

    def get(self, params: SamplingParams) -> Any | None:
        """The compiled grammar for ``params`` (None when unconstrained). ValueError naming the
        constraint when it is too large or deep, does not compile, or compiles past the budget;
        CompileBusyError when the compile threads stayed busy; the payer's error when its client
        is over its share of compiles."""
        key = params.constraint_key
        if key is None:
            return None
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return compiled
            future = self._inflight.get(key)
        if future is None:
            future = self._start(key, params)
        return self._wait(key, future)

    def is_cached(self, key: tuple[str, str]) -> bool:
        """Whether ``key``'s grammar is compiled and kept (a ``get`` would return at once)."""
        with self._lock:
            return key in self._compiled

    def _start(self, key: tuple[str, str], params: SamplingParams) -> concurrent.futures.Future:
        check_constraint(key[0], key[1], self.limits)  # before any work: 400 for a hostile body
        self.compiler()  # the one-time vocabulary scan is not the constraint's compile time
        payer = current_payer()
        release = payer.begin_compile() if payer is not None else None  # 429 for a client over its share
        try:
            with self._lock:
                future = self._inflight.get(key)  # another thread started it meanwhile
                started = future is None
                if future is None:
                    if self._pool is None:
                        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.compile_threads,
                                                                           thread_name_prefix="cllm-compile")
                    future = self._pool.submit(self._compile_and_keep, key, params)
                    self._inflight[key] = future
        except BaseException:
            if release is not None:
                release()
            raise
        if release is not None:
            if started:  # the client stays charged until the compile really ends, budget or not
                future.add_done_callback(lambda _: release())
            else:
                release()
        return future

    def _wait(self, key: tuple[str, str], future: concurrent.futures.Future) -> Any:
        budget = self.limits.compile_timeout_s
        busy = CompileBusyError(f"the grammar compiler stayed busy for {budget:g} s (other requests' constraints); "
                                "retry later")
        try:
            return future.result(timeout=budget)
        except concurrent.futures.CancelledError:  # another waiter of the same compile gave up on the queue
            raise busy from None
        except concurrent.futures.TimeoutError:
            if future.cancel():  # never started: every compile thread was busy all along
                with self._lock:
                    if self._inflight.get(key) is future:
                        del self._inflight[key]
                raise busy from None
            kind, text = key
            raise CompileTimeoutError(
                f"invalid {kind}={_shown(text)}: compiling it takes longer than this server's {budget:g} s budget; "
                "make it simpler (fewer properties or alternatives, smaller maxLength / maxItems / "
                "repetition bounds)") from None

    def _compile_and_keep(self, key: tuple[str, str], params: SamplingParams) -> Any:
        start = time.perf_counter()
        try:
            compiled = self._compile(key, params)
            size = grammar_bytes(compiled)
            if size > self.limits.max_grammar_bytes:
                raise ValueError(
                    f"invalid {key[0]}={_shown(key[1])}: its compiled grammar takes {size / 2**20:.1f} MiB, more than "
                    f"this server's {self.limits.max_grammar_bytes / 2**20:.1f} MiB per grammar; make it simpler")
            with self._lock:
                self._keep(key, compiled, size)
            return compiled
        finally:
            with self._lock:
                self.misses += 1
                self.compile_seconds += time.perf_counter() - start
                self._inflight.pop(key, None)

    def _keep(self, key: tuple[str, str], compiled: Any, size: int) -> None:
        """Cache a grammar, then drop the least recently used past the count or the memory bound
        (the newest few stay: their requests are on their way to the engine)."""
        self.cached_bytes += size - self._sizes.get(key, 0)  # a key compiled twice (a cancel race) counts once
        self._compiled[key] = compiled
        self._sizes[key] = size
        while self._compiled and (len(self._compiled) > self._capacity or (
                self.cached_bytes > self.limits.cache_bytes and len(self._compiled) > self.limits.keep_newest)):
            old, _ = self._compiled.popitem(last=False)
            self.cached_bytes -= self._sizes.pop(old, 0)

    def close(self) -> None:
        """Stop the compile threads: queued compiles are cancelled; one running cannot be
        interrupted (xgrammar) and finishes in the background rather than hold the engine's close."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

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
            raise ValueError(f"invalid {kind}={_shown(text)}: it does not compile: {_first_line(err)}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 120 else text[:117] + "...")


def _first_line(err: BaseException) -> str:
    """xgrammar's message without its "[hh:mm:ss] /project/cpp/file.cc:123: " prefix."""
    lines = [_SOURCE_PREFIX.sub("", line.strip()) for line in str(err).splitlines() if line.strip()]
    return " ".join(lines[:3])[:500] if lines else type(err).__name__


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
