"""Core-runtime benchmark: cllm.LLM vs llama.cpp's own batched-decode ceiling vs serial llama-cpp-python.

Same model file, same thread count, same prompts, greedy, ``output_len`` tokens
per request (EOS ignored). For each concurrency C:

- ceiling: llama-cpp-python's low-level API driven directly — prefill the C
  prompts, then one ``llama_decode`` of C tokens (one per sequence) per step
  with greedy argmax. Nothing but llama.cpp and an argmax: the best any
  Python engine over llama.cpp can do for this workload. Reported for the
  whole workload (prefill + decode) and for the decode steps alone.
- cllm: ``cllm.LLM.generate`` of the C prompts (n_seq_max >= C), continuously batched.
- llama-cpp-python: ``Llama.create_completion`` on the C prompts one after another.

Plus single-request tokens/s: cllm.LLM vs ``Llama`` alone. Every repeat uses fresh
prompts so no prefix cache serves a repeat from the previous one; the best
of ``--repeats`` is reported (other work on a shared machine only adds time)
and every repeat's time is in the JSON.

    .venv/bin/python benchmarks/core_throughput.py --threads 2 --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import llama_cpp as C
import numpy as np

import cllm
from cllm.bench.baseline import complete
from cllm.bench.machine import wait_for_idle
from cllm.bench.report import collect_environment, format_table
from cllm.bench.workload import load_tokenizer, random_prompts
from cllm.config import ModelConfig
from cllm.model_path import resolve_model_path

_MODEL_DEFAULTS = ModelConfig()  # cllm's n_ctx / n_batch defaults, mirrored by the ceiling context


@C.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every load detail to stderr; the benchmark prints only its table."""


