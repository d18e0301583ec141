"""Which model code runs a checkpoint on the torch backend: ``model_impl: auto | native | transformers``.

native: cllm's own batched decoder (model.py), for the families it implements. transformers: the
family's transformers model code over our paged attention (hf_model.py), for any decoder
transformers' ``AutoModelForCausalLM`` knows. auto: native where it can run the checkpoint exactly,
else transformers. Linear-attention hybrids (Gated DeltaNet: Qwen3.5, Qwen3-Next) need a recurrent
state beside the paged KV that neither path keeps yet: refused, with the llama.cpp route.
"""
from __future__ import annotations

from typing import Any

from cllm.backends.torch.loader import SUPPORTED_ARCHITECTURES, spec_from_config

MODEL_IMPLS = ("auto", "native", "transformers")
# Families whose layers are not all attention layers (state beyond a KV cache): see docs/architecture.md.
LINEAR_ATTENTION_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                          "falcon_h1", "jamba", "bamba", "granitemoehybrid", "lfm2", "mamba", "mamba2")
# Families whose sliding window the native decoder cannot mirror when it is on (it windows all layers or none).
_LAYERED_WINDOWS = ("qwen2", "qwen3", "qwen3_moe")


def served_summary() -> str:
    """What the torch backend serves, for error messages."""
    return (f"the torch backend runs natively: {', '.join(SUPPORTED_ARCHITECTURES)}; and through transformers' "
            "model code (model_impl transformers) any decoder-only model transformers' AutoModelForCausalLM "
            "knows whose layers are all attention layers")


def llama_cpp_route() -> str:
    return ("to serve it anyway, convert it with llama.cpp's convert_hf_to_gguf.py and run "
            "`cllm serve --backend llama_cpp --model FILE.gguf`")


def refuse_unservable(model_type: str | None, raw: dict[str, Any] | None = None) -> None:
    """ValueError for a model neither path runs (linear-attention hybrids), naming what is served."""
    layer_types = set((raw or {}).get("layer_types") or ())
    if model_type in LINEAR_ATTENTION_TYPES or layer_types - {"full_attention", "sliding_attention", "chunked_attention"}:
        raise ValueError(f"the torch backend cannot run model architecture {model_type!r}: its layers keep a "
                         f"recurrent state (linear attention) beside the KV cache; {served_summary()}; "
                         f"{llama_cpp_route()}")


def native_refusal(config: Any) -> str | None:
    """Why the native decoder cannot run this transformers config exactly; None if it can."""
    arch = getattr(config, "model_type", None)
    quantization = getattr(config, "quantization_config", None)
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", quantization))
    # The native decoder reads float weights; a GGUF's are dequantized to float32 at load (loader.py), those
    # of other quantized checkpoints only inside transformers' own modules.
    if quantization and method != "gguf":
        return f"its weights are quantized (quant_method {method})"
    if arch in _LAYERED_WINDOWS and getattr(config, "use_sliding_window", False):
        return f"{arch} with use_sliding_window windows some layers only"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if len(layer_types) > 1:
        return f"its layers mix attention kinds ({', '.join(sorted(layer_types))})"
    try:
        spec_from_config(config)
    except ValueError as err:
        return str(err)
    return None


def choose_impl(setting: str, config: Any) -> str:
    """``native`` or ``transformers`` for this config under ``setting`` (ValueError if it cannot be honoured)."""
    if setting not in MODEL_IMPLS:
        raise ValueError(f"model_impl={setting!r}: expected one of {', '.join(MODEL_IMPLS)}")
    arch = getattr(config, "model_type", None)
    refuse_unservable(arch, config.to_dict() if hasattr(config, "to_dict") else None)
    why_not_native = native_refusal(config)
    if setting == "native":
        if why_not_native:
            raise ValueError(f"model_impl=native cannot run this {arch!r} model: {why_not_native}; "
                             "use model_impl auto or transformers")
        return "native"
    if setting == "auto" and why_not_native is None:
        return "native"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"the torch backend does not support model architecture {arch!r}: transformers has no "
                         f"causal-LM model for it; {served_summary()}; {llama_cpp_route()}")
    return "transformers"
