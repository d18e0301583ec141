"""Weights and hyper-parameters of a decoder, from an HF directory or a GGUF file: for the native
decoder (model.py) as a spec and a state dict, or as a transformers model for the generic path
(hf_model.py), as model_impl.choose_impl decides.

HF directory: ``config.json`` plus ``*.safetensors`` (or ``pytorch_model*.bin``). A checkpoint whose
experts are stored in MXFP4 (gpt-oss as published: ``quantization_config.quant_method`` ``mxfp4``) is
dequantized at load by transformers' own MXFP4 loader, into the dtype the backend runs in.
GGUF: transformers' GGUF loader dequantizes it into a float32 ``*ForCausalLM`` whose
config and state dict we take over; the llama.cpp Q/K row permutation is undone
there, and what its config reading drops is put back from the file (gguf_fixes.py),
so the same file runs the same model on both backends. A file transformers cannot
read, or reads leaving weights of its model unset, is refused with the llama.cpp route.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from cllm.backends.torch.gguf_metadata import GGUFMetadata

log = logging.getLogger("cllm.torch")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary embedding parameters."""

    theta: float  # base frequency
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / this are fully scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / this are kept
    original_max_position: int = 8192  # llama3: context the model was pretrained on
    # Per-pair frequency divisors as llama.cpp applies them (GGUF ``rope_freqs.weight``: Llama-3.x files
    # carry their llama3 scaling this way, not in metadata); applied on top of rope_type; None = none.
    freq_factors: tuple[float, ...] | None = None


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """The hyper-parameters our decoder needs."""

    architecture: str  # HF model_type, one of SUPPORTED_ARCHITECTURES
    vocab_size: int  # embedding rows / logits per token
    hidden_size: int  # residual width
    intermediate_size: int  # MLP width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width (Qwen3 sets it independently of hidden_size)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope: RopeSpec  # rotary embedding
    max_position_embeddings: int  # trained context length
    qk_norm: bool  # Qwen3: RMSNorm on each head's q and k before rope
    tie_word_embeddings: bool  # LM head shares the embedding matrix
    sliding_window: int | None  # attention window, if the model uses one
    num_experts: int = 0  # MoE: experts per sparse layer (0 = a dense model)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # MoE: each expert's MLP width
    norm_topk_prob: bool = True  # MoE: top-k routing weights renormalised to sum to 1 (Mixtral always)
    moe_layers: tuple[bool, ...] = ()  # MoE: per layer, sparse (True) or dense MLP; () = all dense


@dataclass(slots=True)
class LoadedModel:
    """What the loader hands the backend."""

    spec: ModelSpec | None  # hyper-parameters (native path; None with hf_model)
    state_dict: dict[str, torch.Tensor]  # HF parameter names -> float tensors (native path; empty with hf_model)
    tokenizer_dir: Path  # where AutoTokenizer should look
    gguf_file: str | None  # GGUF file name inside tokenizer_dir, if loaded from GGUF
    eos_token_ids: tuple[int, ...] = ()  # end tokens named by the model's (generation) config
    hf_model: Any = None  # the transformers model, when its own code runs it (model_impl transformers)
    hf_tokenizer: Any = None  # the transformers tokenizer, when the loader made it (GGUF: one parse for both)
    vision: bool = False  # hf_model is a vision-language model (AutoModelForImageTextToText): images in prompts


