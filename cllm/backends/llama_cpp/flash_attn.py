"""``flash_attn: auto`` on a CPU: the steps a server runs, timed once per machine with and without it.

llama.cpp's own ``auto`` (llama-server's default) turns its flash-attention kernels on for every CPU.
Whether they are faster depends on the CPU and on the step. Measured in-process on the embedded
SmolLM2-135M, 2 threads:

- AVX-512/AMX Xeon (2026-11-26): 16 sequences of ~300 tokens, one decode step 69 -> 91 ms with them on;
  one sequence at 1,600 tokens 17.9 -> 31.0 ms, and a 15-token step there (a speculative verification)
  67.5 -> 281.7 ms; only a 512-token prefill was faster (880 -> 714 ms).
- AVX-512/BF16 EPYC, no AMX (issue 45): served, flash attention was faster in every workload (1.06x at
  one client, 1.44x at 16, 1.5-2.9x on 1,000-token prompts), yet the first probe here (one sequence at
  384 tokens, a 1- and an 8-token step, in a small unified cache) said 9 % slower and turned it off.

So the probe times what a server does, in a context shaped as the server's (split or unified KV, the
server's micro-batch): decode steps of one sequence and of a batch (``BATCH`` sequences, the load of a
busy server), each at a short context and at a long one (``LONG_CONTEXT``), a speculative verification
at the long context, and a prefill chunk. Each step is timed with both settings, alternating; the
verdict is the geometric mean of the on/off time ratios over the steps, so every kind of step counts
the same however long it takes. Flash attention stays on (as llama.cpp's auto) unless that mean says
it is slower by more than ``MARGIN``. A few seconds, once: the verdict and every step's times are kept
under the cache directory, keyed by the CPU, the llama.cpp build, the model file's content, the thread
count, the probe's shape and ``PROBE_VERSION``. A quantised V cache needs flash attention, and GPUs
keep llama.cpp's own choice.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp as C

from cllm.backends.llama_cpp.native import LlamaBatchBuffer, LlamaContextHandle, LlamaModelHandle, q0_prefetch_blocks
from cllm.machine import cpu_model
from cllm.model_path import cache_root, file_fingerprint
from cllm.progress import phase

log = logging.getLogger(__name__)

PROBE_VERSION = 2  # part of the cache key: verdicts of an older probe are measured again
SHORT_CONTEXT = 64  # tokens before a short-context step
LONG_CONTEXT = 1024  # tokens before a long-context step (capped at half the model's trained context)
BATCH = 16  # sequences of the batched decode steps (fewer where their KV would pass PROBE_KV_BYTES)
VERIFY_TOKENS = 8  # tokens of the verification step (a decode carrying 7 draft tokens)
PROBE_KV_BYTES = 1 << 30  # most KV memory one probe context may take
ROUNDS = 3  # alternations of the two settings; each times every step a few times
REPEATS = 3  # timings of a step per round (median); a prefill chunk is timed once a round
MARGIN = 0.05  # flash attention is turned off only when the mean ratio says more than this much slower
UNQUANTISED = ("f32", "f16", "bf16")
PROBE_ESTIMATE_S = 20  # the embedded model on 2 cores: 15-25 s (most of it the long contexts and prefill chunks)


@dataclass(slots=True)
class FlashAttnVerdict:
    """What llama.cpp was given for flash attention, and why (``/v1/engine``, the ready block)."""

    setting: bool | str  # given to llama.cpp: True, False, or "auto" (llama.cpp's own choice)
    reason: str  # "setting" | "gpu" | "quantised V cache" | "measured" | "measured before" | "probe failed: ..."
    ratio: float | None = None  # geometric mean over the probe's steps of (ms with) / (ms without)
    steps: dict[str, list[float]] = field(default_factory=dict)  # step -> [ms with, ms without]

    def text(self) -> str:
        """'on (measured: 0.80x the time of off over 6 serving steps)' and the like."""
        state = {True: "on", False: "off"}.get(self.setting, "llama.cpp's auto")  # type: ignore[arg-type]
        if self.ratio is None:
            return f"{state} ({self.reason})"
        return f"{state} ({self.reason}: {self.ratio:.2f}x the time of off over {len(self.steps)} serving steps)"


@dataclass(slots=True, frozen=True)
class ProbeShape:
    """The contexts the probe times steps in."""

    batch: int  # sequences of the batched steps
    long_context: int  # tokens before a long-context step
    chunk: int  # tokens of the prefill chunk (the server's micro-batch)
    kv_unified: bool  # the server's KV layout

    @property
    def seq_cells(self) -> int:
        return seq_cells(self.long_context)

    @property
    def n_seqs(self) -> int:
        return 2 * self.batch + 1  # a batch at the short context, one at the long, one for the prefill


def resolve_flash_attn(setting: bool | str, *, model: LlamaModelHandle, model_path: Path, n_threads: int,
                       gpu_layers: int, type_v: str, n_ubatch: int = 512, kv_unified: bool = False,
                       type_k: str = "f16") -> FlashAttnVerdict:
    """What to give llama.cpp: ``setting`` itself unless it is "auto" on a CPU, where this machine's
    measurement of serving steps decides (True or False)."""
    if setting != "auto":
        return FlashAttnVerdict(setting, "setting")
    if gpu_layers != 0:
        return FlashAttnVerdict(setting, "gpu")
    if type_v not in UNQUANTISED:
        return FlashAttnVerdict(setting, "quantised V cache")
    shape = probe_shape(model, n_ubatch=n_ubatch, kv_unified=kv_unified, type_k=type_k, type_v=type_v)
    key = "|".join([cpu_model() or "unknown", C.llama_print_system_info().decode(errors="replace").strip(), C.__version__,
                    f"q0prefetch{q0_prefetch_blocks()}",
                    file_fingerprint(model_path), str(n_threads), f"probe{PROBE_VERSION}",
                    json.dumps(asdict(shape), sort_keys=True)])
    store = cache_root() / "flash_attn.json"
    verdicts = _read(store)
    kept = _verdict_from(verdicts.get(key))
    if kept is not None:
        return kept
    started = time.perf_counter()
    try:
        with phase("timing llama.cpp's flash attention on six serving steps (once per machine and model; "
                   "llama_cpp.flash_attn=true or false skips it)", estimate_s=PROBE_ESTIMATE_S):
            steps = measure(model, n_threads, shape)
    except RuntimeError as exc:  # (a context that cannot be made, a failed decode): start as llama.cpp would
        log.warning("flash_attn auto: the probe failed (%s); llama.cpp's own auto decides, nothing kept", exc)
        return FlashAttnVerdict(setting, f"probe failed: {exc}")
    verdict = decide(steps)
    log.info("flash_attn auto: %s (%.1f s, once: %s)", verdict.text(), time.perf_counter() - started, store)
    verdicts[key] = {"flash_attn": verdict.setting, "ratio": verdict.ratio, "steps": verdict.steps}
    _write(store, verdicts)
    return verdict


def decide(steps: dict[str, list[float]]) -> FlashAttnVerdict:
    """The verdict from each step's [ms with, ms without]: on unless the geometric mean of the ratios
    exceeds 1 + MARGIN."""
    ratio = math.exp(statistics.fmean(math.log(on / off) for on, off in steps.values()))
    return FlashAttnVerdict(ratio <= 1 + MARGIN, "measured", round(ratio, 3), steps)


def probe_shape(model: LlamaModelHandle, *, n_ubatch: int, kv_unified: bool, type_k: str = "f16",
                type_v: str = "f16") -> ProbeShape:
    """The probe's contexts for this model: the long context within half its trained context, and as
    many batched sequences as PROBE_KV_BYTES holds (2 at least)."""
    long_context = min(LONG_CONTEXT, max(SHORT_CONTEXT * 2, (model.n_ctx_train or 2 * LONG_CONTEXT) // 2))
    per_seq = seq_cells(long_context) * model.kv_bytes_per_token(type_k, type_v)
    batch = max(2, min(BATCH, int(PROBE_KV_BYTES // max(2 * per_seq, 1))))
    return ProbeShape(batch, long_context, min(n_ubatch, 512), kv_unified)


def measure(model: LlamaModelHandle, n_threads: int, shape: ProbeShape) -> dict[str, list[float]]:
    """Each serving step's median ms with flash attention and without: {step: [with, without]}."""
    contexts: dict[bool, LlamaContextHandle] = {}
    batch = LlamaBatchBuffer(capacity=max(shape.chunk, shape.batch * VERIFY_TOKENS))
    try:
        for on in (True, False):
            ctx = contexts[on] = LlamaContextHandle(
                model=model, n_ctx=shape.n_seqs * shape.seq_cells, n_batch=batch.capacity, n_ubatch=shape.chunk,
                n_seq_max=shape.n_seqs, n_threads=n_threads, flash_attn=on, kv_unified=shape.kv_unified)
            _fill(ctx, batch, range(shape.batch), SHORT_CONTEXT)
            _fill(ctx, batch, range(shape.batch, 2 * shape.batch), shape.long_context)
        steps = _steps(shape)
        times: dict[str, dict[bool, list[float]]] = {name: {True: [], False: []} for name in steps}
        for _ in range(ROUNDS):
            for on, ctx in contexts.items():
                for name, (seqs, context, tokens) in steps.items():
                    times[name][on].append(_timed_step(ctx, batch, seqs, context, tokens))
        return {name: [round(statistics.median(t[True]), 2), round(statistics.median(t[False]), 2)]
                for name, t in times.items()}
    finally:
        for ctx in contexts.values():
            ctx.close()