class RawDecoder:
    """The llama.cpp ceiling: a bare context decoding N sequences per step, greedy argmax."""

    def __init__(self, model_path: Path, *, n_seq_max: int, n_threads: int, n_ctx: int, n_batch: int, kv_unified: bool = True) -> None:
        C.llama_backend_init()
        C.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = C.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = C.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
        cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = n_seq_max, n_threads, n_threads
        cparams.kv_unified = kv_unified  # True as cllm's llama_cpp backend; False = one KV stream per sequence
        cparams.no_perf = True
        cparams.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED  # cllm's default (flash_attn: false)
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.batch = C.llama_batch_init(n_batch, 0, 1)

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, pos, seq, wants_logits) entries; returns argmax of each logits row, in order."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants
            b.seq_id[i][0] = seq
        rc = C.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for e in entries if e[3])
        logits = np.ctypeslib.as_array(C.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> list[int]:
        """Evaluate every prompt (packed into n_batch-sized decodes); returns each one's first token."""
        first: list[int] = []
        pending: list[tuple[int, int, int, bool]] = []
        for seq, ids in enumerate(prompts):
            if pending and len(pending) + len(ids) > self.n_batch:
                first += [int(t) for t in self._decode(pending)]
                pending = []
            pending += [(t, pos, seq, pos == len(ids) - 1) for pos, t in enumerate(ids)]
        return first + [int(t) for t in self._decode(pending)]

    def run(self, prompts: Sequence[Sequence[int]], output_len: int) -> tuple[float, float]:
        """Generate ``output_len`` tokens per prompt; returns (total seconds, decode-only seconds)."""
        C.llama_memory_clear(C.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        last = self._prefill(prompts)
        decode_start = time.perf_counter()
        lengths = [len(p) for p in prompts]
        for step in range(output_len - 1):
            entries = [(last[s], lengths[s] + step, s, True) for s in range(len(prompts))]
            last = [int(t) for t in self._decode(entries)]
        end = time.perf_counter()
        return end - start, end - decode_start

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


@dataclass(slots=True)
class LevelResult:
    """Aggregate output tokens/s at one concurrency (best of the repeats; all repeats in ``samples``)."""

    concurrency: int  # requests generated together
    output_tokens: int  # output tokens per repeat (concurrency x output_len)
    ceiling_tok_s: float  # raw llama_decode loop, prefill + decode
    ceiling_decode_tok_s: float  # raw llama_decode loop, decode steps only
    cllm_tok_s: float  # cllm.LLM.generate
    llama_serial_tok_s: float  # Llama.create_completion, one request after another
    samples: dict[str, list[float]] = field(default_factory=dict)  # every repeat's seconds per system
    idle_before: list[float] = field(default_factory=list)  # CPU idle share seen before each repeat


def _best_rate(tokens: int, seconds: list[float]) -> float:
    """Tokens/s of the fastest repeat: on a shared machine other work only ever adds time."""
    return tokens / min(seconds)


def measure_level(conc: int, prompts_for: Callable[[int], list[list[int]]], systems: dict[str, object],
                  output_len: int, repeats: int, quiet: tuple[float, float] = (0.0, 0.0)) -> LevelResult:
    """Run each system on the same fresh prompts, ``repeats`` times, interleaved.

    The order of the systems rotates every repeat, so none always runs first
    after an idle wait (a cold CPU) or last. ``quiet`` = (min idle share, max
    wait s): before each repeat, wait for an idle machine.
    """
    raw: RawDecoder = systems["ceiling"]  # type: ignore[assignment]
    params = cllm.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, seed=0)
    runners: dict[str, Callable[[list[list[int]]], tuple[float, ...]]] = {
        "ceiling": lambda prompts: raw.run(prompts, output_len),
        "cllm": lambda prompts: (_time_cllm(systems["cllm"], prompts, params, conc * output_len),),
        "llama": lambda prompts: (_llama_serial(systems["llama"], prompts, output_len),),
    }
    times: dict[str, list[float]] = {"ceiling": [], "ceiling_decode": [], "cllm": [], "llama": []}
    idle_seen = []
    for rep in range(repeats):
        prompts = prompts_for(rep)
        idle_seen.append(round(wait_for_idle(*quiet), 3) if quiet[0] > 0 else -1.0)
        names = list(runners)
        for name in names[rep % 3:] + names[:rep % 3]:
            seconds = runners[name](prompts)
            times[name].append(seconds[0])
            if name == "ceiling":
                times["ceiling_decode"].append(seconds[1])
    tokens = conc * output_len
    return LevelResult(
        concurrency=conc, output_tokens=tokens, ceiling_tok_s=_best_rate(tokens, times["ceiling"]),
        ceiling_decode_tok_s=_best_rate(conc * (output_len - 1), times["ceiling_decode"]),
        cllm_tok_s=_best_rate(tokens, times["cllm"]), llama_serial_tok_s=_best_rate(tokens, times["llama"]),
        samples={k: [round(v, 4) for v in vs] for k, vs in times.items()}, idle_before=idle_seen,
    )


def _time_cllm(llm: object, prompts: list[list[int]], params: cllm.SamplingParams, expected_tokens: int) -> float:
    """Seconds for one cllm.LLM.generate call over all the prompts (continuously batched)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params)  # type: ignore[attr-defined]
    seconds = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != expected_tokens:
        raise RuntimeError(f"cllm generated {got} tokens, expected {expected_tokens}")
    return seconds


def _llama_serial(llama: object, prompts: list[list[int]], output_len: int) -> float:
    """Seconds for Llama.create_completion over the prompts one after another (non-streaming)."""
    start = time.perf_counter()
    for ids in prompts:
        got = complete(llama, ids, output_len, temperature=0.0, ignore_eos=True)
        if got != output_len:
            raise RuntimeError(f"llama-cpp-python generated {got} tokens, expected {output_len}")
    return time.perf_counter() - start


def _prompt_factory(tokenizer: object, conc: int, input_len: int, output_len: int) -> Callable[[int], list[list[int]]]:
    """Fresh, reproducible prompts per repeat (no prefix cache hits across repeats or levels)."""
    def make(rep: int) -> list[list[int]]:
        return [p.token_ids for p in random_prompts(tokenizer, conc, input_len, output_len, seed=10_000 * rep + conc)]
    return make


def table(results: list[LevelResult]) -> str:
    """The per-concurrency table, ratios against the ceiling and against serial llama-cpp-python."""
    base = next((r for r in results if r.concurrency == 1), results[0])
    rows = [[
        str(r.concurrency), f"{r.ceiling_tok_s:.1f}", f"{r.ceiling_tok_s / base.ceiling_tok_s:.2f}x",
        f"{r.ceiling_decode_tok_s:.1f}", f"{r.cllm_tok_s:.1f}", f"{r.cllm_tok_s / r.ceiling_tok_s:.3f}",
        f"{r.llama_serial_tok_s:.1f}", f"{r.cllm_tok_s / r.llama_serial_tok_s:.2f}x",
    ] for r in results]
    headers = ["concurrency", "ceiling tok/s", "vs ceiling@1", "ceiling decode-only", "cllm tok/s",
               "cllm/ceiling", "llama-cpp-python serial", "cllm/serial"]
    return format_table(headers, rows)


def single_summary(r: LevelResult) -> str:
    """Single-request overhead of cllm against Llama alone."""
    overhead = 1 - r.cllm_tok_s / r.llama_serial_tok_s
    return (f"single request: cllm.LLM {r.cllm_tok_s:.1f} tok/s, Llama alone {r.llama_serial_tok_s:.1f} tok/s, "
            f"raw llama_decode {r.ceiling_tok_s:.1f} tok/s -> cllm overhead vs Llama {overhead * 100:+.1f}%")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="repeats per level (median reported)")
    ap.add_argument("--single-repeats", type=int, default=7, help="repeats at concurrency 1")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--min-idle", type=float, default=0.0, help="before each repeat wait until this share of CPU time is idle (0 = don't)")
    ap.add_argument("--max-wait", type=float, default=300.0, help="longest wait for --min-idle, seconds")
    ap.add_argument("--ceiling-split-kv", action="store_true",
                    help="ceiling context with kv_unified=false (one KV stream per sequence) instead of cllm's unified KV")
    return ap.parse_args()


def load_systems(path: Path, args: argparse.Namespace) -> dict[str, object]:
    """The three systems under test, on the same model file and thread count."""
    n_seq = max(args.levels)
    return {
        "ceiling": RawDecoder(path, n_seq_max=n_seq, n_threads=args.threads, n_ctx=_MODEL_DEFAULTS.n_ctx,
                              n_batch=_MODEL_DEFAULTS.n_batch, kv_unified=not args.ceiling_split_kv),
        "cllm": cllm.LLM(model=args.model, backend="llama_cpp", n_seq_max=n_seq, n_threads=args.threads),
        "llama": C.Llama(str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False),
    }


def main() -> None:
    args = parse_args()
    path = resolve_model_path(args.model)
    load_before = os.getloadavg()[0]
    systems = load_systems(path, args)
    tokenizer = load_tokenizer(args.model)
    measure_level(1, _prompt_factory(tokenizer, 1, args.input_len, 8), systems, 8, 1)  # warm-up, discarded
    results = []
    for conc in args.levels:
        repeats = args.single_repeats if conc == 1 else args.repeats
        prompts_for = _prompt_factory(tokenizer, conc, args.input_len, args.output_len)
        results.append(measure_level(conc, prompts_for, systems, args.output_len, repeats, (args.min_idle, args.max_wait)))
        r = results[-1]
        print(f"  c={conc}: cllm {r.cllm_tok_s:.1f} tok/s, ceiling {r.ceiling_tok_s:.1f}, serial {r.llama_serial_tok_s:.1f}; "
              f"idle before repeats {r.idle_before}", flush=True)
    print(f"\nmodel {path.name}, threads={args.threads}, input {args.input_len} tokens, output {args.output_len} tokens (ignore_eos), "
          f"greedy; best of {args.repeats} repeats ({args.single_repeats} at c=1); 1-min load average at start {load_before:.2f}\n")
    print(table(results))
    single = next((r for r in results if r.concurrency == 1), None)
    if single:
        print("\n" + single_summary(single))
    if args.json:
        env = collect_environment(threads=args.threads, model_path=str(path)).model_dump()
        Path(args.json).write_text(json.dumps({"args": vars(args), "environment": env, "levels": [asdict(r) for r in results]}, indent=2))
    for system in systems.values():
        system.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