def check_architecture(arch: str | None) -> str:
    """``arch`` if the native decoder runs it, else ValueError naming the ones it runs."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"the torch backend's native decoder does not implement model architecture {arch!r}; "
            f"it implements: {', '.join(SUPPORTED_ARCHITECTURES)} (model_impl transformers runs the others)"
        )
    return arch


def spec_from_config(config: Any) -> ModelSpec:
    """Our spec from a transformers PretrainedConfig; ValueError for other architectures."""
    arch = check_architecture(getattr(config, "model_type", None))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):  # Qwen2/3 carry a window they do not use
        window = None
    return ModelSpec(
        architecture=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope=_rope_spec(config),
        max_position_embeddings=config.max_position_embeddings,
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        **_moe_fields(config, arch),
    )


def _moe_fields(config: Any, arch: str) -> dict[str, Any]:
    """The MoE fields of ModelSpec; none for a dense model."""
    if arch == "mixtral":  # every layer sparse, experts as wide as intermediate_size, top-k always renormalised
        return dict(num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
                    moe_intermediate_size=config.intermediate_size, norm_topk_prob=True,
                    moe_layers=(True,) * config.num_hidden_layers)
    if arch != "qwen3_moe":
        return {}
    # Qwen3-MoE: a layer is sparse every decoder_sparse_step-th layer unless listed in mlp_only_layers.
    experts, step, dense = config.num_experts, config.decoder_sparse_step, set(config.mlp_only_layers or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(config.num_hidden_layers))
    return dict(num_experts=experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                moe_layers=sparse)


def _rope_spec(config: Any) -> RopeSpec:
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported by the torch backend; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeSpec(
        theta=float(params.get("rope_theta", 10000.0)),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def load_model(path: Path, model_impl: str = "auto", dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a GGUF file (dequantized to float32 tensors) or an HF model directory, for the native
    decoder or, as ``model_impl`` and the architecture decide (model_impl.choose_impl), as a
    transformers model for the generic path. ``dtype``: what an HF directory's transformers model is
    built in (the backend's dtype, so that a large checkpoint is never held in float32 on the way)."""
    if path.is_dir():
        return _load_hf_dir(path, model_impl, dtype)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, model_impl)
    raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a Hugging Face model directory")


def _load_hf_dir(path: Path, model_impl: str, dtype: torch.dtype) -> LoadedModel:
    from cllm.backends.torch.vision import is_vision_config
    from transformers import AutoConfig, AutoModelForCausalLM

    from cllm.backends.torch.hf_model import ATTENTION_NAME, register_attention
    from cllm.backends.torch.model_impl import choose_impl, llama_cpp_route, refuse_unservable, served_summary

    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    # Fail on the architecture before transformers tries to resolve its config class.
    refuse_unservable(raw.get("model_type"), raw)
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as err:
        raise ValueError(f"the torch backend does not support model architecture {raw.get('model_type')!r}: "
                         f"transformers cannot read its config ({err}); {served_summary()}; {llama_cpp_route()}") from err
    eos = _as_ids(getattr(config, "eos_token_id", None)) + _as_ids(getattr(config.get_text_config(), "eos_token_id", None))
    generation = path / "generation_config.json"
    if generation.is_file():
        eos += _as_ids(json.loads(generation.read_text()).get("eos_token_id"))
    if is_vision_config(config):
        return _load_vision_model(path, config, model_impl, eos)
    if choose_impl(model_impl, config) == "native":
        return LoadedModel(spec_from_config(config), _read_tensors(path), path, None, eos)
    register_attention()
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTENTION_NAME,
                                                    **_dequantizing(raw))
    return LoadedModel(None, {}, path, None, eos, hf_model.eval())