def _steps(shape: ProbeShape) -> dict[str, tuple[range, int, int]]:
    """step name -> (its sequences, context tokens before the step, tokens per sequence). Sequences
    0..batch-1 hold SHORT_CONTEXT tokens, batch..2*batch-1 the long context, the last one none."""
    b, long = shape.batch, shape.long_context
    return {
        f"decode 1 seq at {SHORT_CONTEXT}": (range(1), SHORT_CONTEXT, 1),
        f"decode 1 seq at {long}": (range(b, b + 1), long, 1),
        f"decode {b} seqs at {SHORT_CONTEXT}": (range(b), SHORT_CONTEXT, 1),
        f"decode {b} seqs at {long}": (range(b, 2 * b), long, 1),
        f"verify {VERIFY_TOKENS} tokens at {long}": (range(b, b + 1), long, VERIFY_TOKENS),
        f"prefill {shape.chunk} tokens": (range(2 * b, 2 * b + 1), 0, shape.chunk),
    }


def _fill(ctx: LlamaContextHandle, batch: LlamaBatchBuffer, seqs: range, context: int) -> None:
    """The sequences ``seqs`` hold the same ``context`` tokens: the first is prefilled (in batch-sized
    pieces), the others get a copy of its state."""
    first = seqs[0]
    for start in range(0, context, batch.capacity):
        n = min(context - start, batch.capacity)
        _decode(ctx, batch, [_token(ctx, i) for i in range(start, start + n)], [first] * n, range(start, start + n))
    state = ctx.save_seq(first)
    for s in seqs[1:]:
        if not ctx.load_seq(s, state):
            raise RuntimeError(f"could not copy the probe's context to sequence {s}")


