"""What model.deterministic costs: tokens/s with the setting on and off, 1/16/64 concurrent streams, on both
backends (CPU), alternating the settings round by round in one run; and (``--paths``) which of llama.cpp's
kernel paths make a sequence's logits depend on its batch.

Throughput: for each round, backend and setting (the order flips every round), one in-process
``cllm.AsyncLLM`` is built and warmed up; then, per stream count C, C closed-loop streams each send
``--requests`` greedy requests (a ~100-token prompt of their own, ``--max-tokens`` tokens each,
ignore_eos) and the output tokens over the wall time is the figure (prefill included). Reports medians
over rounds, the on/off ratio and the TTFT p50.

``--embeddings``: inputs/s of ``LLM.embed`` over 128 inputs of 5-100 words, on and off alternating (the
setting embeds one input per forward, so what batching bought is what it costs).

``--paths`` (llama.cpp): one sequence's 300-token prompt and 40 greedy steps run whole, in chunks of 16,
beside 7 other sequences (one of them 700 tokens long), decoded in 2-row steps (the token and a throwaway
draft, as a verification) and with one thread instead of two, for each cache type and flash-attention
setting; counts the steps whose logits differ at all from the whole-prompt run with two threads
(cllm/backends/llama_cpp/determinism.py records the findings).

    .venv/bin/python benchmarks/determinism.py --rounds 3 --json benchmarks/results/determinism.json
    .venv/bin/python benchmarks/determinism.py --paths
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cllm  # noqa: E402

WORDS = ("the river market silver quickly seven ocean code function night blue mountain garden letter window "
         "history science music kitchen winter").split()


def prompt(stream: int, request: int) -> str:
    rng = random.Random(stream * 1000 + request)
    return "Continue this story: " + " ".join(rng.choice(WORDS) for _ in range(90))


async def throughput(engine: cllm.AsyncLLM, streams: int, requests: int, max_tokens: int) -> tuple[float, float]:
    """(output tokens/s, TTFT p50 in s) of ``streams`` closed-loop streams."""
    params = cllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ttfts: list[float] = []

    async def stream(i: int) -> int:
        tokens = 0
        for r in range(requests):
            final = None
            async for final in engine.generate(prompt(i, r), params):
                pass
            tokens += len(final.outputs[0].token_ids)
            ttfts.append(final.metrics.ttft or 0.0)
        return tokens

    start = time.perf_counter()
    total = sum(await asyncio.gather(*[stream(i) for i in range(streams)]))
    return total / (time.perf_counter() - start), statistics.median(ttfts)


async def one_setting(backend: str, deterministic: bool, streams: list[int], requests: int, max_tokens: int,
                      extra: dict) -> dict[int, tuple[float, float]]:
    engine = cllm.AsyncLLM(backend=backend, deterministic=deterministic, n_seq_max=max(streams), **extra)
    try:
        await throughput(engine, 2, 1, 8)  # warm-up
        return {c: await throughput(engine, c, requests, max_tokens) for c in streams}
    finally:
        await engine.shutdown()


def run_throughput(args: argparse.Namespace) -> dict:
    results: dict = {b: {s: {c: [] for c in args.streams} for s in ("off", "on")} for b in args.backend}
    for round_no in range(args.rounds):
        for backend in args.backend:
            extra = {"dtype": args.dtype} if backend == "torch" else {}
            order = (False, True) if round_no % 2 == 0 else (True, False)
            for det in order:
                got = asyncio.run(one_setting(backend, det, args.streams, args.requests, args.max_tokens, extra))
                for c, (tps, ttft) in got.items():
                    results[backend]["on" if det else "off"][c].append((tps, ttft))
                print(f"round {round_no + 1} {backend} deterministic={det}: " +
                      ", ".join(f"{c} streams {tps:.1f} tok/s (TTFT p50 {ttft:.2f} s)" for c, (tps, ttft) in got.items()),
                      flush=True)
    summary: dict = {}
    print(f"\n{'backend':10} {'streams':>7} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'TTFT off':>9} {'TTFT on':>8}")
    for backend in args.backend:
        for c in args.streams:
            off = statistics.median(t for t, _ in results[backend]["off"][c])
            on = statistics.median(t for t, _ in results[backend]["on"][c])
            ttft_off = statistics.median(x for _, x in results[backend]["off"][c])
            ttft_on = statistics.median(x for _, x in results[backend]["on"][c])
            summary.setdefault(backend, {})[c] = {"off_tok_s": off, "on_tok_s": on, "ratio": on / off,
                                                   "ttft_off_s": ttft_off, "ttft_on_s": ttft_on}
            print(f"{backend:10} {c:7d} {off:10.1f} {on:10.1f} {on / off:7.3f} {ttft_off:9.2f} {ttft_on:8.2f}")
    return {"rounds": results, "summary": summary}


def run_embeddings(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    inputs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 100))) for _ in range(128)]
    rates: dict = {b: {"off": [], "on": []} for b in args.backend}
    for round_no in range(args.rounds):
        for backend in args.backend:
            extra = {"dtype": args.dtype} if backend == "torch" else {}
            for det in (False, True) if round_no % 2 == 0 else (True, False):
                with cllm.LLM(backend=backend, deterministic=det, **extra) as llm:
                    llm.embed(inputs[:4])  # warm-up (the embeddings context is made on first use)
                    start = time.perf_counter()
                    llm.embed(inputs)
                    rate = len(inputs) / (time.perf_counter() - start)
                rates[backend]["on" if det else "off"].append(rate)
                print(f"round {round_no + 1} {backend} deterministic={det}: {rate:.1f} inputs/s", flush=True)
    summary = {b: {s: statistics.median(r[s]) for s in ("off", "on")} for b, r in rates.items()}
    for b, m in summary.items():
        print(f"{b}: embeddings off {m['off']:.1f} inputs/s, on {m['on']:.1f} inputs/s, on/off {m['on'] / m['off']:.3f}")
    return {"rounds": rates, "summary": summary}


def run_paths(model_path: Path) -> dict:
    import numpy as np

    from cllm.backends.llama_cpp.native import LlamaBatchBuffer, LlamaContextHandle, LlamaModelHandle
    from cllm.backends.llama_cpp.offload import KV_CACHE_TYPES

    model = LlamaModelHandle(path=model_path)
    rng = np.random.default_rng(0)
    target = list(rng.integers(100, 40000, 300))
    others = [list(rng.integers(100, 40000, int(n))) for n in [*rng.integers(3, 200, 6), 700]]  # one longer

    def run(kv: str, flash: bool, mode: str, threads: int) -> np.ndarray:
        ctx = LlamaContextHandle(model=model, n_ctx=8 * 1024, n_batch=2048, n_ubatch=512, n_seq_max=8,
                                 n_threads=threads, flash_attn=flash, kv_unified=False,
                                 type_k=KV_CACHE_TYPES[kv], type_v=KV_CACHE_TYPES[kv])
        batch = LlamaBatchBuffer(capacity=2048)

        def decode(tokens, positions, seqs, outputs) -> np.ndarray:
            batch.fill(tokens, positions, seqs, outputs)
            if ctx.decode(batch) != 0:
                raise RuntimeError("llama_decode failed")
            return ctx.output_logits(len(outputs))[0].copy()

        rows = []
        if mode == "chunks of 16":
            for i in range(0, len(target), 16):
                part = target[i:i + 16]
                logits = decode(part, range(i, i + len(part)), [0] * len(part), [len(part) - 1])
        elif mode == "beside 7 others":
            tokens = [t for o in others for t in o] + target
            positions = [p for o in others for p in range(len(o))] + list(range(len(target)))
            seqs = [s for s, o in enumerate(others, start=1) for _ in o] + [0] * len(target)
            logits = decode(tokens, positions, seqs, [len(tokens) - 1])
        else:
            logits = decode(target, range(len(target)), [0] * len(target), [len(target) - 1])
        rows.append(logits)
        last, pos, other_pos = int(np.argmax(logits)), len(target), [len(o) for o in others]
        for _ in range(40):
            if mode == "beside 7 others":
                logits = decode([last] + [7] * len(others), [pos] + other_pos, list(range(len(others) + 1)),
                                range(len(others) + 1))
                other_pos = [p + 1 for p in other_pos]
            elif mode == "2-row steps":  # as a verification: the token and a throwaway draft after it
                logits = decode([last, last], [pos, pos + 1], [0, 0], [0, 1])
                ctx.seq_rm(0, pos + 1, -1)
            else:
                logits = decode([last], [pos], [0], [0])
            rows.append(logits)
            last, pos = int(np.argmax(logits)), pos + 1
        ctx.close()
        return np.stack(rows)

    found = {}
    for kv, flash in [("f16", True), ("f16", False), ("bf16", True), ("q8_0", True)]:
        reference = run(kv, flash, "whole", 2)
        for mode, threads in [("chunks of 16", 2), ("beside 7 others", 2), ("2-row steps", 2), ("whole", 1)]:
            diff = np.abs(run(kv, flash, mode, threads) - reference).max(axis=1)
            key = f"kv {kv}, flash_attn {'on' if flash else 'off'}, {mode}, {threads} thread{'s' if threads > 1 else ''}"
            found[key] = {"steps_differing": int((diff > 0).sum()), "steps": len(diff), "max_abs": float(diff.max())}
            print(f"{key}: {found[key]['steps_differing']}/{len(diff)} steps differ (max {diff.max():.2e})", flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", nargs="+", default=["llama_cpp", "torch"], choices=["llama_cpp", "torch"])
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="requests per stream")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="torch: auto (bfloat16 on a CPU with native bf16) or float32")
    ap.add_argument("--paths", action="store_true", help="llama.cpp's batch-dependent kernel paths instead")
    ap.add_argument("--embeddings", action="store_true", help="embedding throughput instead")
    ap.add_argument("--model", type=Path, default=None, help="--paths: a GGUF (default: the embedded model)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.paths:
        from cllm.model_path import resolve_model_path

        out = {"paths": run_paths(args.model or resolve_model_path(None))}
    elif args.embeddings:
        out = {"embeddings": run_embeddings(args)}
    else:
        out = run_throughput(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
