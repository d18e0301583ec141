"""The torch backend's host work per decode step on the CUDA path, measured on any machine.

``TorchBackend.forward_batch`` for B one-token sequences (150 tokens in KV each, growing) through the
decode-graph path (``DecodeGraphs`` without capture) with the forward itself stubbed out (fixed
logits) and the decode masks built in their CUDA layout (per-sequence block tables, last block id;
the CPU layout's dense lookup table is never used on a GPU). What is left is what the engine's
process pays on the CPU for the backend every step on a GPU: splitting the batch, block bookkeeping,
the graph's inputs. A tiny random model stands in for the weights (nothing of it runs).

    python benchmarks/torch_host_step.py [--batches 64 256] [--steps 200]

On the 2-core Xeon, 2026-11-26: 0.99 -> 0.73 ms per step at B=256 and 0.285 -> 0.23 at B=64 (session
start 74b2e55 vs after; issue 28). The GPU host measured then was 2-2.5x slower per operation.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cllm.backends.torch.cuda_graphs as cuda_graphs  # noqa: E402
from cllm.backends.torch.backend import TorchBackend  # noqa: E402
from cllm.backends.torch.cuda_graphs import DecodeGraphs, graph_buckets  # noqa: E402
from cllm.backends.torch.flex import decode_mask_arrays  # noqa: E402
from cllm.config import load_config  # noqa: E402

VOCAB = 512
PROMPT = 150


class _CudaLayout:
    """A cache as decode_mask_arrays sees it on CUDA: same shape, device type cuda."""

    def __init__(self, cache: object) -> None:
        self.shape = cache.shape  # type: ignore[attr-defined]
        self.k = type("K", (), {"device": torch.device("cuda")})()


def _backend(batch: int, model_dir: str) -> TorchBackend:
    backend = TorchBackend(load_config(environ={}, backend="torch", model=model_dir, dtype="float32", device="cpu",
                                       block_size=16, n_ctx=batch * 400, n_seq_max=batch, n_threads=1, attention="flex"))
    logits = torch.zeros(batch + 32, VOCAB)
    graphs = DecodeGraphs(backend.model, backend.kv, buckets=graph_buckets(batch + 32), scratch_block=backend._scratch_block,
                          flex_fn=backend._flex_fn, capture=False, q_per_kv=2)
    graphs._step = lambda bucket: logits[: bucket.logit_rows.shape[0]]  # the forward, stubbed
    backend._graphs = graphs
    return backend


def measure(batch: int, steps: int, model_dir: str) -> float:
    """Mean ms per decode step over ``steps`` (after 20 warm-up steps)."""
    backend = _backend(batch, model_dir)
    rng = np.random.default_rng(0)
    seqs = [f"s{i}" for i in range(batch)]
    lens = dict.fromkeys(seqs, PROMPT)
    for s in seqs:
        tokens = rng.integers(0, VOCAB, size=PROMPT).tolist()
        assert backend.admit(s, tokens, reuse_prefix=False) is not None and backend.reserve(s, PROMPT)
        backend.blocks.record_computed(s, 0, tokens)

    def step() -> None:  # as the engine drives it: reserve each sequence's next slot, then the step
        for s in seqs:
            backend.reserve(s, lens[s] + 1)
        backend.forward_batch(rng.integers(0, VOCAB, size=batch).tolist(), [lens[s] for s in seqs], seqs,
                              logits_for=list(seqs))
        for s in seqs:
            lens[s] += 1

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description="torch backend host work per decode step (CUDA path, forward stubbed)")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    cuda_graphs.decode_mask_arrays = (  # the CUDA layout (see _CudaLayout)
        lambda lens, tables, cache, **_: decode_mask_arrays(lens, tables, _CudaLayout(cache), lookup=False))
    cuda_graphs.paged_block_mask = lambda *a, **k: None  # only the stubbed forward would read it
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as model_dir:
        LlamaForCausalLM(cfg).eval().save_pretrained(model_dir)
        for b in args.batches:
            print(f"B={b}: {measure(b, args.steps, model_dir):.3f} ms of host work per decode step", flush=True)


if __name__ == "__main__":
    main()
