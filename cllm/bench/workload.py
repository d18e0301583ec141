"""What a benchmark sends and when: prompts, sampling settings, arrivals.

Prompts come from the model's own tokenizer (random word tokens re-encoded to
an exact token count, with a fixed seed) or from the small prompt set shipped
in ``cllm/bench/data/prompts.jsonl``. ``run_load`` drives any ``Target`` with
a bound on requests in flight and optional Poisson arrivals.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

from cllm.bench.metrics import RequestRecord
from cllm.model_path import resolve_model_path

PROMPT_SET_PATH = Path(__file__).parent / "data" / "prompts.jsonl"
DATASETS = ("random", "prompts")


class PromptTokenizer(Protocol):
    """The tokenizer calls the workload needs."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class GGUFTokenizer:
    """A GGUF file's tokenizer through llama-cpp-python (vocabulary only, no weights)."""

    def __init__(self, model_path: str | Path) -> None:
        import llama_cpp

        with _stderr_silenced():  # a vocab-only Llama still warns about its (unused) context size
            self._llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)

    @property
    def vocab_size(self) -> int:
        return self._llama.n_vocab()

    def encode(self, text: str) -> list[int]:
        """Token ids as the model sees the text (BOS added if the model wants one)."""
        return self._llama.tokenize(text.encode("utf-8"), add_bos=True, special=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._llama.detokenize(list(token_ids)).decode("utf-8", errors="replace")


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null for a while (native code writes there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class HFTokenizer:
    """A Hugging Face model directory's tokenizer."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(model_dir))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)


def load_tokenizer(model: str | None) -> PromptTokenizer:
    """The tokenizer of a GGUF file or HF directory; None = the embedded default model."""
    path = resolve_model_path(model)
    return HFTokenizer(path) if path.is_dir() else GGUFTokenizer(path)


@dataclass(slots=True)
class BenchPrompt:
    """One request of the workload."""

    index: int  # position in the workload
    text: str  # prompt text (sent to HTTP targets)
    token_ids: list[int]  # tokenizer.encode(text) (sent to in-process targets)
    output_len: int  # output tokens to ask for


@dataclass(slots=True)
class GenerationSettings:
    """Sampling settings shared by every request of a run."""

    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # request i uses seed + i
    ignore_eos: bool = True  # generate exactly output_len tokens


class Target(Protocol):
    """Something that serves benchmark requests: an in-process engine, a URL, a baseline."""

    name: str

    async def send(self, prompt: BenchPrompt, settings: GenerationSettings, run_start: float) -> RequestRecord:
        """Serve one request, timing it against ``run_start`` (perf_counter). Never raises for a failed request."""
        ...

    async def close(self) -> None:
        """Release the engine / connections."""
        ...


class _WordVocabulary:
    """Token ids that decode to one plain word with a leading space: stable under re-encoding."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tokenizer = tokenizer

    @cached_property
    def ids(self) -> np.ndarray:
        words = []
        for token_id in range(self._tokenizer.vocab_size):
            piece = self._tokenizer.decode([token_id])
            if len(piece) >= 3 and piece[0] == " " and piece[1:].isascii() and piece[1:].isalpha():
                words.append(token_id)
        if len(words) < 100:
            raise ValueError("the tokenizer has too few word tokens to build random prompts; use --dataset prompts")
        return np.asarray(words, dtype=np.int64)


def _exact_length_prompt(tokenizer: PromptTokenizer, words: np.ndarray, rng: np.random.Generator, n_tokens: int) -> tuple[str, list[int]]:
    """Random word text whose encoding (with BOS, if any) is exactly ``n_tokens`` long."""
    ids = [int(t) for t in rng.choice(words, size=n_tokens)]
    for _ in range(50):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == n_tokens and text:
            return text, encoded
        surplus = len(encoded) - n_tokens
        if surplus > 0:
            ids = ids[: max(1, len(ids) - surplus)]
        else:
            ids.extend(int(t) for t in rng.choice(words, size=max(1, -surplus)))
    raise ValueError(f"could not build a prompt of exactly {n_tokens} tokens; try another --input-len")


def random_prompts(tokenizer: PromptTokenizer, num: int, input_len: int, output_len: int, seed: int) -> list[BenchPrompt]:
    """``num`` prompts of random words, each exactly ``input_len`` tokens; same seed, same prompts."""
    if input_len < 2:
        raise ValueError(f"invalid input_len={input_len}: must be >= 2 tokens")
    words = _WordVocabulary(tokenizer).ids
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(num):
        text, ids = _exact_length_prompt(tokenizer, words, rng, input_len)
        prompts.append(BenchPrompt(index=i, text=text, token_ids=ids, output_len=output_len))
    return prompts


def load_prompt_set(path: Path = PROMPT_SET_PATH) -> list[str]:
    """The prompt texts of a JSONL file with one ``{"prompt": ...}`` object per line."""
    texts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            item = json.loads(line)
            if not isinstance(item.get("prompt"), str) or not item["prompt"]:
                raise ValueError(f"{path}:{line_no}: each line needs a non-empty string 'prompt'")
            texts.append(item["prompt"])
    return texts


def dataset_prompts(tokenizer: PromptTokenizer, num: int, output_len: int, seed: int, path: Path = PROMPT_SET_PATH) -> list[BenchPrompt]:
    """``num`` prompts from the shipped set, shuffled by ``seed`` (cycled when num > set size)."""
    texts = load_prompt_set(path)
    order = np.random.default_rng(seed).permutation(len(texts))
    prompts = []
    for i in range(num):
        text = texts[int(order[i % len(texts)])]
        prompts.append(BenchPrompt(index=i, text=text, token_ids=tokenizer.encode(text), output_len=output_len))
    return prompts


def make_prompts(tokenizer: PromptTokenizer, dataset: str, num: int, input_len: int, output_len: int, seed: int) -> list[BenchPrompt]:
    """The workload for ``--dataset random|prompts``."""
    if num < 1 or output_len < 1:
        raise ValueError(f"invalid num_prompts={num} / output_len={output_len}: both must be >= 1")
    if dataset == "random":
        return random_prompts(tokenizer, num, input_len, output_len, seed)
    if dataset == "prompts":
        return dataset_prompts(tokenizer, num, output_len, seed)
    raise ValueError(f"unknown dataset {dataset!r}; valid: {', '.join(DATASETS)}")


def arrival_gaps(num: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds to wait before each request: all 0 without a rate, else a Poisson process
    (exponential gaps) whose first request goes at once, as in vLLM's benchmark."""
    if request_rate is None:
        return [0.0] * num
    if not request_rate > 0:
        raise ValueError(f"invalid request_rate={request_rate!r}: must be > 0 requests/s")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num)
    return [0.0] + [float(g) for g in gaps[1:num]] if num else []


async def run_load(
    target: Target,
    prompts: Sequence[BenchPrompt],
    settings: GenerationSettings,
    *,
    concurrency: int | None,
    request_rate: float | None = None,
    desc: str = "",
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt to ``target``: at most ``concurrency`` in flight, arriving at ``request_rate``.

    Returns the records in workload order and the duration (first send to last finish).
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"invalid concurrency={concurrency}: must be >= 1")
    limit = asyncio.Semaphore(concurrency or len(prompts))
    bar = tqdm(total=len(prompts), desc=desc or target.name, unit="req", disable=not progress, leave=False)

    async def one(prompt: BenchPrompt) -> RequestRecord:
        async with limit:
            record = await target.send(prompt, settings, run_start)
        bar.update(1)
        return record

    tasks = []
    run_start = time.perf_counter()
    for prompt, gap in zip(prompts, arrival_gaps(len(prompts), request_rate, settings.seed)):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(prompt)))
    records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - run_start
    bar.close()
    return records, duration
