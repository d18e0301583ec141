"""``flash_attn: auto`` on a CPU: measured once per machine, model and thread count, then remembered.

llama.cpp's own ``auto`` (llama-server's default) turns its flash-attention kernels on for every CPU.
Whether they are faster depends on the CPU. Measured in-process on the embedded SmolLM2-135M, 2 threads:

- AVX2 EPYC (issue 3's log): 16 sequences of ~300 tokens, one decode step 58.4 -> 51.7 ms with them on.
- AVX-512/AMX Xeon (2026-11-26): the same step 69 -> 91 ms; one sequence at 1,600 tokens 17.9 -> 31.0
  ms, and a 15-token step there (a speculative verification) 67.5 -> 281.7 ms; only a 512-token
  prefill was faster (880 -> 714 ms).

So ``auto`` on a CPU times both on this machine before the server starts: one sequence with a
``PROBE_CONTEXT``-token prompt, then one-token and ``PROBE_TOKENS``-token steps (a decode and a
verification or several sequences' decodes), alternating the two settings. Flash attention stays on (as
llama.cpp's auto) unless it is slower by more than ``MARGIN``. About two seconds, once: the verdict is
kept under the cache directory, keyed by the CPU, the llama.cpp build, the model file's content and
the thread count. A quantised V cache needs flash attention, and GPUs keep llama.cpp's own choice.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import llama_cpp as C

from cllm.backends.llama_cpp.native import LlamaBatchBuffer, LlamaContextHandle, LlamaModelHandle
from cllm.machine import cpu_model
from cllm.model_path import cache_root, file_fingerprint

log = logging.getLogger(__name__)

PROBE_CONTEXT = 384  # prompt tokens before the timed steps
PROBE_TOKENS = 8  # tokens of the multi-token step
ROUNDS = 3  # alternations of the two settings; each round times every step kind a few times
MARGIN = 0.05  # flash attention is turned off only when more than this much slower
UNQUANTISED = ("f32", "f16", "bf16")


def resolve_flash_attn(setting: bool | str, *, model: LlamaModelHandle, model_path: Path, n_threads: int,
                       gpu_layers: int, type_v: str) -> bool | str:
    """The setting to give llama.cpp: ``setting`` itself unless it is "auto" on a CPU, where this
    machine's measurement decides (True or False)."""
    if setting != "auto" or gpu_layers != 0 or type_v not in UNQUANTISED:
        return setting
    key = "|".join([cpu_model() or "unknown", C.llama_print_system_info().decode(errors="replace").strip(), C.__version__,
                    file_fingerprint(model_path), str(n_threads)])
    store = cache_root() / "flash_attn.json"
    verdicts = _read(store)
    kept = verdicts.get(key)
    if isinstance(kept, dict) and isinstance(kept.get("flash_attn"), bool):
        return kept["flash_attn"]
    started = time.perf_counter()
    try:
        on_ms, off_ms = measure(model, n_threads)
    except RuntimeError as exc:  # (a context that cannot be made, a failed decode): start as llama.cpp would
        log.warning("flash_attn auto: the probe failed (%s); llama.cpp's own auto decides, nothing kept", exc)
        return setting
    choice = off_ms * (1 + MARGIN) >= on_ms
    log.info("flash_attn auto: %s on this CPU (probe: %.1f ms with, %.1f ms without; %.1f s, once: %s)",
             "on" if choice else "off", on_ms, off_ms, time.perf_counter() - started, store)
    verdicts[key] = {"flash_attn": choice, "on_ms": round(on_ms, 2), "off_ms": round(off_ms, 2)}
    _write(store, verdicts)
    return choice


def measure(model: LlamaModelHandle, n_threads: int) -> tuple[float, float]:
    """Milliseconds of one one-token step plus one PROBE_TOKENS-token step after PROBE_CONTEXT
    tokens, with flash attention and without (medians over the rounds)."""
    contexts: dict[bool, LlamaContextHandle] = {}
    batch = LlamaBatchBuffer(capacity=PROBE_CONTEXT)
    prompt = [(7919 * i) % model.n_vocab for i in range(PROBE_CONTEXT)]
    try:
        for on in (True, False):
            contexts[on] = LlamaContextHandle(model=model, n_ctx=2 * PROBE_CONTEXT, n_batch=PROBE_CONTEXT,
                                              n_ubatch=PROBE_CONTEXT, n_seq_max=1, n_threads=n_threads,
                                              flash_attn=on, kv_unified=True)
            _decode(contexts[on], batch, prompt, 0)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for on, ctx in contexts.items():
                times[on].append(sum(_timed_step(ctx, batch, n) for n in (1, PROBE_TOKENS)))
        return statistics.median(times[True]), statistics.median(times[False])
    finally:
        for ctx in contexts.values():
            ctx.close()


def _timed_step(ctx: LlamaContextHandle, batch: LlamaBatchBuffer, n: int) -> float:
    """Median ms of three n-token steps at position PROBE_CONTEXT (each removed again)."""
    samples = []
    for _ in range(3):
        started = time.perf_counter()
        _decode(ctx, batch, [(31 * i + 11) % ctx.n_vocab for i in range(n)], PROBE_CONTEXT)
        samples.append(1000 * (time.perf_counter() - started))
        ctx.seq_rm(0, PROBE_CONTEXT, -1)
    return statistics.median(samples)


def _decode(ctx: LlamaContextHandle, batch: LlamaBatchBuffer, tokens: list[int], start: int) -> None:
    n = len(tokens)
    batch.fill(tokens, range(start, start + n), [0] * n, list(range(n)))
    rc = ctx.decode(batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} in the flash-attention probe")


def _read(store: Path) -> dict:
    """The kept verdicts; {} when there are none or the file is not what this module writes."""
    try:
        verdicts = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return verdicts if isinstance(verdicts, dict) else {}


def _write(store: Path, verdicts: dict) -> None:
    """Written beside, then renamed (a reader never sees half a file); a failure only costs a re-probe."""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts, indent=1))
        os.replace(tmp, store)
    except OSError as exc:
        log.warning("flash_attn auto: could not keep the probe's verdict in %s (%s)", store, exc)
