"""Baseline target: llama-cpp-python's ``Llama.create_completion``, one request at a time.

This is what a llama-cpp-python user gets: one ``Llama`` object that serves
one request after another (its server holds a global lock). Requests that
arrive while another runs wait, and the wait counts in their TTFT and E2E,
exactly as behind that lock.

``Llama.create_completion`` has no ``ignore_eos``. A logit bias would add a
Python logits processor to every token (about 5% slower on the embedded model),
so instead, when the model emits an end token early, the request continues
from prompt + output + that end token, which is what ``ignore_eos`` computes;
llama-cpp-python's prefix match re-evaluates only the new token.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from cllm.bench.metrics import RequestRecord, StreamTimer
from cllm.bench.workload import BenchPrompt, GenerationSettings

BASELINES = ("llama-cpp-python",)


class _TokenCounter:
    """A stopping criterion that never stops: counts sampled tokens."""

    def __init__(self) -> None:
        self.count = 0  # tokens sampled, the end token included (plus one past max_tokens)

    def __call__(self, input_ids: np.ndarray, logits: np.ndarray) -> bool:
        self.count += 1
        return False


def _greedy_last_token(llama: Any) -> int:
    """The argmax of the context's latest logits: under greedy decoding, the token just sampled."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llama.n_vocab(),))))


class LlamaCppPythonTarget:
    """Serial ``llama_cpp.Llama`` on the same model file and thread count.

    The ``Llama`` is created and always driven on one dedicated thread. llama.cpp
    here is built with OpenMP, and every OS thread that runs a decode gets its own
    OpenMP worker team; loading on one thread and decoding on ``asyncio.to_thread``
    workers measured 25-40% slower than a single thread (73-83 -> 44-63 tok/s), which
    would handicap the baseline unfairly.
    """

    def __init__(self, llama: Any, executor: ThreadPoolExecutor, name: str = "llama-cpp-python") -> None:
        self.name = name  # label in tables
        self._llama = llama
        self._executor = executor  # the one thread that owns ``llama``
        self._lock = asyncio.Lock()

    @classmethod
    def open(cls, model_path: str | Path, *, n_ctx: int, n_threads: int | None, n_batch: int = 512) -> LlamaCppPythonTarget:
        """Load the model as a llama-cpp-python user would, on the target's own thread."""
        import llama_cpp

        import cllm.backends.llama_cpp.native  # noqa: F401 - its AMX workaround covers this Llama too

        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-cpp-python")
        llama = executor.submit(
            llama_cpp.Llama, str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
            n_threads_batch=n_threads, verbose=False,
        ).result()
        return cls(llama, executor)

    async def send(self, prompt: BenchPrompt, settings: GenerationSettings, run_start: float) -> RequestRecord:
        """Queue behind the running request, then stream this one on the model's thread."""
        timer = StreamTimer.begin(prompt.index, len(prompt.token_ids), prompt.output_len, run_start, time.perf_counter())
        run = functools.partial(
            complete, self._llama, prompt.token_ids, prompt.output_len, temperature=settings.temperature,
            seed=settings.seed + prompt.index, ignore_eos=settings.ignore_eos, on_text=timer.chunk,
        )
        async with self._lock:
            try:
                generated = await asyncio.get_running_loop().run_in_executor(self._executor, run)
            except Exception as exc:  # one failed request is a result, not a crash
                return timer.fail(time.perf_counter(), f"{type(exc).__name__}: {exc}")
        return timer.finish(time.perf_counter(), output_tokens=generated)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._llama.close)
        self._executor.shutdown(wait=True)


def complete(
    llama: Any, token_ids: Sequence[int], max_tokens: int, *, temperature: float = 0.0, seed: int = 0,
    ignore_eos: bool = True, on_text: Callable[[float], None] | None = None,
) -> int:
    """Run ``Llama.create_completion`` until ``max_tokens`` tokens; returns tokens generated (end tokens included).

    With ``on_text`` the completion streams and ``on_text(perf_counter())`` is
    called per non-empty chunk; without it, it runs non-streaming. Without
    ``ignore_eos`` it stops at the first end token. Under greedy decoding the
    end token re-fed on continuation is exactly the one sampled (its argmax).
    """
    import llama_cpp

    tokens, generated = list(token_ids), 0
    while generated < max_tokens:
        counter = _TokenCounter()
        result = llama.create_completion(
            tokens, max_tokens=max_tokens - generated, temperature=temperature, seed=seed,
            stream=on_text is not None, stopping_criteria=llama_cpp.StoppingCriteriaList([counter]),
        )
        finish = _consume(result, on_text) if on_text is not None else result["choices"][0]["finish_reason"]
        # create_completion samples one token past max_tokens before it stops; that one is not output.
        generated += min(counter.count, max_tokens - generated)
        if finish != "stop" or not ignore_eos:
            break
        # Continue past the end token, as ignore_eos would: it is part of the output.
        tokens = [int(t) for t in llama._input_ids] + [_greedy_last_token(llama)]
    return generated


def _consume(stream: Iterator[dict[str, Any]], on_text: Callable[[float], None]) -> str | None:
    """Read a streamed completion, reporting non-empty chunks; returns its finish_reason."""
    finish = None
    for chunk in stream:
        choice = chunk["choices"][0]
        if choice["text"]:
            on_text(time.perf_counter())
        finish = choice.get("finish_reason") or finish
    return finish
