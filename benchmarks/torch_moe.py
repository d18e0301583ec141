"""Decode throughput of the torch backend vs transformers on a random Mixture-of-Experts model (CPU).

A seeded random model of the chosen shape (default: Qwen3-MoE-like, width 512,
8 layers, 64 experts, top 8, expert width 256, SmolLM2's 49,152-id vocabulary
and tokenizer) is written once as a Hugging Face directory; both runners load
the same weights. For each concurrency C, C distinct random prompts of
``--prompt-tokens`` ids each generate ``--tokens`` tokens greedily with EOS
ignored; tokens/s = C * tokens / wall time (prefill included):

- cllm: ``cllm.LLM(backend="torch").generate`` of the C prompts, continuously
  batched (``--model-impl`` picks cllm's native decoder or transformers' model
  code over cllm's paged KV, once that setting exists).
- hf generate: transformers ``generate`` on one left-padded batch of the same
  prompts, ``min_new_tokens`` = ``max_new_tokens`` (its experts implementation,
  e.g. grouped_mm, is named in the table).

Both run in ``--dtype`` (float32, or bfloat16: what MoE checkpoints ship in, and cllm's default on a
CPU with native bf16 matmul) on the same ``--threads``. Best of ``--repeats`` per cell; each
repeat uses fresh prompts so no prefix cache serves one repeat from another. The runners take turns
on each repeat's prompts, and with two of them the table is followed by their ratio repeat by repeat
(back-to-back runs of the same prompts: the figure a drifting machine disturbs least).

    .venv/bin/python benchmarks/torch_moe.py --threads 2 --levels 1 16 --tokens 32 \\
        --out benchmarks/results/torch_moe_<machine>_<date>/result.json

``--arch mixtral`` times a Mixtral-shaped model instead (every layer sparse,
experts as wide as ``--moe-intermediate``); ``--arch gemma3_text`` / ``llama`` a dense model of the
same width and depth (cllm.tiny_models' family config: Gemma 3's sliding:full layers with a
1,024-token window; MLP 4x wide), for the generic path (``--model-impl transformers``).
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cllm
from cllm.model_path import resolve_model_path

Runner = Callable[[list[list[int]], int], int]  # (prompts as token ids, tokens) -> tokens generated
VOCAB = 49152  # SmolLM2's tokenizer (the embedded GGUF's), so every id decodes


def model_config(args: argparse.Namespace) -> Any:
    """The transformers config of the random model."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                  num_experts_per_tok=args.top_k, max_position_embeddings=4096, initializer_range=0.02,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if args.arch in ("gemma3_text", "llama"):  # dense shapes: the generic path against transformers and native
        from cllm.tiny_models import tiny_config

        return tiny_config(args.arch, window=1024, vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                           head_dim=args.hidden // args.heads, intermediate_size=4 * args.hidden,
                           initializer_range=0.02)
    if args.arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=args.experts, intermediate_size=args.moe_intermediate)
    return Qwen3MoeConfig(**common, num_experts=args.experts, moe_intermediate_size=args.moe_intermediate,
                          intermediate_size=4 * args.moe_intermediate, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[])


