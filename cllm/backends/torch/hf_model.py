"""The generic path (issue 40): transformers' own model code over our paged KV cache.

For an architecture without a native implementation (model.py), the torch backend builds the
transformers model from the checkpoint and runs it with an attention function registered through
transformers' attention interface (``ATTENTION_NAME``). transformers computes everything a family
does around attention (its norms, rope, MoE routing, softcapped logits, multipliers); our function
writes each layer's K/V into the paged pool and attends each token over its own sequence's blocks.
So the scheduler, prefix caching, chunked prefill, batching of many sequences in one forward,
preemption, speculative verification rows and KV export/import work as on the native path: they
are the backend's, not the model's.

A step is one forward of the flat ``[1, T]`` batch, with ``position_ids`` giving each token's place
in its own sequence (rope is computed from them) and ``use_cache=False`` (the pool is the cache).
transformers builds no mask for an attention implementation without a registered mask function:
what a token may see is decided here, from the step's :class:`AttentionBatch`.

What a layer asks of attention is read from transformers' call: ``scaling``, ``sliding_window``,
``softcap`` (Gemma 2), ``s_aux`` (gpt-oss's sinks). The pool's geometry is probed once at load by a
one-token forward that records each layer's heads and widths: layers whose K/V have fewer heads than
the widest layer are repeated up to it (exact: grouped-query attention reads each K/V head for a
fixed set of query heads), narrower heads are zero-padded (exact: zeros add nothing to q·k and give
zero output columns, cut off again), and a V narrower than K (DeepSeek's MLA, cached as expanded
K/V) likewise. A layer that reuses another's K/V (Gemma 4's shared layers) gets them from
transformers and stores its own copy.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cllm.backends.torch.attention import AttentionBatch, AttentionExtras, matmul_attention, paged_attention
from cllm.backends.torch.kv_cache import PagedKVCache
from cllm.backends.torch.linear import Linear
from cllm.backends.torch.loader import ModelSpec, RopeSpec

log = logging.getLogger("cllm.torch")

ATTENTION_NAME = "cllm_paged"  # the attention implementation transformers' models are switched to


@dataclass(slots=True, frozen=True)
class LayerAttention:
    """What one layer's attention calls look like (probed at load)."""

    heads: int  # query heads
    kv_heads: int  # K/V heads as the layer hands them over
    k_dim: int  # query/key width per head
    v_dim: int  # value width per head
    window: int | None  # sliding window in tokens (None: full attention)
    extras: AttentionExtras | None  # scale, softcap, sinks; None: plain 1/sqrt(k_dim) attention


class _Step:
    """One forward's attention: the pool and the step's metadata, handed to every layer."""

    __slots__ = ("model", "cache", "batch")

    def __init__(self, model: TransformersCausalLM, cache: PagedKVCache, batch: AttentionBatch) -> None:
        self.model, self.cache, self.batch = model, cache, batch

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        layer = module.layer_idx
        spec = self.model.layers[layer]
        cache = self.cache
        pool_heads, dim = cache.shape.num_kv_heads, cache.shape.head_dim
        # [1, heads, T, dim] -> [T, heads, dim], padded to the pool's geometry
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        if k.shape[1] != pool_heads:
            k = k.repeat_interleave(pool_heads // k.shape[1], dim=1)
            v = v.repeat_interleave(pool_heads // v.shape[1], dim=1)
        if q.shape[-1] != dim:
            q, k = F.pad(q, (0, dim - q.shape[-1])), F.pad(k, (0, dim - k.shape[-1]))
        if v.shape[-1] != dim:
            v = F.pad(v, (0, dim - v.shape[-1]))
        out = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), cache, layer,
                              self.batch.for_window(window), spec.extras)
        out = out.view(q.shape[0], q.shape[1], dim)
        if spec.v_dim != dim:
            out = out[..., : spec.v_dim]
        return out[None]  # [1, T, heads, v_dim], as transformers' attention functions return


