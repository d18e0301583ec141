"""How close each weights choice (llama_cpp.weights) stays to the model file's exact weights.

Writes float32, Q8_0 and F16 copies of the model with llama.cpp's quantizer (into a temporary
directory), scores the same text teacher-forced through llama-cpp-python's ``Llama`` on each, and
reports top-1 agreement and KL divergence against the float32 copy — the file's weights exactly,
with float32 activations. The file itself is scored too: as llama.cpp runs it (Q4_1 matmuls
quantise activations to 8 bits) it is not exact either.

    .venv/bin/python benchmarks/weights_accuracy.py            # embedded model, 1,000 tokens of README.md
    .venv/bin/python benchmarks/weights_accuracy.py --kv f16 bf16 --only file   # the KV cache's type too

With ``--kv`` the reference keeps its KV cache in float32 and every copy is scored with each cache
type given (``model.deterministic`` uses bf16 in place of f16: docs/reproducibility.md).

Speed is measured with llama.cpp's own tools built beside the comparator's llama-server
(``make llama-batched-bench llama-bench`` in ``~/.cache/cllm/llama-server-<ver>/build``), see
benchmarks/results/performance_log_llama_cpp.md, "Wave 11".
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

from cllm.backends.llama_cpp.offload import KV_CACHE_TYPES
from cllm.backends.llama_cpp.weights import TARGETS, Target, convert
from cllm.model_path import resolve_model_path

REPO = Path(__file__).resolve().parent.parent
EXACT = Target(llama_cpp.LLAMA_FTYPE_ALL_F32, 4.0)


KV_TYPES = {name: KV_CACHE_TYPES[name] for name in ("f32", "f16", "bf16", "q8_0")}  # ggml type ids


def log_probs(path: Path, ids: list[int], threads: int, kv: str = "f16") -> np.ndarray:
    model = llama_cpp.Llama(model_path=str(path), n_ctx=max(512, len(ids)), n_batch=512, logits_all=True,
                            n_threads=threads, flash_attn=True, verbose=False, type_k=KV_TYPES[kv], type_v=KV_TYPES[kv])
    try:
        model.eval(ids)
        z = np.array(model.scores[: len(ids)], dtype=np.float64)
    finally:
        model.close()
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens of README.md to score")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv", nargs="+", choices=sorted(KV_TYPES), default=None,
                        help="KV cache types to score each copy with (default: f16, reference f16)")
    parser.add_argument("--only", nargs="+", default=None, help="score only these copies (file, q8_0, f16)")
    args = parser.parse_args()
    source = resolve_model_path(args.model)
    vocab = llama_cpp.Llama(model_path=str(source), vocab_only=True, verbose=False)
    ids = vocab.tokenize((REPO / "README.md").read_text().encode())[: args.tokens]
    with tempfile.TemporaryDirectory() as tmp:
        copies = {"file": source}
        for name, target in [("exact (f32)", EXACT), *TARGETS.items()]:
            if args.only and name != "exact (f32)" and name not in args.only:
                continue
            copies[name] = Path(tmp) / f"{name.split()[0]}.gguf"
            convert(source, copies[name], target, estimate=0, n_threads=args.threads)
        exact = log_probs(copies.pop("exact (f32)"), ids, args.threads, "f32" if args.kv else "f16")
        print(f"{len(ids)} tokens of README.md, teacher-forced; reference: {source.name} dequantised to float32"
              + (", KV cache float32" if args.kv else ""))
        print("| weights | KV cache | size MB | top-1 agreement | mean KL | p99 KL |\n|---|---|---|---|---|---|")
        for name, path in copies.items():
            if args.only and name not in args.only:
                continue
            for kv in args.kv or ["f16"]:
                lp = log_probs(path, ids, args.threads, kv)
                kl = (np.exp(exact) * (exact - lp)).sum(axis=1)
                agree = (lp.argmax(axis=1) == exact.argmax(axis=1)).mean()
                print(f"| {name} | {kv} | {path.stat().st_size / 1e6:.0f} | {agree:.1%} | {kl.mean():.2e} | "
                      f"{np.quantile(kl, 0.99):.2e} |")


if __name__ == "__main__":
    main()
