"""Median ms of one llama_decode of n tokens (every row's logits) after 150 tokens of context, 7 repeats.

    .venv/bin/python benchmarks/results/sgemm_prefetch_2026-11-29/curve.py WEIGHTS.gguf 1,2,3,4,5,8,16 2
    LLAMA_CPP_LIB_PATH=/path/to/other/lib .venv/bin/python ...   # the same against another llama.cpp build

WEIGHTS: the Q8_0 copy cllm runs (~/.cache/cllm/weights/SmolLM2-135M-Instruct.Q4_1.q8_0.*.gguf).
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import llama_cpp  # noqa: E402

from cllm.backends.llama_cpp.native import avoid_amx_extra_buffers, q0_prefetch_blocks  # noqa: E402

avoid_amx_extra_buffers()
path, ns, threads = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_batch=512, n_ubatch=512, logits_all=True,
                      verbose=False, flash_attn=False)
tokens = llm.tokenize(" ".join(f"item {i}, apples, bread, milk." for i in range(40)).encode())
times: dict[int, list[float]] = {n: [] for n in ns}
for _ in range(7):
    for n in ns:
        llm.reset()
        llm.eval(tokens[:150])
        start = time.perf_counter()
        llm.eval(tokens[150:150 + n])
        times[n].append((time.perf_counter() - start) * 1000)
print(f"q0_prefetch_blocks={q0_prefetch_blocks()} threads={threads}",
      {n: round(statistics.median(t), 2) for n, t in times.items()})
