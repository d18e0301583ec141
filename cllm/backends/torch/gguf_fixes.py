"""What transformers' GGUF reader drops from a GGUF file, put back as llama.cpp reads the file.

transformers (5.24) builds a model's config from a fixed table of GGUF keys per architecture
(``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``); keys outside it are ignored, and the config
class's defaults stand in. For the families below that silently changes the model, or makes the
load fail; here each missing value is taken from the file, so that the torch backend runs the same
model from the same file as the llama.cpp backend:

- qwen3: ``attention.key_length`` (head_dim; Qwen3-0.6B and -4B have head_dim 128, not
  hidden / heads): without it the load fails on the q/k/v shapes.
- qwen3_moe: ``expert_feed_forward_length`` (moe_intermediate_size): without it the expert shapes fail.
- gemma2: the attention and final logit softcaps (the defaults, 50 and 30, happen to be Gemma 2's).
- gemma2, gemma3: the attention scale. GGUF has no query_pre_attn_scalar; llama.cpp scales by
  1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (46 / 62 layers); transformers'
  default 256 is right for the others only (Gemma 2 27B: 144, Gemma 3 27B: 168).
- gemma3: the global layers' linear rope scaling (Gemma 3 4B and up: factor 8) and the local rope base
  (``rope.freq_base_swa``).
- phi3: partial rotary (``rope.dimension_count``: Phi-4-mini rotates 96 of 128 dims) and longrope
  (``rope_factors_short`` / ``rope_factors_long`` tensors, ``rope.scaling.original_context_length`` and
  ``attn_factor``; Phi-3.5-mini, Phi-4-mini).
- any family: ``rope.scaling.type`` linear (factor). Other rope scalings in a GGUF (yarn, ...) are
  refused: neither reader carries them over.
- llama: Llama 3.x's rope scaling is a ``rope_freqs`` tensor (a divisor per frequency), which
  transformers drops; the native decoder takes it as ``RopeSpec.freq_factors``, the transformers path
  through ``apply_rope_freqs``.
"""
from __future__ import annotations

from typing import Any

import torch

from cllm.backends.torch.gguf_metadata import GGUFMetadata

# transformers model_type -> (GGUF key without the architecture prefix, config attribute) it reads into.
_PLAIN_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen3": (("attention.key_length", "head_dim"),),
    "qwen3_moe": (("expert_feed_forward_length", "moe_intermediate_size"),),
    "gemma2": (("attn_logit_softcapping", "attn_logit_softcapping"),
               ("final_logit_softcapping", "final_logit_softcapping")),
    "gemma3_text": (("final_logit_softcapping", "final_logit_softcapping"),),
}
# Layer counts llama.cpp takes for the 27B Gemma models (their attention scale differs).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def complete_config(config: Any, meta: GGUFMetadata) -> tuple[Any, dict[str, Any]]:
    """``config`` (transformers' reading of the GGUF file ``meta`` describes) with the values above put
    back: a new config, validated by its class, and the changed fields (empty if none)."""
    model_type = getattr(config, "model_type", None)
    changes: dict[str, Any] = {}
    for key, attr in _PLAIN_KEYS.get(model_type, ()):
        value = meta.get(key)
        if value is not None and getattr(config, attr, None) != value:
            changes[attr] = value
    if model_type in _GEMMA_27B_LAYERS:
        changes.update(_gemma_attention_scale(config, meta, model_type))
    rope = _rope_parameters(config, meta, model_type)
    if rope is not None and rope != getattr(config, "rope_parameters", None):
        changes["rope_parameters"] = rope
    if not changes:
        return config, {}
    return type(config).from_dict({**config.to_dict(), **changes}), changes


def _gemma_attention_scale(config: Any, meta: GGUFMetadata, model_type: str) -> dict[str, Any]:
    if config.num_hidden_layers == _GEMMA_27B_LAYERS[model_type]:
        scalar = config.hidden_size // config.num_attention_heads
    else:
        scalar = int(meta.get("attention.key_length") or config.head_dim)
    return {} if config.query_pre_attn_scalar == scalar else {"query_pre_attn_scalar": scalar}


