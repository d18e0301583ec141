"""Decode throughput of the torch backend vs transformers, on the embedded SmolLM2 GGUF (CPU).

For each concurrency C, C distinct prompts each generate ``--max-tokens``
tokens greedily with EOS ignored; tokens/s = C * max_tokens / wall time
(prefill included: prompts are ~12 tokens, so decode dominates, unless
``--prompt-tokens N`` pads each prompt to N tokens to measure decode at long
context). Every runner gets the same token ids:

- cllm: ``cllm.LLM(backend="torch").generate`` of the C prompts, continuously batched.
- hf generate: transformers ``generate`` on one left-padded static batch of the same prompts.
- hf generate_batch: transformers' continuous batching (``generate_batch``).

transformers runs in float32 (its CPU default); cllm in ``--dtype`` (auto =
bfloat16 on CPUs with AVX512-BF16/AMX, else float32 with float16 linear weights:
``--linear-weights``). Best of ``--repeats`` per cell; each
repeat uses fresh prompts so no prefix cache serves one repeat from another.

    .venv/bin/python benchmarks/torch_decode.py --threads 2 --levels 1 4 16 32

``--isa avx2`` measures an AVX2-only machine on a newer CPU: the run restarts with torch's
kernels (``ATEN_CPU_CAPABILITY``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and MKL
(``MKL_ENABLE_INSTRUCTIONS``) capped at AVX2, for cllm and transformers alike. Memory
bandwidth and core speed stay the machine's own, so it approximates, not reproduces, one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

import cllm
from cllm.bench.machine import wait_for_idle
from cllm.model_path import resolve_model_path

TOPICS = ["a lighthouse", "a robot", "the ocean", "a dragon", "a city", "a garden", "a train", "a violin"]
FILLER = "The museum opened its doors early that morning, and visitors filled the quiet halls. "

# Environment that caps torch, oneDNN and MKL at AVX2; read when they load, so set before torch is imported.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

Runner = Callable[[list[list[int]], int], int]  # (prompts as token ids, max_tokens) -> tokens generated


def make_prompts(tokenizer: cllm.Tokenizer, level: int, repeat: int, prompt_tokens: int) -> list[list[int]]:
    """``level`` distinct prompts; a fresh set per repeat so no prefix cache serves one repeat from another."""
    prompts = []
    for i in range(level):
        ids = tokenizer.encode(f"Request {repeat}-{i}: write a short story about {TOPICS[i % len(TOPICS)]}.")
        filler = tokenizer.encode(FILLER, add_special=False)
        while len(ids) < prompt_tokens:
            ids += filler
        prompts.append(ids[:prompt_tokens] if prompt_tokens else ids)
    return prompts


def best_rate(run: Runner, tokenizer: cllm.Tokenizer, level: int, args: argparse.Namespace) -> float:
    """Generated tokens per second, best of ``args.repeats``."""
    rates = []
    for r in range(args.repeats):
        prompts = make_prompts(tokenizer, level, r, args.prompt_tokens)
        wait_for_idle(args.min_idle, args.max_wait)
        start = time.perf_counter()
        tokens = run(prompts, args.max_tokens)
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates)


def cllm_runner(args: argparse.Namespace) -> tuple[Runner, cllm.LLM]:
    n_ctx = max(args.levels) * (args.prompt_tokens + args.max_tokens + 64)
    llm = cllm.LLM(backend="torch", dtype=args.dtype, linear_weights=args.linear_weights, n_threads=args.threads,
                   n_seq_max=max(args.levels), n_ctx=max(n_ctx, 8192))

    def run(prompts: list[list[int]], max_tokens: int) -> int:
        outs = llm.generate(prompts, cllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run([llm.tokenizer.encode("warm up")], 4)
    return run, llm


def hf_runners(args: argparse.Namespace) -> dict[str, Runner]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = resolve_model_path(None)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        width = max(map(len, prompts))  # left padding, masked out
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(prompts)

    def generate_batch(prompts: list[list[int]], max_tokens: int) -> int:
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad)
        outs = model.generate_batch(prompts, generation_config=config, warmup=False)
        return sum(len(o.generated_tokens) for o in outs.values())

    runners: dict[str, Runner] = {"hf generate": generate}
    if hasattr(model, "generate_batch") and not args.no_generate_batch:
        runners["hf generate_batch"] = generate_batch
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32], help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="pad every prompt to this many tokens (0 = ~12)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every runner")
    parser.add_argument("--dtype", default="auto", help="cllm torch dtype (auto|float32|bfloat16)")
    parser.add_argument("--linear-weights", default="auto", help="cllm torch linear_weights (auto|dtype|float16)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is reported")
    parser.add_argument("--min-idle", type=float, default=0.0, help="before each run wait until this share of CPU is idle")
    parser.add_argument("--max-wait", type=float, default=300.0, help="longest wait for --min-idle, seconds")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--no-generate-batch", action="store_true", help="skip transformers' generate_batch")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: cap torch/oneDNN/MKL at AVX2 (restarts the run with their environment set)")
    args = parser.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    torch.set_num_threads(args.threads)

    run, llm = cllm_runner(args)
    backend = llm.engine.backend
    weights = ", float16 weights" if backend.fp16_weights else ""
    runners = {f"cllm torch ({backend.dtype}{weights})".replace("torch.", ""): run}
    if not args.no_hf:
        runners.update(hf_runners(args))
    tokenizer = llm.tokenizer
    table = {name: [best_rate(fn, tokenizer, level, args) for level in args.levels] for name, fn in runners.items()}
    width = max(map(len, table)) + 2
    context = f"{args.prompt_tokens}-token prompts" if args.prompt_tokens else "~12-token prompts"
    print(f"decode tokens/s, {context}, {args.max_tokens} tokens per request, {args.threads} threads, "
          f"best of {args.repeats}, CPU kernels: {torch.backends.cpu.get_cpu_capability()}")
    print("runner".ljust(width) + "".join(f"{f'C={c}':>10}" for c in args.levels))
    for name, rates in table.items():
        print(name.ljust(width) + "".join(f"{r:>10.1f}" for r in rates))


if __name__ == "__main__":
    main()
