"""Median ms of one llama_decode of n tokens (every row's logits) after 150 tokens of context, 7 repeats
(benchmarks/spec_policy.py's measure_curve), and whether the loaded llama.cpp has cllm's prefetch patch.

    .venv/bin/python benchmarks/results/sgemm_prefetch_2026-11-29/curve.py WEIGHTS.gguf 1,2,3,4,5,8,16 2
    LLAMA_CPP_LIB_PATH=/path/to/other/lib .venv/bin/python ...   # the same against another llama.cpp build

WEIGHTS: the Q8_0 copy cllm runs (~/.cache/cllm/weights/SmolLM2-135M-Instruct.Q4_1.q8_0.*.gguf).
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from spec_policy import measure_curve  # noqa: E402

from cllm.backends.llama_cpp.native import q0_prefetch_blocks  # noqa: E402

path, counts, threads = sys.argv[1], tuple(int(x) for x in sys.argv[2].split(",")), int(sys.argv[3])
curve = measure_curve(path, threads, reps=7, counts=counts, context=150)
print(f"q0_prefetch_blocks={q0_prefetch_blocks()} threads={threads}", {n: round(ms, 2) for n, ms in curve.items()})
