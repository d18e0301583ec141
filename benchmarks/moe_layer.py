"""One sparse MoE layer on CPU: cllm's per-expert loop against the alternatives it was measured against.

Times one Qwen3-MoE-shaped layer's experts (default 64 experts, hidden 512, expert width 256, top 8)
at several token counts, in float32 and bfloat16, with random routing:

- loop: what cllm runs (``cllm.backends.torch.moe._looped``): one oneDNN-prepacked gate|up and down
  matmul per expert that received tokens;
- loop-mm: the same loop over plain stacked weights (``torch.mm`` on strided per-expert views);
- grouped: ``torch._grouped_mm`` over the stacked weights (what transformers runs on CPU);
- bmm: the pairs padded to the busiest expert's count, one ``torch.bmm`` per projection over all experts;
- dense: what cllm runs for batches that reach most experts under ``torch.moe_dense_decode``
  (``moe._dense_cpu``): every expert on every token as two prepacked GEMMs over all experts' weights
  concatenated (a second copy of them), combined by a ``[T, E]`` matrix that is zero off the top-k;
- dense-groups (tried, not kept): the dense form per group of ``--groups`` experts, over only the tokens
  that chose one of the group's experts (fewer FLOPs, more calls);
- dense-picked (tried, not kept): the dense GEMMs, with the activation and products over each token's
  chosen experts only, scattered back into the down GEMM's zero input.

    .venv/bin/python benchmarks/moe_layer.py --tokens 1 4 16 32
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cllm.backends.torch.linear import Linear
from cllm.backends.torch.moe import MoEWeights, _dense_cpu, _looped, dense_weights

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (h, weights, experts) -> out


def variants(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Experts]:
    """Each way to run the layer's experts, over one set of seeded weights."""
    E, H, I = args.experts, args.hidden, args.width
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) * 0.02).to(dtype)
    per_expert = [(Linear(gate_up[e].contiguous(), None, prepack=True), Linear(down[e].contiguous(), None, prepack=True))
                  for e in range(E)]
    moe = MoEWeights(router=per_expert[0][0], experts=per_expert, gate_up=None, down=None, expert_ids=None,
                     top_k=args.top_k, renormalize=True, grouped=False, dense=dense_weights(gate_up, down, prepack=True))
    gate_up_t, down_t = gate_up.permute(2, 0, 1).contiguous(), down.permute(0, 2, 1).contiguous()  # [H, E, 2I], [E, I, H]
    gate_up_stacked_t = gate_up.transpose(1, 2).contiguous()  # [E, H, 2I]: bmm's batch-major operand
    expert_ids = torch.arange(E)

    def sorted_pairs(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        return flat, order, order // args.top_k

    def loop_mm(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat, order, rows = sorted_pairs(experts)
        x, parts, start = h.index_select(0, rows), [], 0
        for e, n in enumerate(torch.bincount(flat, minlength=E).tolist()):
            if n:
                gate, up = torch.mm(x[start:start + n], gate_up_t[:, e]).chunk(2, dim=-1)
                parts.append(torch.mm(F.silu(gate) * up, down_t[e]))
                start += n
        y = torch.cat(parts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, rows, y)

    def grouped(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat, order, rows = sorted_pairs(experts)
        offsets = torch.searchsorted(flat[order], expert_ids, right=True).to(torch.int32)
        gate, up = torch._grouped_mm(h.index_select(0, rows), gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets) * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, rows, y)

    def bmm(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat, order, rows = sorted_pairs(experts)
        counts = torch.bincount(flat, minlength=E)
        by_expert = flat[order]
        slot = torch.arange(len(flat)) - (torch.cumsum(counts, 0) - counts)[by_expert]
        padded = h.new_zeros(E, int(counts.max()), H)
        padded[by_expert, slot] = h[rows]
        gate, up = torch.bmm(padded, gate_up_stacked_t).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, down_t)[by_expert, slot] * weights.reshape(-1)[order, None]
        return torch.zeros_like(h).index_add_(0, rows, y)

    per_group = E // args.groups
    groups = [dense_weights(gate_up[g * per_group:(g + 1) * per_group], down[g * per_group:(g + 1) * per_group],
                            prepack=True) for g in range(args.groups)]

    def dense_groups(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # Dense over each group of E/groups experts, for only the tokens that chose one of them.
        T = h.shape[0]
        combine = torch.zeros(T, E, dtype=h.dtype).scatter_(1, experts, weights)
        hit = combine.view(T, args.groups, per_group).ne(0).any(-1)
        y = torch.zeros_like(h)
        for g, (group_gate_up, group_down) in enumerate(groups):
            rows = hit[:, g].nonzero().squeeze(1)
            if rows.numel():
                gate, up = group_gate_up(h.index_select(0, rows)).chunk(2, dim=-1)
                act = F.silu(gate).mul_(up)
                act.view(rows.numel(), per_group, -1).mul_(combine.index_select(0, rows)[:, g * per_group:(g + 1) * per_group, None])
                y.index_add_(0, rows, group_down(act))
        return y

    def dense_picked(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # The dense GEMMs, but the activation and products only over each token's chosen experts.
        T, all_gate_up, all_down = h.shape[0], *moe.dense
        out = all_gate_up(h).view(T, 2, E, I)
        index = experts[:, :, None].expand(T, args.top_k, I)
        act = F.silu(out[:, 0].gather(1, index)).mul_(out[:, 1].gather(1, index)).mul_(weights[:, :, None])
        return all_down(torch.zeros(T, E, I, dtype=h.dtype).scatter_(1, index, act).view(T, E * I))

    return {"loop": lambda h, w, e: _looped(h, moe, w, e), "loop-mm": loop_mm, "grouped": grouped, "bmm": bmm,
            "dense": lambda h, w, e: _dense_cpu(h, moe, w, e), "dense-groups": dense_groups,
            "dense-picked": dense_picked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=256, help="each expert's MLP width")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="dense-groups: groups of experts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (two rounds, the faster kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        runs = variants(args, dtype)
        print(f"{name}: ms per layer (max |diff| against loop)")
        for tokens in args.tokens:
            gen = torch.Generator().manual_seed(tokens)
            h = torch.randn(tokens, args.hidden, generator=gen).to(dtype)
            experts = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, args.top_k, generator=gen), -1).to(dtype)
            want = runs["loop"](h, weights, experts).float()
            cells = []
            for label, run in runs.items():
                diff = (run(h, weights, experts).float() - want).abs().max().item()
                best = float("inf")
                for _ in range(2):
                    start = time.perf_counter()
                    for _ in range(args.repeats):
                        run(h, weights, experts)
                    best = min(best, (time.perf_counter() - start) / args.repeats * 1e3)
                cells.append(f"{label} {best:6.2f} ({diff:.0e})")
            print(f"  T={tokens:<3} " + "  ".join(cells))


if __name__ == "__main__":
    main()