def _dequantizing(raw: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained`` settings that dequantize an MXFP4 checkpoint at load, into the ``dtype`` it is
    given (exactly in float32 and bfloat16: an FP4 value has two significant bits, its scale is a power of
    two within their exponent range). Left to itself transformers would, on a GPU with Triton and the
    ``kernels`` package, swap the experts for a packed module running kernels fetched from the hub, one
    that ``.to(dtype)`` cannot convert. Nothing for an unquantized checkpoint."""
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def _load_vision_model(path: Path, config: Any, model_impl: str, eos: tuple[int, ...]) -> LoadedModel:
    """A vision-language checkpoint: transformers' model, its decoder on the paged attention, its vision
    tower (and any other part) on SDPA."""
    from transformers import AutoModelForImageTextToText

    from cllm.backends.torch.hf_model import ATTENTION_NAME, register_attention

    if model_impl == "native":
        raise ValueError(f"model_impl=native cannot run the vision-language model {config.model_type!r}: "
                         "use model_impl auto or transformers")
    register_attention()
    attention = {name: ATTENTION_NAME if name == "text_config" else "sdpa" for name in config.sub_configs}
    attention[""] = "sdpa"
    try:
        hf_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    except ValueError as err:
        raise ValueError(f"transformers cannot build the vision-language model {config.model_type!r}: {err}") from None
    return LoadedModel(None, {}, path, None, eos, hf_model.eval(), vision=True)


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors or pytorch_model*.bin weights")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


def _load_gguf(path: Path, model_impl: str) -> LoadedModel:
    from transformers import AutoTokenizer

    from cllm.backends.torch.gguf_fixes import apply_rope_freqs, rope_freq_factors
    from cllm.backends.torch.gguf_metadata import read_gguf_metadata
    from cllm.backends.torch.hf_model import ATTENTION_NAME, register_attention
    from cllm.backends.torch.model_impl import choose_impl

    meta = read_gguf_metadata(path)
    with _one_gguf_parse(path):
        # transformers dequantizes every tensor and undoes llama.cpp's Q/K permutation; gguf_fixes puts back
        # what its config reading drops.
        hf_model = _gguf_transformers_model(path, meta)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    eos = _as_ids(hf_model.config.eos_token_id) + _as_ids(getattr(hf_model.generation_config, "eos_token_id", None))
    factors = rope_freq_factors(meta)  # transformers drops this tensor: without it rope is wrong
    if choose_impl(model_impl, hf_model.config) == "transformers":
        if factors is not None:
            apply_rope_freqs(hf_model, factors)
        register_attention()
        hf_model.set_attn_implementation(ATTENTION_NAME)
        return LoadedModel(None, {}, path.parent, path.name, eos, hf_model.eval(), hf_tokenizer=tokenizer)
    spec = spec_from_config(hf_model.config)
    if factors is not None:
        spec = dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, freq_factors=factors))
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return LoadedModel(spec, state, path.parent, path.name, eos, hf_tokenizer=tokenizer)


_GGUF_READER_LOCK = threading.Lock()


@contextmanager
def _one_gguf_parse(path: Path) -> Iterator[None]:
    """transformers parses a GGUF file's whole header (``gguf.GGUFReader``: ~3 s for a 49k-token vocabulary,
    three times that for a 150k one) for its config, again for its weights and again for its tokenizer;
    within this block they share one reader of ``path``. ``gguf.GGUFReader``, which transformers imports
    where it reads, is a caching factory while the block runs (one GGUF load at a time, under a lock) and
    is put back after; a reader of another file or for writing is made as before."""
    import gguf

    target, original = os.path.realpath(path), gguf.GGUFReader
    readers: dict[str, Any] = {}

    def shared(file: Any, mode: str = "r") -> Any:
        if mode != "r" or os.path.realpath(file) != target:
            return original(file, mode)
        if target not in readers:
            readers[target] = original(file, mode)
        return readers[target]

    with _GGUF_READER_LOCK:
        gguf.GGUFReader = shared
        try:
            yield
        finally:
            gguf.GGUFReader = original


def _gguf_transformers_model(path: Path, meta: GGUFMetadata) -> Any:
    """transformers' model of a GGUF file (float32), its config completed from the file (gguf_fixes);
    ValueError, with the llama.cpp route, where transformers' GGUF reader cannot read the file or
    leaves weights of its model unread."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cllm.backends.torch.gguf_fixes import complete_config

    arch = meta.architecture
    route = ("serve the file with the llama_cpp backend (`--backend llama_cpp`), or the torch backend from the "
             "model's Hugging Face directory")
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # transformers' reader raises ValueError, TypeError, KeyError ... on what it cannot read
        raise ValueError(f"transformers' GGUF reader cannot read {path.name} (GGUF architecture {arch!r}): "
                         f"{type(err).__name__}: {err}; {route}") from err
    config, changes = complete_config(config, meta)
    if changes:
        log.info("%s: taken from the GGUF file where transformers' reader left defaults: %s", path.name, changes)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                           dtype=torch.float32, output_loading_info=True)
    except Exception as err:
        raise ValueError(f"transformers cannot load {path.name} (GGUF architecture {arch!r}) as a "
                         f"{config.model_type!r} model: {type(err).__name__}: {err}; {route}") from err
    unread = sorted(set(info.get("missing_keys") or ()))
    if unread:  # e.g. a Mixtral GGUF (architecture "llama" with experts) read as a dense Llama
        shown = ", ".join(unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        raise ValueError(f"transformers' GGUF reader reads {path.name} (GGUF architecture {arch!r}) as a "
                         f"{config.model_type!r} model but finds no weights in it for {shown} (left randomly "
                         f"initialised); {route}")
    return model
