"""Sparse Mixture-of-Experts MLP (Qwen3-MoE, Mixtral): a router picks ``top_k`` SwiGLU experts per token.

Checkpoint layouts accepted (a sparse layer's block is ``mlp.``, or Mixtral's
``block_sparse_moe.`` as the hub files name it):

- per expert, as ``save_pretrained`` writes and the hub holds: Qwen3-MoE
  ``experts.{e}.gate_proj/up_proj/down_proj.weight``, Mixtral
  ``experts.{e}.w1/w3/w2.weight`` (gate/up/down);
- stacked, as transformers >= 5 holds them in memory (so a GGUF load's state
  dict): ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``.

Either way the experts are stacked at load into ``[E, 2I, H]`` (gate|up) and
``[E, H, I]`` (down); the router is ``gate.weight`` ``[E, H]``.

Routing is transformers': softmax of the expert logits in float32, top-k, the
k weights renormalised to sum to 1 when the model says so (Mixtral always,
Qwen3-MoE when ``norm_topk_prob``), then cast to the compute dtype.

Four ways to run the experts (the first three over the (token, expert) pairs sorted by expert):

- looped (CPU; CUDA prefill without a usable ``_grouped_mm``): one gate|up and
  one down matmul per expert that received tokens, over per-expert linears
  (prepacked for oneDNN on CPU, as the dense layers). Its row counts come to
  the host, so it cannot be captured in a CUDA graph;
- grouped (CUDA where ``torch._grouped_mm`` runs and can be captured: bfloat16
  on an H200 with torch 2.11; its float32/float16 fallback copies the offsets to
  the host): both projections of all experts in one grouped GEMM each; the groups
  come from an offsets tensor computed on the device (``searchsorted`` over the
  sorted expert ids), so no shape depends on the routing and the step can be
  captured in a CUDA graph;
- dense (CUDA without it: captured steps and small batches): every expert on
  every row, combined by a ``[T, E]`` matrix that is zero off the top-k. E/k
  times the FLOPs, but fixed shapes and a handful of kernels;
- dense on CPU (``torch.moe_dense_decode``): the same arithmetic as two prepacked GEMMs over every
  expert's weights concatenated (gate|up ``[E*2I, H]``, down ``[H, E*I]``), a second copy of the experts
  kept beside the loop's. The loop pays ~14 us of oneDNN dispatch per call and streams each small
  matmul at 12-14 GB/s, so once a batch reaches most experts one big GEMM is cheaper; for a few tokens
  the loop, reading only the experts hit, stays faster. A batch runs densely when ``T * top_k >= E``
  (most experts hit) and ``T <= dense_max_tokens``, the largest batch at which dense beat the loop
  when timed at load on this machine (:func:`dense_max_tokens`). Measured on a 2-core AVX-512 EPYC,
  one layer of 64 experts, hidden 512, width 256, top 8 (``benchmarks/moe_layer.py``): at 16 tokens
  loop 8.3 / dense 6.0 ms in float32, 6.6 / 2.9 ms in bfloat16; at one token the loop's 1.0 / 0.7 ms
  against dense 5.1 / 2.2. At 16 tokens dense is compute-bound (bfloat16: ~280 GFLOP/s on 2 cores), E/k = 8
  times the FLOPs the chosen experts need.

Measured on an H200 (torch 2.11, bfloat16), one Qwen3-30B-A3B-shaped layer (128
experts, hidden 2048, expert width 768, top 8), CUDA-graph replay per step:
grouped 109 / 276 / 484 / 548 us at 1 / 8 / 32 / 256 tokens, dense 318 / 331 /
365 / 670 us; eager, 4096 tokens: grouped 1.5 ms, looped 8.1 ms. At 512 hidden /
64 experts eager, 16 tokens: looped 3.1 ms, grouped 0.19, dense 0.11.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.nn.functional as F

from cllm.backends.torch.invariant import elementwise
from cllm.backends.torch.linear import Linear

BLOCK_NAMES = ("mlp.", "block_sparse_moe.")  # the sparse block's prefix: HF / transformers >= 5, Mixtral hub files
# Per-expert weight names (gate, up, down), by checkpoint family.
PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# CUDA without grouped GEMMs: batches up to this many tokens run every expert densely (the loop's per-expert
# launches and host sync cost milliseconds a layer), larger ones (prefill) loop over the experts hit.
DENSE_MAX_TOKENS = 256


@dataclass(slots=True)
class MoEWeights:
    """One sparse layer's router and experts."""

    router: Linear  # [E, hidden] expert logits
    experts: list[tuple[Linear, Linear]]  # per expert (gate|up [2I, H], down [H, I]): the looped path
    gate_up: torch.Tensor | None  # [E, 2I, H] stacked experts (CUDA paths); None on CPU, where only the loop runs
    down: torch.Tensor | None  # [E, H, I]
    expert_ids: torch.Tensor | None  # arange(E) on the device: group ends come from searchsorted over it
    top_k: int  # experts per token
    renormalize: bool  # top-k weights rescaled to sum to 1
    grouped: bool  # torch._grouped_mm runs, agrees and can be captured on this device and dtype
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu  # the experts' activation (CPU loop; see model.LayerWeights)
    dense: tuple[Linear, Linear] | None = None  # CPU moe_dense_decode: all experts' gate|up [E*2I, H] and down [H, E*I]
    dense_max_tokens: int = 0  # CPU: batches of up to this many tokens that reach most experts run densely