def _timed_step(ctx: LlamaContextHandle, batch: LlamaBatchBuffer, seqs: range, context: int, tokens: int) -> float:
    """Median ms of REPEATS steps (one for a prefill chunk: long enough to time once) of ``tokens`` tokens
    on each of ``seqs`` at position ``context``, each removed again."""
    ids = [_token(ctx, context + 7 + i) for i in range(tokens)]
    samples = []
    for _ in range(1 if tokens > 2 * VERIFY_TOKENS else REPEATS):
        started = time.perf_counter()
        _decode(ctx, batch, ids * len(seqs), [s for s in seqs for _ in range(tokens)],
                list(range(context, context + tokens)) * len(seqs))
        samples.append(1000 * (time.perf_counter() - started))
        for s in seqs:
            ctx.seq_rm(s, context, -1)
    return statistics.median(samples)


def seq_cells(long_context: int) -> int:
    """KV cells a probe sequence gets: the long context and room for the steps after it."""
    return long_context + 256


def _token(ctx: LlamaContextHandle, i: int) -> int:
    return (7919 * i + 11) % ctx.n_vocab


def _decode(ctx: LlamaContextHandle, batch: LlamaBatchBuffer, tokens: list[int], seqs: list[int],
            positions: Sequence[int]) -> None:
    n = len(tokens)
    last_of_seq = [i for i in range(n) if i == n - 1 or seqs[i + 1] != seqs[i]]
    batch.fill(tokens, positions, seqs, last_of_seq)
    rc = ctx.decode(batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} in the flash-attention probe")


def _verdict_from(kept: object) -> FlashAttnVerdict | None:
    """A kept verdict, or None when there is none or it is not what this module writes."""
    if not isinstance(kept, dict) or not isinstance(kept.get("flash_attn"), bool):
        return None
    steps = kept.get("steps")
    ratio = kept.get("ratio")
    if not isinstance(steps, dict) or not isinstance(ratio, (int, float)):
        return None
    return FlashAttnVerdict(kept["flash_attn"], "measured before", float(ratio), steps)


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
