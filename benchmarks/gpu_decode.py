"""Decode throughput of the torch backend vs transformers on a GPU (issue 11's report), random weights.

For each model shape (SmolLM2-135M, Llama-3.2-1B, Llama-3-8B configs; random
weights, so no download: the GPU machine has no network) and each batch size B:

- cllm torch: a ``TorchBackend`` over the saved random model. B sequences of
  ``--prompt-len`` random tokens are prefilled, then ``--steps`` pure decode
  steps run through ``forward_batch`` (CUDA graphs, FlexAttention and device
  logits as configured: the backend's defaults on CUDA), with the greedy pick
  on the device. tok/s = B * steps / decode time.
- transformers ``generate`` with ``cache_implementation="static"`` on the same
  weights: decode time = time(generate prompt_len + steps + 1 tokens) - time(generate 1 token), so
  the prefill is excluded as for cllm.

Batch-1 step time is compared with the bandwidth floor: every decode step
streams all weights once, so step >= weight bytes / memory bandwidth. The
bandwidth is measured here (a large device-to-device copy: read + write bytes /
time) and, on known GPUs, also taken from the datasheet (``--hbm-gbps``
overrides). Targets (issue 11): batch 1 within 1.6x of the floor for 1B and
8B; batch 64 >= 5x transformers.

Untested on CUDA when written (no GPU was lent); on CPU it runs, e.g.:

    .venv/bin/python benchmarks/gpu_decode.py --shapes smollm2-135m --batches 1 4 --steps 8 --device cpu
"""
from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

SHAPES: dict[str, dict] = {  # public configs of the three models (architecture only)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}
DATASHEET_GBPS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0, "A100-SXM4-80GB": 2039.0}


@dataclass(slots=True)
class Row:
    """One (shape, batch) measurement."""

    shape: str  # model shape name
    batch: int  # sequences decoding together
    cllm_tok_s: float  # cllm torch decode tokens/s
    cllm_step_ms: float  # cllm mean decode step
    hf_tok_s: float | None  # transformers generate (static cache) decode tokens/s
    floor_ms: float | None  # weight bytes / measured bandwidth (batch 1 only)
    vs_floor: float | None  # cllm step / floor (batch 1 only)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a large copy on the device (each byte read once and written once)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def build_model(shape: str, dtype: torch.dtype, directory: Path) -> int:
    """Random-weight model saved as an HF directory; returns its weight bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory)
    return nbytes


def cllm_decode(directory: Path, batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s, mean step ms) of ``args.steps`` pure decode steps of ``batch`` sequences."""
    from cllm.backends.torch.backend import TorchBackend
    from cllm.config import load_config

    per_seq = args.prompt_len + args.steps + 32
    settings = dict(backend="torch", model=str(directory), device=args.device, dtype=args.dtype, n_threads=args.threads,
                    n_ctx=per_seq if args.device != "cpu" else (per_seq + 16) * batch, n_seq_max=min(batch, 256),
                    n_batch=max(args.prompt_len, 512), gpu_n_seq_max=batch, gpu_n_batch=max(args.prompt_len, 8192),
                    cuda_graph_max_batch=batch, sampler="torch")
    backend = TorchBackend(load_config(environ={}, **settings))
    rng = np.random.default_rng(batch)
    ids = [f"s{i}" for i in range(batch)]
    tokens = {s: rng.integers(0, backend.spec.vocab_size, args.prompt_len).tolist() for s in ids}
    last = {}
    per_call = max(1, backend.capacity.max_batch_tokens // args.prompt_len)
    for i in range(0, batch, per_call):  # prefill, as many sequences per call as the token budget allows
        group = ids[i : i + per_call]
        for s in group:
            assert backend.admit(s, tokens[s]) is not None and backend.reserve(s, per_seq)
        flat = [t for s in group for t in tokens[s]]
        logits = backend.forward_batch(flat, [p for _ in group for p in range(args.prompt_len)],
                                       [s for s in group for _ in range(args.prompt_len)])
        last.update(zip(group, torch.as_tensor(logits).argmax(dim=1).tolist()))
    dev = torch.device(backend.device)
    times = []
    for step in range(args.steps + args.warmup):
        sync(dev)
        t0 = time.perf_counter()
        pos = args.prompt_len + step
        logits = backend.forward_batch([last[s] for s in ids], [pos] * batch, ids)
        picks = torch.as_tensor(logits).argmax(dim=1).tolist()  # the device -> host copy of the ids ends the step
        last = dict(zip(ids, picks))
        times.append(time.perf_counter() - t0)
    backend.close()
    decode = sum(times[args.warmup :])
    return batch * args.steps / decode, 1000 * decode / args.steps


def hf_decode(directory: Path, batch: int, args: argparse.Namespace) -> float:
    """transformers generate (static cache) decode tokens/s, prefill subtracted."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, args.hf_dtype)).to(args.device).eval()
    dev = torch.device(args.device)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), device=dev)

    def timed(new_tokens: int) -> float:
        sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation="static", pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t0

    timed(2)  # warm-up (allocates the static cache)
    full, prefill = timed(args.steps + 1), timed(1)
    del model
    return batch * args.steps / max(full - prefill, 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--steps", type=int, default=64, help="measured decode steps")
    p.add_argument("--warmup", type=int, default=4, help="decode steps run before timing")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hf-dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--hbm-gbps", type=float, default=None, help="memory bandwidth for the floor (default: measured)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else measured_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 28)
    sheet = next((v for k, v in DATASHEET_GBPS.items() if k in name), None)
    print(f"device {name}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s" + (f", datasheet {sheet:.0f} GB/s" if sheet else ""))
    rows: list[Row] = []
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            weight_bytes = build_model(shape, getattr(torch, args.dtype), Path(tmp))
            for batch in args.batches:
                tok_s, step_ms = cllm_decode(Path(tmp), batch, args)
                gc.collect()
                hf = None if args.no_hf else hf_decode(Path(tmp), batch, args)
                floor = 1000 * weight_bytes / bandwidth if batch == 1 else None
                rows.append(Row(shape, batch, tok_s, step_ms, hf, floor, step_ms / floor if floor else None))
                r = rows[-1]
                print(f"{shape:>13} B={batch:<4} cllm {tok_s:9.1f} tok/s ({step_ms:7.2f} ms/step)"
                      + (f" | hf static {hf:9.1f} tok/s ({tok_s / hf:5.2f}x)" if hf else "")
                      + (f" | floor {floor:6.2f} ms, step/floor {r.vs_floor:4.2f}" if floor else ""), flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": name, "bandwidth_gbps": bandwidth / 1e9,
                                         "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