def build_model(args: argparse.Namespace, path: Path) -> None:
    """Seeded random weights and SmolLM2's tokenizer, saved as an HF model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)
    model.save_pretrained(path)
    gguf = resolve_model_path(None)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)


def make_prompts(level: int, repeat: int, args: argparse.Namespace) -> list[list[int]]:
    """``level`` distinct prompts; a fresh set per repeat so no prefix cache serves one repeat from another."""
    rng = np.random.default_rng([args.seed, repeat, level])
    return rng.integers(3, VOCAB, size=(level, args.prompt_tokens)).tolist()


def rates_by_turns(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    """Generated tokens per second of every repeat, per runner and level. The runners take turns on each
    repeat's prompts, so a drift of the machine's speed during the run (this VM's drifts by up to a third
    within an hour) falls on all of them alike."""
    rates: dict[str, dict[int, list[float]]] = {name: {level: [] for level in args.levels} for name in runners}
    for level in args.levels:
        for r in range(args.repeats):
            prompts = make_prompts(level, r, args)
            for name, run in runners.items():
                start = time.perf_counter()
                tokens = run(prompts, args.tokens)
                rates[name][level].append(tokens / (time.perf_counter() - start))
    return rates


def cllm_runner(args: argparse.Namespace, path: Path) -> tuple[str, Runner]:
    settings: dict[str, Any] = dict(backend="torch", dtype=args.dtype, linear_weights=args.linear_weights,
                                    device="cpu", n_threads=args.threads, n_seq_max=max(args.levels),
                                    n_ctx=max(args.levels) * (args.prompt_tokens + args.tokens + 64))
    if args.model_impl:
        settings["model_impl"] = args.model_impl
    if args.moe_dense_decode:
        settings["moe_dense_decode"] = args.moe_dense_decode
    llm = cllm.LLM(model=str(path), **settings)

    def run(prompts: list[list[int]], tokens: int) -> int:
        outs = llm.generate(prompts, cllm.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run([[5, 6, 7]], 4)  # warm-up
    impl = getattr(llm.engine.backend, "model_impl", "native")
    weights = ", float16 weights" if llm.engine.backend.fp16_weights else ""
    model = llm.engine.backend.model
    sparse = [layer.moe for layer in model.layers if layer.moe is not None] if llm.engine.backend.model_impl == "native" else []
    dense = f", dense experts to {sparse[0].dense_max_tokens} tokens" if sparse and sparse[0].dense is not None else ""
    return f"cllm torch ({impl}{weights}{dense})", run


def hf_runner(args: argparse.Namespace, path: Path) -> tuple[str, Runner]:
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": args.hf_experts} if args.hf_experts else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype), **kwargs).eval()
    pad = 2

    def run(prompts: list[list[int]], tokens: int) -> int:
        width = max(map(len, prompts))  # left padding, masked out
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(prompts)

    run([[5, 6, 7]], 4)  # warm-up
    experts = getattr(model.config, "_experts_implementation", None) or "default"
    return f"hf generate (experts {experts})", run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["qwen3_moe", "mixtral", "gemma3_text", "llama"], default="qwen3_moe", help="model family")
    parser.add_argument("--hidden", type=int, default=512, help="residual width")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (all sparse)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (head_dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    parser.add_argument("--experts", type=int, default=64, help="experts per layer")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--moe-intermediate", type=int, default=256, help="each expert's MLP width")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--model-dir", type=Path, help="keep the random model here (reused if it holds one)")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16], help="concurrent sequences")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="random prompt length")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype of both runners")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both runners")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is reported")
    parser.add_argument("--linear-weights", default="dtype", help="cllm torch linear_weights (dtype|float16|auto)")
    parser.add_argument("--model-impl", default=None, help="cllm torch model_impl (native|transformers|auto)")
    parser.add_argument("--moe-dense-decode", default=None, help="cllm torch moe_dense_decode (auto|on|off)")
    parser.add_argument("--hf-experts", default=None, help="transformers experts_implementation (eager|grouped_mm|...)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_dir or Path(tmp)
        if not (path / "config.json").is_file():
            build_model(args, path)
        runners = dict([cllm_runner(args, path)] + ([] if args.no_hf else [hf_runner(args, path)]))
        rates = rates_by_turns(runners, args)
    report(args, rates)


def report(args: argparse.Namespace, rates: dict[str, dict[int, list[float]]]) -> None:
    """The best rate of each cell; with two runners, also their ratio repeat by repeat (the same prompts, back to back)."""
    table = {name: [max(by_level[level]) for level in args.levels] for name, by_level in rates.items()}
    shape = (f"{args.arch}: hidden {args.hidden}, {args.layers} layers, {args.experts} experts top {args.top_k}, "
             f"expert width {args.moe_intermediate}, heads {args.heads}/{args.kv_heads}, vocab {VOCAB}")
    print(f"decode tokens/s, {shape}; {args.dtype} CPU, {args.threads} threads, {args.prompt_tokens}-token prompts, "
          f"{args.tokens} tokens per sequence, best of {args.repeats}")
    width = max(map(len, table)) + 2
    print("runner".ljust(width) + "".join(f"{f'C={c}':>10}" for c in args.levels))
    for name, best in table.items():
        print(name.ljust(width) + "".join(f"{r:>10.1f}" for r in best))
    paired = {}
    if len(rates) == 2:
        first, second = rates.values()
        paired = {str(level): [round(a / b, 3) for a, b in zip(first[level], second[level])] for level in args.levels}
        print("first / second, repeat by repeat: " + "; ".join(f"C={c}: {', '.join(f'{x:.2f}' for x in v)}"
                                                             for c, v in paired.items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"shape": shape, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                  "tokens_per_s": {name: dict(zip(map(str, args.levels), best)) for name, best in table.items()},
                  "every_repeat": {name: {str(lv): r for lv, r in by_level.items()} for name, by_level in rates.items()},
                  "ratio_by_repeat": paired}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