class _Packed:
    """Embeddings: several inputs packed in one forward, each attending only to its own earlier tokens
    (``mask``: ``[T, T]`` block-causal), nothing cached (see embedding.py)."""

    __slots__ = ("model", "mask", "positions")

    def __init__(self, model: TransformersCausalLM, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.model, self.mask, self.positions = model, mask, positions

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        spec = self.model.layers[module.layer_idx]
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        mask = self.mask
        if window is not None:  # within the window of each query's own position
            mask = mask & (self.positions[:, None] - self.positions[None, :] < window)
        sinks = None if spec.extras is None or spec.extras.sinks is None else spec.extras.sinks.view(1, -1, 1, 1)
        out = matmul_attention(query, key, value, mask, spec.extras, sinks)  # [1, heads, T, v_dim]
        return out.transpose(1, 2)


class _Probe:
    """A one-token forward's stand-in for :class:`_Step`: records each layer's call, attends nothing."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerAttention] = {}

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, scaling: float | None, softcap: float | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
        heads, k_dim = query.shape[1], query.shape[-1]
        plain = softcap is None and sinks is None and (scaling is None or abs(scaling - k_dim ** -0.5) < 1e-12)
        extras = None if plain else AttentionExtras(
            scale=scaling, softcap=softcap, sinks=None if sinks is None else sinks.detach().float().reshape(heads))
        self.layers[module.layer_idx] = LayerAttention(heads, key.shape[1], k_dim, value.shape[-1], window, extras)
        return value.new_zeros(1, query.shape[2], heads, value.shape[-1])


def _cllm_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    s_aux: torch.Tensor | None = None, cllm_step: _Step | _Packed | _Probe | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, over our pool (``cllm_step`` comes through the
    model's forward kwargs)."""
    if cllm_step is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention runs only inside the torch backend's forward")
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    window = int(window) if window else None
    if isinstance(cllm_step, _Probe):
        if softcap is None and isinstance(getattr(module, "softcap", None), (int, float)):
            softcap = module.softcap
        sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
        return cllm_step.attend(module, query, key, value, window, scaling=scaling, softcap=softcap,
                                sinks=sinks), None
    return cllm_step.attend(module, query, key, value, window), None


def register_attention() -> None:
    """Make ``ATTENTION_NAME`` an attention implementation transformers' models can be switched to."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _cllm_attention)


class _PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose matmul is cllm's Linear (oneDNN-prepacked, or fbgemm float16 weights):
    the native decoder's CPU fast path for transformers' modules. The packed copy replaces the weight, as
    in the native decoder (no double memory): ``weight`` is left an empty tensor of its dtype and device,
    for code that reads those; ``in_features``/``out_features`` keep the shape."""

    def __init__(self, linear: torch.nn.Linear, fp16_weights: bool, pad_rows: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.packed = Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(),
                             prepack=True, fp16_weights=fp16_weights, pad_rows=pad_rows)
        self.register_buffer("weight", linear.weight.new_empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


def pack_linears(model: torch.nn.Module, *, fp16_weights: bool, pad_rows: bool = False) -> int:
    """Swap every ``nn.Linear`` of a CPU model for :class:`_PackedLinear`; how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu":
                setattr(parent, name, _PackedLinear(child, fp16_weights, pad_rows))
                swapped += 1
    return swapped


class TransformersCausalLM:
    """A transformers ``*ForCausalLM`` driven step by step over the paged pool (same call as CausalLM)."""

    def __init__(self, hf_model: torch.nn.Module, *, fp16_weights: bool = False, pad_rows: bool = False) -> None:
        self.hf = hf_model
        if next(hf_model.parameters()).device.type == "cpu":
            pack_linears(hf_model, fp16_weights=fp16_weights, pad_rows=pad_rows)
        self.layers = self._probe()
        first = self.layers[0]
        self.num_heads = first.heads
        self.kv_heads = max(layer.kv_heads for layer in self.layers)
        self.head_dim = max(max(layer.k_dim, layer.v_dim) for layer in self.layers)
        for i, layer in enumerate(self.layers):
            if layer.heads != self.num_heads or self.kv_heads % layer.kv_heads or layer.heads % self.kv_heads:
                raise ValueError(
                    f"layer {i} has {layer.heads} query and {layer.kv_heads} K/V heads: the pool's {self.kv_heads} "
                    f"K/V heads for {self.num_heads} query heads cannot hold it")
        # The distinct sliding windows: each gets its own attention metadata per step.
        self.windows = tuple(sorted({layer.window for layer in self.layers if layer.window is not None}))

    def _probe(self) -> list[LayerAttention]:
        probe = _Probe()
        device = next(self.hf.parameters()).device
        with torch.inference_mode():
            self.hf(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=device),
                    position_ids=torch.zeros((1, 1), dtype=torch.int64, device=device), use_cache=False,
                    logits_to_keep=1, cllm_step=probe)
        count = len(probe.layers)
        if sorted(probe.layers) != list(range(count)) or count == 0:
            raise ValueError(f"the model's attention layers are numbered {sorted(probe.layers)[:8]}…: "
                             "not a decoder the generic path can drive")
        return [probe.layers[i] for i in range(count)]

    @property
    def needs_sdpa(self) -> bool:
        """Whether some layer asks for what only the SDPA path serves (windows, scale, softcap, sinks, padding)."""
        return bool(self.windows) or any(
            layer.extras is not None or layer.kv_heads != self.kv_heads or layer.k_dim != self.head_dim
            or layer.v_dim != self.head_dim for layer in self.layers)

    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The decoder's normed final hidden states ``[T, hidden]`` of packed inputs (block-causal ``mask``)."""
        out = self.hf.get_decoder()(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                    cllm_step=_Packed(self, mask, positions))
        return out.last_hidden_state[0]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache, batch: AttentionBatch,
                 logit_rows: torch.Tensor, images: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                 rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[len(logit_rows), vocab]`` of the given flat rows; K/V of all tokens cached.
        ``images``: (flat rows, embeddings) that replace those rows' token embeddings (a VLM's image
        placeholders, as transformers' own forward scatters its image features). ``rope_positions``: M-RoPE's
        ``[3, T]`` positions in place of ``positions`` for rope (the cache is still laid out by index)."""
        if images:
            embeds = self.hf.get_input_embeddings()(input_ids[None])
            for rows, feats in images:
                embeds[0, rows] = feats.to(embeds.dtype)
            inputs = {"inputs_embeds": embeds}
        else:
            inputs = {"input_ids": input_ids[None]}
        position_ids = positions[None] if rope_positions is None else rope_positions[:, None, :]
        out = self.hf(**inputs, position_ids=position_ids, use_cache=False, logits_to_keep=logit_rows,
                      cllm_step=_Step(self, cache, batch))
        return out.logits[0].float()


def generic_spec(lm: TransformersCausalLM) -> ModelSpec:
    """The facts the backend needs (pool geometry, vocabulary, memory sizing) of a transformers model.
    Rope and norms are transformers' business here: the spec's rope is a placeholder the native
    decoder alone reads."""
    config = lm.hf.config.get_text_config()
    hidden = config.hidden_size
    intermediate = (getattr(config, "intermediate_size", None) or getattr(config, "moe_intermediate_size", None)
                    or 4 * hidden)
    return ModelSpec(
        architecture=config.model_type,
        vocab_size=lm.hf.get_output_embeddings().out_features,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=len(lm.layers),
        num_heads=lm.num_heads,
        num_kv_heads=lm.kv_heads,
        head_dim=lm.head_dim,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6) or 1e-6),
        rope=RopeSpec(theta=float(getattr(config, "rope_theta", 10000.0) or 10000.0), rope_type="default"),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 0) or 1 << 20),
        qk_norm=False,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=None,  # per layer: TransformersCausalLM.layers / windows
    )
