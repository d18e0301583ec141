"""Sampler microbenchmark: ms per step of `cllm.sampling.sampler.sample` on synthetic logits.

Rows x vocab: 64 x 128,256 (Llama-3 vocabulary) and 64 x 49,152 (SmolLM2).
Two settings per shape: greedy, and temperature + top_k + top_p + penalties
(repetition, presence, frequency over a 128-token prompt and 64 output tokens).
Logits are drawn once per shape (a peaked distribution, as a language model's:
Gumbel noise scaled so the top tokens dominate); each step samples a fresh copy
(the sampler works in place, as on llama.cpp's output buffer).

    .venv/bin/python benchmarks/sampler.py [--repeats 20] [--json sampler.json]

Target (issue 8): <= 15 ms per step for 64 x 128,256 with top_p.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from cllm.sampling.params import SamplingParams
from cllm.sampling.sampler import SamplingRow, sample

SHAPES = [(64, 128_256), (64, 49_152)]
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temp+top_k+top_p+penalties": dict(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1,
                                       presence_penalty=0.2, frequency_penalty=0.2),
    "temp+top_p (no top_k)": dict(temperature=0.8, top_p=0.95),
}


def make_rows(n: int, vocab: int, settings: dict[str, float], seed: int) -> list[SamplingRow]:
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=256, **settings)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, vocab, 128).tolist()
        output = rng.integers(0, vocab, 64).tolist()
        rows.append(SamplingRow(params, np.random.default_rng(i), prompt, output, frozenset({0})))
    return rows


def time_step(logits: np.ndarray, rows: list[SamplingRow], repeats: int) -> list[float]:
    work = np.empty_like(logits)
    times = []
    for _ in range(repeats):
        np.copyto(work, logits)
        start = time.perf_counter()
        sample(work, rows)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    print(f"{'rows x vocab':>14s}  {'setting':28s}  {'median ms':>9s}  {'p90 ms':>7s}")
    for n, vocab in SHAPES:
        rng = np.random.default_rng(0)
        logits = (rng.gumbel(size=(n, vocab)) * 2.0).astype(np.float32)
        for name, settings in SETTINGS.items():
            times = sorted(time_step(logits, make_rows(n, vocab, settings, 1), args.repeats))
            med, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
            results.append({"rows": n, "vocab": vocab, "setting": name, "median_ms": round(med, 2), "p90_ms": round(p90, 2)})
            print(f"{n:>4d} x {vocab:<7d}  {name:28s}  {med:9.2f}  {p90:7.2f}")
    print(f"(load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps({"loadavg": os.getloadavg(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
