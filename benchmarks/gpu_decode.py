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

Before measuring, each shape in ``--check-shapes`` compares cllm's logits with transformers' in float32
on the same weights (prefill, a mixed prefill + decode step, graph-replayed decodes). Results on an
H100: docs/gpu.md and benchmarks/results/gpu_h100/. On CPU it runs too, e.g.:

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
CHECK_MAX_REL_ERROR = 3e-2  # bf16 weights and activations vs a float32 reference: ~1e-2 expected
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


def build_model(shape: str, dtype: torch.dtype, directory: Path, device: torch.device) -> int:
    """Random-weight model saved as an HF directory; returns its weight bytes (built on ``device``: fast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    return nbytes


def cllm_backend(directory: Path, max_batch: int, per_seq: int, args: argparse.Namespace, **overrides: object):
    """A TorchBackend over the saved model, sized for ``max_batch`` sequences of ``per_seq`` tokens."""
    from cllm.backends.torch.backend import TorchBackend
    from cllm.config import load_config

    settings = dict(backend="torch", model=str(directory), device=args.device, dtype=args.dtype, n_threads=args.threads,
                    n_ctx=per_seq if args.device != "cpu" else (per_seq + 16) * max_batch, n_seq_max=max_batch,
                    n_batch=max(args.prompt_len, 512), gpu_n_seq_max=max_batch, gpu_n_batch=max(args.prompt_len, 8192),
                    cuda_graph_max_batch=max_batch, sampler="torch")
    return TorchBackend(load_config(environ={}, **{**settings, **overrides}))


def cllm_decode(backend, batch: int, args: argparse.Namespace) -> tuple[float, float]:
    """(tokens/s, mean step ms) of ``args.steps`` pure decode steps of ``batch`` sequences."""
    per_seq = args.prompt_len + args.steps + args.warmup + 1
    rng = np.random.default_rng(batch)
    ids = [f"b{batch}s{i}" for i in range(batch)]
    tokens = {s: rng.integers(0, backend.spec.vocab_size, args.prompt_len).tolist() for s in ids}
    last = {}
    per_call = max(1, backend.capacity.max_batch_tokens // args.prompt_len)
    for i in range(0, batch, per_call):  # prefill, as many sequences per call as the token budget allows
        group = ids[i : i + per_call]
        for s in group:
            assert backend.admit(s, tokens[s], reuse_prefix=False) is not None and backend.reserve(s, per_seq)
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
    for s in ids:
        backend.release(s, keep_cache=False)
    decode = sum(times[args.warmup :])
    return batch * args.steps / decode, 1000 * decode / args.steps


def profile_decode(backend, batch: int, args: argparse.Namespace) -> None:
    """Where a decode step's time goes: host functions (cProfile) and device kernels (torch.profiler)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    cllm_decode(backend, batch, args)  # warm
    prof = cProfile.Profile()
    prof.enable()
    cllm_decode(backend, batch, args)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        cllm_decode(backend, batch, args)
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def check_logits(directory: Path, args: argparse.Namespace) -> tuple[float, float]:
    """cllm's logits vs transformers' in float32 on the same weights and tokens: (worst row's relative
    error, greedy agreement). Covers prefill alone, a mixed step (decodes + a new prefill), a step with a
    second sequence's long prefill, and graph-replayed pure decode steps of all four sequences."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(args.device).eval()
    backend = cllm_backend(directory, 8, 512, args, gpu_memory_utilization=0.5)
    rng = np.random.default_rng(7)
    vocab = backend.spec.vocab_size
    tokens = {s: rng.integers(0, vocab, n).tolist() for s, n in (("a", 5), ("b", 37), ("c", 130), ("d", 300))}
    done = {s: 0 for s in tokens}  # tokens in KV
    errors, agree, rows = [], 0, 0

    def step(prefill: list[str], decode: list[str]) -> None:
        nonlocal agree, rows
        for s in prefill:
            assert backend.admit(s, tokens[s], reuse_prefix=False) is not None and backend.reserve(s, 512)
        order = decode + prefill
        flat, pos, seqs = [], [], []
        for s in order:
            new = tokens[s][done[s]:]
            flat += new
            pos += list(range(done[s], done[s] + len(new)))
            seqs += [s] * len(new)
        out = torch.as_tensor(backend.forward_batch(flat, pos, seqs)).float()
        with torch.inference_mode():
            for i, s in enumerate(order):
                want = ref(torch.tensor([tokens[s]], device=args.device)).logits[0, -1].float()
                got = out[i].to(want.device)
                errors.append(float((got - want).norm() / want.norm()))
                agree += int(got.argmax() == want.argmax())
                rows += 1
                done[s] = len(tokens[s])
                tokens[s].append(int(got.argmax()))

    step(["a", "b"], [])
    step(["c"], ["a", "b"])
    step(["d"], ["a", "b", "c"])
    for _ in range(6):
        step([], ["a", "b", "c", "d"])
    backend.close()
    del ref
    return max(errors), agree / rows


def hf_decode(model, batch: int, args: argparse.Namespace) -> float:
    """transformers generate (static cache) decode tokens/s, prefill subtracted."""
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

    timed(args.steps + 1)  # warm-up: the static cache, and any compilation transformers does for it
    full, prefill = timed(args.steps + 1), timed(1)
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
    p.add_argument("--profile", type=int, default=0, metavar="B", help="profile decode steps at batch B first")
    p.add_argument("--check-shapes", nargs="*", default=["smollm2-135m", "llama-3.2-1b"], choices=list(SHAPES),
                   help="shapes whose logits are first checked against transformers in float32")
    args = p.parse_args()
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else measured_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 28)
    sheet = next((v for k, v in DATASHEET_GBPS.items() if k in name), None)
    print(f"device {name}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s" + (f", datasheet {sheet:.0f} GB/s" if sheet else ""))
    rows: list[Row] = []
    failed_checks = []
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            weight_bytes = build_model(shape, getattr(torch, args.dtype), Path(tmp), dev)
            release(dev)
            print(f"{shape}: {weight_bytes / 1e9:.2f} GB of weights, built in {time.perf_counter() - t0:.0f} s", flush=True)
            if shape in args.check_shapes:
                worst, agree = check_logits(Path(tmp), args)
                verdict = "ok" if worst < CHECK_MAX_REL_ERROR else "FAIL"
                if verdict == "FAIL":
                    failed_checks.append(shape)
                print(f"{shape}: logits vs transformers float32: worst row rel. error {worst:.2e}, "
                      f"greedy agreement {agree:.0%} [{verdict}]", flush=True)
                release(dev)
            t0 = time.perf_counter()
            backend = cllm_backend(Path(tmp), max(args.batches), args.prompt_len + args.steps + args.warmup + 1, args)
            print(f"{shape}: cllm backend loaded (graphs captured) in {time.perf_counter() - t0:.0f} s", flush=True)
            if args.profile:
                profile_decode(backend, args.profile, args)
            cllm = {b: cllm_decode(backend, b, args) for b in args.batches}
            backend.close()
            del backend
            release(dev)
            hf: dict[int, float | None] = dict.fromkeys(args.batches)
            if not args.no_hf:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, args.hf_dtype)).to(dev).eval()
                for b in args.batches:
                    t0 = time.perf_counter()
                    hf[b] = hf_decode(model, b, args)
                    print(f"{shape}: transformers B={b} measured in {time.perf_counter() - t0:.0f} s", flush=True)
                del model
                release(dev)
            torch._dynamo.reset()  # the next shape compiles its own kernels; do not count these against its limit
            for batch in args.batches:
                (tok_s, step_ms), other = cllm[batch], hf[batch]
                floor = 1000 * weight_bytes / bandwidth if batch == 1 else None
                rows.append(Row(shape, batch, tok_s, step_ms, other, floor, step_ms / floor if floor else None))
            if args.json:
                args.json.write_text(json.dumps({"device": name, "bandwidth_gbps": bandwidth / 1e9,
                                                 "rows": [asdict(r) for r in rows]}, indent=2))
    for r in rows:
        print(f"{r.shape:>13} B={r.batch:<4} cllm {r.cllm_tok_s:9.1f} tok/s ({r.cllm_step_ms:7.2f} ms/step)"
              + (f" | hf static {r.hf_tok_s:9.1f} tok/s ({r.cllm_tok_s / r.hf_tok_s:5.2f}x)" if r.hf_tok_s else "")
              + (f" | floor {r.floor_ms:6.2f} ms, step/floor {r.vs_floor:4.2f}" if r.floor_ms else ""))
    if failed_checks:
        raise SystemExit(f"logit check failed for {failed_checks}: these figures are of a wrong computation")


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
