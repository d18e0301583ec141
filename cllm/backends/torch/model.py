"""Our Llama-family decoder: one batched forward over flat varlen tokens.

Covers Llama / SmolLM / Mistral (plain), Qwen2 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm) and the Mixture-of-Experts Qwen3-MoE and Mixtral (their sparse
MLPs in :mod:`moe`). Tokens of all scheduled sequences run through every layer as one
``[T, hidden]`` matrix; only attention looks at sequence boundaries (through the
paged KV cache, see :mod:`attention`). Q/K/V and gate/up projections are fused
into one matmul each: fewer, larger kernels matter on CPU where a step's op
count, not FLOPs, dominates small-batch decode.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from cllm.backends.torch.attention import AttentionBatch, paged_attention
from cllm.backends.torch.invariant import elementwise
from cllm.backends.torch.kv_cache import PagedKVCache
from cllm.backends.torch.linear import Linear
from cllm.backends.torch.loader import ModelSpec, RopeSpec
from cllm.backends.torch.moe import MoEWeights, dense_max_tokens, load_moe, moe_forward, moe_tensor_names


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair rotary frequencies, with linear or llama3 scaling applied (as transformers does), then
    divided by a GGUF file's ``rope_freqs`` factors when it has them (as llama.cpp does)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != len(inv_freq):
            raise ValueError(f"rope_freqs has {len(rope.freq_factors)} factors for {len(inv_freq)} rotary pairs (head_dim {head_dim})")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors, with Q|K|V and gate|up fused into one matmul each; a sparse (MoE) layer
    has ``moe`` in place of ``gate_up``/``down``."""

    input_norm: torch.Tensor  # RMSNorm weight before attention
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qk_norm: torch.Tensor | None  # Qwen3: per-head q/k RMSNorm weights as [heads + kv_heads, head_dim]
    o: Linear  # attention output projection
    post_norm: torch.Tensor  # RMSNorm weight before the MLP
    gate_up: Linear | None  # [2 * intermediate, hidden]; None in a sparse layer
    down: Linear | None  # [hidden, intermediate]; None in a sparse layer
    moe: MoEWeights | None = None  # a sparse layer's router and experts
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu  # the MLP's activation (invariant.elementwise under pad_rows)