# Not traced by torch.compile (torch_compile): the loop's host-side row counts would specialise the compiled
# graph on each step's routing and recompile; the expert matmuls gain nothing from it.
@torch.compiler.disable
def moe_forward(h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """The sparse MLP's output ``[T, hidden]`` for normed hidden states ``h`` ``[T, hidden]``."""
    weights, experts = route(h, w.router, w.top_k, w.renormalize)
    if w.grouped:
        return _grouped(h, w, weights, experts)
    if h.device.type == "cuda" and (h.shape[0] <= DENSE_MAX_TOKENS or torch.cuda.is_current_stream_capturing()):
        return _dense(h, w, weights, experts)
    if w.dense is not None and len(w.experts) <= h.shape[0] * w.top_k and h.shape[0] <= w.dense_max_tokens:
        return _dense_cpu(h, w, weights, experts)
    return _looped(h, w, weights, experts)


def route(h: torch.Tensor, router: Linear, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` expert weights (in ``h``'s dtype) and expert ids, both ``[T, top_k]``."""
    probs = torch.softmax(router(h), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def _looped(h: torch.Tensor, w: MoEWeights, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    # (token, slot) pairs sorted by expert: each expert's rows are one contiguous slice of the gathered input.
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // w.top_k
    counts = torch.bincount(flat, minlength=len(w.experts)).tolist()  # host sync: never inside a graph
    x = h.index_select(0, rows)
    parts, start = [], 0
    for (gate_up, down), n in zip(w.experts, counts):
        if n:
            gate, up = gate_up(x[start : start + n]).chunk(2, dim=-1)
            parts.append(down(w.act(gate) * up))
            start += n
    y = torch.cat(parts) * weights.reshape(-1)[order, None]
    # Each token's k contributions are summed in expert order, whatever else is in the batch.
    return torch.zeros_like(h).index_add_(0, rows, y)


def _grouped(h: torch.Tensor, w: MoEWeights, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    assert w.gate_up is not None and w.down is not None and w.expert_ids is not None  # kept where grouped is set
    tokens, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat)
    # Group e holds sorted pairs [offsets[e-1], offsets[e]): the count of ids <= e. Computed on the
    # device, so no routing-dependent shape or host sync (an expert with no tokens is an empty group).
    offsets = torch.searchsorted(flat[order], w.expert_ids, right=True).to(torch.int32)
    x = h.index_select(0, order // k)
    # _grouped_mm takes [E, in, out]: the transposed views of our [E, out, in] experts.
    gate, up = torch._grouped_mm(x, w.gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w.down.transpose(1, 2), offs=offsets)
    # Back to (token, slot) order, then a fixed-order sum over the k slots: deterministic (no atomics).
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    return (pairs.view(tokens, k, -1) * weights[..., None]).sum(dim=1)


def _dense(h: torch.Tensor, w: MoEWeights, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    assert w.gate_up is not None and w.down is not None  # kept on CUDA
    combine = torch.zeros(h.shape[0], w.gate_up.shape[0], dtype=h.dtype, device=h.device).scatter_(1, experts, weights)
    gate, up = torch.matmul(h, w.gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    y = torch.matmul(F.silu(gate) * up, w.down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("te,eth->th", combine, y)


def _dense_cpu(h: torch.Tensor, w: MoEWeights, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    assert w.dense is not None  # kept where moe_dense_decode is on
    gate_up, down = w.dense
    tokens, num_experts = h.shape[0], len(w.experts)
    combine = torch.zeros(tokens, num_experts, dtype=h.dtype, device=h.device).scatter_(1, experts, weights)
    gate, up = gate_up(h).chunk(2, dim=-1)  # [T, E*I] each: every expert's gates, then every expert's ups
    act = w.act(gate).mul_(up)
    # Each expert's activations scaled by the token's weight for it (zero off the top-k): the down GEMM's
    # sum over the concatenated experts is the weighted sum over the chosen ones.
    act.view(tokens, num_experts, -1).mul_(combine[:, :, None])
    return down(act)


def dense_weights(gate_up: torch.Tensor, down: torch.Tensor, **linear: bool) -> tuple[Linear, Linear]:
    """The CPU dense path's concatenated experts from stacked ``[E, 2I, H]`` / ``[E, H, I]`` weights:
    gate|up ``[E*2I, H]`` as every expert's gate rows then every expert's up rows (so that the two halves
    of its output are contiguous), down ``[H, E*I]`` (``linear``: the Linear flags of the per-expert copies)."""
    experts, hidden, width = down.shape
    gates, ups = gate_up[:, :width].reshape(-1, hidden), gate_up[:, width:].reshape(-1, hidden)
    return (Linear(torch.cat([gates, ups]).contiguous(), None, **linear),
            Linear(down.permute(1, 0, 2).reshape(hidden, experts * width).contiguous(), None, **linear))


def dense_max_tokens(w: MoEWeights, dtype: torch.dtype, *, limit: int = 256, repeats: int = 3) -> int:
    """The largest batch (a power of two, from the first at which ``T * top_k`` reaches the expert count)
    at which the dense path beat the loop on ``w``'s weights, timed here with seeded random routing; 0 if
    it never did. Timing stops at the first batch the loop wins (dense costs grow with T, the loop's
    flatten once every expert is hit)."""
    num_experts, hidden = len(w.experts), w.experts[0][0].in_features
    gen = torch.Generator().manual_seed(0)
    tokens, best = 1, 0
    while tokens * w.top_k < num_experts:
        tokens *= 2
    while tokens <= limit:
        h = torch.randn(tokens, hidden, generator=gen).to(dtype)
        experts = torch.stack([torch.randperm(num_experts, generator=gen)[:w.top_k] for _ in range(tokens)])
        weights = torch.full((tokens, w.top_k), 1.0 / w.top_k, dtype=dtype)
        loop = dense = float("inf")
        for _ in range(repeats):  # alternated, the fastest of each kept
            loop = min(loop, _timed(_looped, h, w, weights, experts))
            dense = min(dense, _timed(_dense_cpu, h, w, weights, experts))
        if dense >= loop:
            break
        best, tokens = tokens, tokens * 2
    return best


def _timed(fn: Callable[..., torch.Tensor], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@lru_cache(maxsize=None)
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here, agrees with per-group matmuls and can be captured in a CUDA
    graph (probed once per device and dtype). CUDA only: the CPU keeps the loop, whose per-expert linears
    are prepacked for oneDNN. Seen on an H200 with torch 2.11: bfloat16 passes; float32 and float16 compute
    right but through a fallback that copies the offsets to the host, which capture refuses."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(24, 64, generator=gen).to(device, dtype)
    weight = torch.randn(4, 32, 64, generator=gen).to(device, dtype).transpose(1, 2)  # [E, in, out] views
    ends = [5, 5, 17, 24]  # an empty group included
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(x, weight, offs=offsets).float()
        _capture(lambda: torch._grouped_mm(x, weight, offs=offsets))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    starts = [0] + ends[:-1]
    want = torch.cat([x[s:e].float() @ weight[g].float() for g, (s, e) in enumerate(zip(starts, ends))])
    return bool((got - want).abs().max() < 2e-2 * want.abs().max())


def _capture(fn: Callable[[], object]) -> None:
    """Capture ``fn`` into a throwaway CUDA graph (warmed up on a side stream, as capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        fn()


def moe_tensor_names(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> list[str]:
    """The names a sparse layer's weights take in ``state``, in whichever layout it holds them
    (the stacked layout's when none is found: what the error then names)."""
    for block in BLOCK_NAMES:
        router = f"{prefix}{block}gate.weight"
        stacked = [router, f"{prefix}{block}experts.gate_up_proj", f"{prefix}{block}experts.down_proj"]
        if stacked[1] in state:
            return stacked
        for names in PER_EXPERT_NAMES:
            if f"{prefix}{block}experts.0.{names[0]}.weight" in state:
                per_expert = [f"{prefix}{block}experts.{e}.{n}.weight" for e in range(num_experts) for n in names]
                return [router, *per_expert]
    return [f"{prefix}{BLOCK_NAMES[0]}{n}" for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")]


def stacked_experts(state: dict[str, torch.Tensor], names: list[str], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, 2I, H]`` gate|up and ``[E, H, I]`` down from the names :func:`moe_tensor_names` found."""
    if len(names) == 3:
        return state[names[1]], state[names[2]]
    per_expert = [names[1 + 3 * e : 4 + 3 * e] for e in range(num_experts)]  # (gate, up, down) names
    gate_up = torch.stack([torch.cat([state[g], state[u]]) for g, u, _ in per_expert])
    return gate_up, torch.stack([state[d] for _, _, d in per_expert])


def load_moe(
    state: dict[str, torch.Tensor], prefix: str, *, num_experts: int, top_k: int, renormalize: bool,
    dtype: torch.dtype, device: torch.device, prepack: bool, fp16_weights: bool, pad_rows: bool = False,
    dense: bool = False,
) -> MoEWeights:
    """One sparse layer's weights (names checked present by the caller), cast, moved and stacked;
    ``dense`` (CPU): also the dense path's concatenated copy (its ``dense_max_tokens`` is set by the caller)."""
    names = moe_tensor_names(state, prefix, num_experts)
    gate_up, down = (t.to(device, dtype).contiguous() for t in stacked_experts(state, names, num_experts))
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(f"{prefix}: {gate_up.shape[0]} experts in the weights, the config says {num_experts}")
    # The router stays in the compute dtype even under fp16_weights: a rounded router can flip a near-tie
    # expert choice, a discrete change no later layer smooths out (and it is a small [E, H] matrix).
    router = Linear(state[names[0]].to(device, dtype), None, prepack=prepack, pad_rows=pad_rows)
    experts = [(Linear(gate_up[e], None, prepack=prepack, fp16_weights=fp16_weights, pad_rows=pad_rows),
                Linear(down[e], None, prepack=prepack, fp16_weights=fp16_weights, pad_rows=pad_rows))
               for e in range(num_experts)]
    on_cuda = device.type == "cuda"
    concatenated = dense_weights(gate_up, down, prepack=prepack, fp16_weights=fp16_weights) \
        if dense and not on_cuda and not pad_rows else None
    return MoEWeights(
        router=router, experts=experts,
        # Off CUDA only the loop runs, over per-expert linears that hold packed copies (or views of these).
        gate_up=gate_up if on_cuda else None, down=down if on_cuda else None,
        expert_ids=torch.arange(num_experts, device=device) if on_cuda else None,
        top_k=top_k, renormalize=renormalize, grouped=grouped_mm_works(device, dtype),
        act=partial(elementwise, F.silu) if pad_rows else F.silu,  # model.deterministic: vector code only
        dense=concatenated,
    )
