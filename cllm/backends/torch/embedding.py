"""Pooled hidden states of the torch decoder, for /v1/embeddings.

Embedding inputs never touch the paged KV cache (they would take blocks from
generation and pollute the prefix cache): all inputs of one call run as one
flat ``[T, hidden]`` batch through the same layer functions as generation, with
attention restricted by a block-diagonal causal mask, so each input sees only
its own earlier tokens — the same causal attention llama.cpp's embeddings
context uses for a decoder model. The final RMSNorm is applied before pooling,
as llama.cpp pools its normed output.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cllm.backends.torch.hf_model import TransformersCausalLM
from cllm.backends.torch.model import CausalLM


@torch.inference_mode()
def pooled_hidden_states(model: CausalLM | TransformersCausalLM, inputs: Sequence[Sequence[int]], pooling: str,
                         device: torch.device) -> np.ndarray:
    """``[len(inputs), hidden]`` float32: each input's normed final hidden states, pooled (mean | cls | last)."""
    lengths = [len(ids) for ids in inputs]
    ids = torch.tensor([t for seq in inputs for t in seq], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    mask = _block_causal_mask(lengths, device)
    if isinstance(model, CausalLM):
        hidden = _final_hidden(model, ids, positions, mask)
    else:  # the transformers path: its decoder, attention through the same mask (hf_model._Packed)
        hidden = model.final_hidden(ids, positions, mask)
    pooled = [_pool(part, pooling) for part in torch.split(hidden, lengths)]
    return torch.stack(pooled).float().cpu().numpy()


def _block_causal_mask(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[T, T]`` True where token i may attend token j: same input, j <= i."""
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    index = torch.arange(len(owner), device=device)
    return (owner[:, None] == owner[None, :]) & (index[None, :] <= index[:, None])


def _final_hidden(model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    spec = model.spec
    x = F.embedding(ids, model.embed)
    cos, sin = model._rope_tables(positions, x.dtype)
    group = spec.num_heads // spec.num_kv_heads
    for w in model.layers:
        q, k, v = model._attention_inputs(x, w, cos, sin, spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps)
        # [T, heads, dim] -> [heads, T, dim]; a kv head serves the `group` query heads next to it.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = model._output_and_mlp(x, o.transpose(0, 1).reshape(x.shape[0], -1), w, spec.rms_norm_eps)
    return F.rms_norm(x, (x.shape[-1],), model.norm, spec.rms_norm_eps)


def _pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[0]
    if pooling == "last":
        return hidden[-1]
    return hidden.float().mean(dim=0)