def attention_inputs(
    x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-norm, fused QKV projection, optional per-head q/k norm, rope. Returns q, k, v ``[T, heads, dim]``."""
    head_dim = cos.shape[-1]
    h = F.rms_norm(x, (x.shape[-1],), w.input_norm, eps)
    qkv = w.qkv(h).view(x.shape[0], -1, head_dim)
    split = num_heads + num_kv_heads
    qk = qkv[:, :split]
    if w.qk_norm is not None:
        qk = F.rms_norm(qk, (head_dim,), None, eps) * w.qk_norm
    # rotate_half(x) * sin == roll(x, dim/2) * [-sin, sin] (sign folded into the table): exact, one op fewer.
    qk = torch.addcmul(qk * cos, torch.roll(qk, head_dim // 2, dims=-1), sin)
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, split:]


def output_and_mlp(x: torch.Tensor, attn_out: torch.Tensor, w: LayerWeights, eps: float) -> torch.Tensor:
    """Attention output projection + residual, then pre-norm SwiGLU MLP (or sparse MoE MLP) + residual."""
    x = x + w.o(attn_out)
    h = F.rms_norm(x, (x.shape[-1],), w.post_norm, eps)
    if w.moe is not None:
        return x + moe_forward(h, w.moe)
    gate, up = w.gate_up(h).chunk(2, dim=-1)
    return x + w.down(w.act(gate) * up)


class CausalLM:
    """Embedding, decoder layers, final norm and LM head; inference only."""

    def __init__(
        self, spec: ModelSpec, state: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device,
        compiled: bool = False, fp16_weights: bool = False, pad_rows: bool = False, moe_dense: bool = False,
    ) -> None:
        """``pad_rows``: model.deterministic's fixed-kernel linears (linear.py); ``moe_dense``: sparse layers
        also keep the CPU dense path's copy of their experts (torch.moe_dense_decode, moe.py)."""
        self.spec = spec
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            if name not in state:
                raise ValueError(f"model weights lack {name!r}: not a {spec.architecture} checkpoint")
        # torch.compile traces F.linear; oneDNN-packed weights are the eager CPU fast path.
        prepack = device.type == "cpu" and not compiled
        self.inv_freq = rope_inv_freq(spec.rope, spec.head_dim).to(device)
        # pad_rows (model.deterministic): the rotary tables' cos/sin and the MLP's SiLU on vector code only
        self._elementwise: Callable = elementwise if pad_rows else _plain
        self.embed = state["model.embed_tokens.weight"].to(device, dtype)
        self.norm = state["model.norm.weight"].to(device, dtype)
        head = state.get("lm_head.weight")
        # Tied embeddings reuse the embedding matrix (GGUF loads may still list lm_head as an alias).
        self.lm_head = Linear(self.embed if head is None or spec.tie_word_embeddings else head.to(device, dtype), None,
                              prepack=prepack, fp16_weights=fp16_weights, pad_rows=pad_rows)
        self.layers = [
            _layer_weights(spec, state, f"model.layers.{i}.", dtype, device, prepack, fp16_weights, pad_rows,
                           sparse=bool(spec.moe_layers) and spec.moe_layers[i], moe_dense=moe_dense)
            for i in range(spec.num_layers)
        ]
        sparse = [layer.moe for layer in self.layers if layer.moe is not None and layer.moe.dense is not None]
        if sparse:  # every sparse layer has the same shapes: time dense against the loop once, on the first
            limit = dense_max_tokens(sparse[0], dtype)
            for layer_moe in sparse:
                layer_moe.dense_max_tokens = limit
        # Every layer's sliding window (Mistral v0.1), set by the backend when it is shorter than the
        # context (a window the context never passes is full attention); None: full attention.
        self.window: int | None = None
        self._attention_inputs, self._output_and_mlp = attention_inputs, output_and_mlp
        if compiled:  # weights are arguments, not attributes, so every layer shares one compiled graph
            self._attention_inputs = torch.compile(attention_inputs, dynamic=True)
            self._output_and_mlp = torch.compile(output_and_mlp, dynamic=True)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        batch: AttentionBatch,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits ``[len(logit_rows), vocab]`` of the given flat rows; K/V of all tokens cached."""
        spec = self.spec
        x = F.embedding(input_ids, self.embed)
        cos, sin = self._rope_tables(positions, x.dtype)
        batch = batch.for_window(self.window)
        for index, w in enumerate(self.layers):
            q, k, v = self._attention_inputs(x, w, cos, sin, spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps)
            o = paged_attention(q, k, v, cache, index, batch)
            x = self._output_and_mlp(x, o, w, spec.rms_norm_eps)
        h = F.rms_norm(x.index_select(0, logit_rows), (x.shape[-1],), self.norm, spec.rms_norm_eps)
        return self.lm_head(h).float()

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, ``[T, 1, head_dim]``, computed in float32 then cast (as transformers)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = self._elementwise(torch.cos, freqs), self._elementwise(torch.sin, freqs)
        cos = torch.cat([cos, cos], dim=-1)
        sin = torch.cat([-sin, sin], dim=-1)
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def _plain(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def _layer_weights(
    spec: ModelSpec, state: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype, device: torch.device,
    prepack: bool, fp16_weights: bool, pad_rows: bool, *, sparse: bool, moe_dense: bool = False,
) -> LayerWeights:
    """One layer's HF tensors, fused (q|k|v, gate|up), cast and moved; absent biases stay None.
    A ``sparse`` layer gets a MoE block (router and stacked experts) in place of the dense MLP."""
    _check_present(spec, state, prefix, sparse)

    def get(name: str) -> torch.Tensor | None:
        t = state.get(prefix + name)
        return None if t is None else t.to(device, dtype)

    def fused(*names: str) -> torch.Tensor | None:
        parts = [get(n) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0).contiguous()

    def linear(weight: torch.Tensor | None, bias: torch.Tensor | None) -> Linear:
        assert weight is not None  # _check_present guarantees every weight
        return Linear(weight, bias, prepack=prepack, fp16_weights=fp16_weights, pad_rows=pad_rows)

    attn, mlp = "self_attn.", "mlp."
    qk_norm = None
    if spec.qk_norm:
        q_norm, k_norm = get(attn + "q_norm.weight"), get(attn + "k_norm.weight")
        qk_norm = torch.cat([q_norm.expand(spec.num_heads, -1), k_norm.expand(spec.num_kv_heads, -1)])
    moe = gate_up = down = None
    if sparse:
        moe = load_moe(state, prefix, num_experts=spec.num_experts, top_k=spec.num_experts_per_tok,
                       renormalize=spec.norm_topk_prob, dtype=dtype, device=device, prepack=prepack,
                       fp16_weights=fp16_weights, pad_rows=pad_rows, dense=moe_dense)
    else:
        gate_up = linear(fused(mlp + "gate_proj.weight", mlp + "up_proj.weight"), fused(mlp + "gate_proj.bias", mlp + "up_proj.bias"))
        down = linear(get(mlp + "down_proj.weight"), get(mlp + "down_proj.bias"))
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv=linear(fused(*(attn + p + "_proj.weight" for p in "qkv")), fused(*(attn + p + "_proj.bias" for p in "qkv"))),
        qk_norm=qk_norm,
        o=linear(get(attn + "o_proj.weight"), get(attn + "o_proj.bias")),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=gate_up,
        down=down,
        moe=moe,
        act=partial(elementwise, F.silu) if pad_rows else F.silu,
    )


def _check_present(spec: ModelSpec, state: dict[str, torch.Tensor], prefix: str, sparse: bool) -> None:
    required = [prefix + "self_attn." + p + "_proj.weight" for p in "qkvo"]
    if sparse:
        required += moe_tensor_names(state, prefix, spec.num_experts)
    else:
        required += [prefix + "mlp." + p + "_proj.weight" for p in ("gate", "up", "down")]
    required += [prefix + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm")]
    if spec.qk_norm:
        required += [prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"]
    missing = [name for name in required if name not in state]
    if missing:
        raise ValueError(f"model weights lack {missing[:4]}: not a {spec.architecture} checkpoint, or a truncated one")
