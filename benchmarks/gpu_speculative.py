"""Speculative decoding on the torch backend (CUDA, or the CPU with --smoke): speed, acceptance, identity.

A random-weight model of the Llama-3.2-1B shape (bfloat16, vocabulary 49,152 with the embedded model's
tokenizer from ``--tokenizer``), ``cllm.LLM(backend="torch")`` with ``speculative`` off, then ngram (one
engine at a time: each takes the device's memory), greedy:

- one stream, 256 tokens after a prompt: output tokens/s (end to end, prefill included), acceptance;
- 64 streams at once: tokens/s (speculation must not slow a busy batch);
- greedy outputs with and without speculation compared token for token (the share of sequences identical:
  on a GPU in bfloat16 a position verified inside a multi-token chunk runs other kernels than a one-token
  graph step, so near-ties can flip, as between any two batch shapes: docs/reproducibility.md).

A random model copies nothing on purpose; what n-gram drafts it gets are the loops greedy decoding of
random weights falls into. So this checks the path on a GPU (verification rows in the batch, block
roll-back, CUDA graphs kept for pure decode steps) and its cost when drafts fail; the speed-up on text a
model copies is measured on the CPU by benchmarks/speculative.py.

    PYTHONPATH=.site:. python3 benchmarks/gpu_speculative.py --tokenizer .tok
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_decode import SHAPES, build_model  # noqa: E402

SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0)


def engine(model_dir: Path, mode: str, device: str):
    from cllm import LLM

    return LLM(backend="torch", model=str(model_dir), device=device, speculative=mode, n_seq_max=64, gpu_n_seq_max=64,
               n_ctx=1024 * 64 if device == "cpu" else 1024)


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (120,), generator=gen).tolist() for _ in range(n)]


def timed(llm, batch: list[list[int]], tokens: int):
    from cllm.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(batch, params)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, fewer tokens")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    tokens = 32 if args.smoke else args.tokens
    workdir = Path(tempfile.mkdtemp(prefix="cllm-spec-gpu-"))
    try:
        shape = SMOKE if args.smoke else {**SHAPES["llama-3.2-1b"], "vocab_size": 49152}
        SHAPES["bench"] = shape
        build_model("bench", torch.float32 if args.smoke else torch.bfloat16, workdir, torch.device(device))
        for f in args.tokenizer.iterdir():
            shutil.copy(f, workdir / f.name)
        # One engine at a time (each sizes its KV pool to the device's free memory): off, then ngram; the
        # device's speed does not drift between the two on a GPU the way a shared CPU's does.
        one, many, ids, stats = {}, {}, {}, None
        for mode in ("off", "ngram"):
            llm = engine(workdir, mode, device)
            timed(llm, prompts(2), 16)  # warm-up
            rates1, rates64 = [], []
            for _ in range(args.rounds):
                rate, ids1 = timed(llm, prompts(1), tokens)
                rates1.append(rate)
                rate, ids64 = timed(llm, prompts(64), tokens // 2)
                rates64.append(rate)
            one[mode], many[mode], ids[mode] = rates1, rates64, (ids1, ids64)
            stats = llm.engine.speculator.stats if llm.engine.speculator is not None else stats
            llm.close()
            del llm
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        pairs = list(zip(ids["off"][0] + ids["off"][1], ids["ngram"][0] + ids["ngram"][1]))
        same = sum(a == b for a, b in pairs) / len(pairs)  # bf16 on a GPU: near-ties flip (docs/reproducibility.md)
        report = {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "one_stream_tok_s": {m: statistics.median(v) for m, v in one.items()},
            "streams_64_tok_s": {m: statistics.median(v) for m, v in many.items()},
            "greedy_identical": same,
            "proposed": stats.proposed_tokens, "accepted": stats.accepted_tokens,
            "acceptance_rate": stats.acceptance_rate, "tokens_per_verify": stats.emitted_tokens / max(1, stats.verify_steps),
        }
        r1 = report["one_stream_tok_s"]["ngram"] / report["one_stream_tok_s"]["off"]
        r64 = report["streams_64_tok_s"]["ngram"] / report["streams_64_tok_s"]["off"]
        print(f"{report['device']}: one stream {report['one_stream_tok_s']['off']:.0f} -> {report['one_stream_tok_s']['ngram']:.0f} "
              f"tok/s ({r1:.2f}x); 64 streams {report['streams_64_tok_s']['off']:.0f} -> "
              f"{report['streams_64_tok_s']['ngram']:.0f} ({r64:.2f}x); drafts {stats.proposed_tokens}, accepted "
              f"{stats.accepted_tokens} ({stats.acceptance_rate:.0%}); greedy outputs identical: {same:.0%}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