def _rope_parameters(config: Any, meta: GGUFMetadata, model_type: str) -> dict[str, Any] | None:
    """The rope_parameters the file describes, or None to keep transformers' reading."""
    current = dict(getattr(config, "rope_parameters", None) or {})
    if model_type == "phi3":
        return _phi3_rope(config, meta, current)
    scaling = str(meta.get("rope.scaling.type") or "none")
    factor = float(meta.get("rope.scaling.factor") or 1.0)
    if model_type == "gemma3_text":
        return _gemma3_rope(meta, current, scaling, factor)
    if scaling == "none" or factor == 1.0:
        return None
    if scaling != "linear":
        raise ValueError(f"{meta.path.name}: its rope scaling ({scaling!r}, factor {factor}) is not carried over by "
                         "transformers' GGUF reader, so the torch backend would run another model; serve this file "
                         "with the llama_cpp backend (`--backend llama_cpp`)")
    return {**current, "rope_type": "linear", "factor": factor}


def _gemma3_rope(meta: GGUFMetadata, current: dict[str, Any], scaling: str, factor: float) -> dict[str, Any]:
    """Gemma 3: global layers at rope.freq_base with the file's linear scaling, local ones at freq_base_swa."""
    full = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 1_000_000.0))}
    if scaling == "linear" and factor != 1.0:
        full.update(rope_type="linear", factor=factor)
    elif scaling != "none" and factor != 1.0:
        raise ValueError(f"{meta.path.name}: Gemma 3 with {scaling!r} rope scaling is not supported on the torch backend; "
                         "serve this file with the llama_cpp backend (`--backend llama_cpp`)")
    local = dict(current.get("sliding_attention") or {"rope_type": "default"})
    if meta.get("rope.freq_base_swa") is not None:
        local["rope_theta"] = float(meta.get("rope.freq_base_swa"))
    return {**current, "full_attention": full, "sliding_attention": local}


def _phi3_rope(config: Any, meta: GGUFMetadata, current: dict[str, Any]) -> dict[str, Any]:
    """Phi-3 / Phi-4: partial rotary from rope.dimension_count; longrope from the rope_factors tensors."""
    head_dim = config.hidden_size // config.num_attention_heads
    rope = {**current, "partial_rotary_factor": int(meta.get("rope.dimension_count") or head_dim) / head_dim}
    short, long = meta.tensor("rope_factors_short.weight"), meta.tensor("rope_factors_long.weight")
    if short is None and long is None:
        return rope
    if short is None or long is None:
        raise ValueError(f"{meta.path.name}: a Phi-3 GGUF with only one of rope_factors_short / rope_factors_long")
    original = int(meta.get("rope.scaling.original_context_length") or config.max_position_embeddings)
    rope.update(rope_type="longrope", short_factor=[float(x) for x in short], long_factor=[float(x) for x in long],
                original_max_position_embeddings=original)
    if meta.get("rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = float(meta.get("rope.scaling.attn_factor"))
    return rope


def rope_freq_factors(meta: GGUFMetadata) -> tuple[float, ...] | None:
    """The ``rope_freqs.weight`` tensor of a GGUF file (llama.cpp divides each rotary frequency by it)."""
    factors = meta.tensor("rope_freqs.weight")
    return None if factors is None else tuple(float(x) for x in factors)


def apply_rope_freqs(model: torch.nn.Module, factors: tuple[float, ...]) -> int:
    """Divide the rotary frequencies of every rotary embedding of a transformers ``model`` by ``factors``
    (what llama.cpp does with ``rope_freqs``); the number of modules changed. ValueError if none fits."""
    divisor = torch.tensor(factors, dtype=torch.float32)
    changed = 0
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != divisor.shape:
            continue
        module.inv_freq = inv_freq / divisor.to(inv_freq)
        if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
            module.original_inv_freq = module.inv_freq.clone()
        changed += 1
    if not changed:
        raise ValueError(f"no rotary embedding with {len(factors)} frequencies to apply the GGUF's rope_freqs to")
    return changed


__all__ = ["apply_rope_freqs", "complete_config", "rope_freq_factors"]
