"""The tiny model zoo (cllm/tiny_models.py): every architecture builds, saves everything it computes with,
reloads through AutoModelForCausalLM to the same logits, generates past its sliding window, and has its
family's features really switched on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from cllm import tiny_models as tm  # noqa: E402

S, F = tm.S, tm.F
WINDOW = 16
PROMPT = 40  # > WINDOW: generation runs past the window
NEW_TOKENS = 16
ATOL = 1e-4

MODEL_TYPE = {arch: arch for arch in tm.TINY_ARCHS} | {"mistral_window": "mistral"}
# arch -> the layer types it must have (None: no per-layer types; the window, if any, is on every layer)
LAYER_TYPES = {"gemma2": [S, F, S, F], "gemma3_text": [S, S, S, F], "gemma4_text": [S, F, S, F], "gpt_oss": [S, F, S, F]}
WINDOWED = set(LAYER_TYPES) | {"mistral_window"}
EXPERTS = {"qwen3_moe": 8, "mixtral": 4, "gpt_oss": 4, "deepseek_v3": 8, "gemma4_text": 4}


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _experts_used(model, ids: list[int]) -> dict[str, set[int]]:
    """Experts module name -> the expert ids its router picked for any token of ``ids``."""
    used: dict[str, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            def hook(_module, args, _name=name):
                used.setdefault(_name, set()).update(args[1].reshape(-1).tolist())
            hooks.append(module.register_forward_pre_hook(hook))
    try:
        _logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return used


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread; two threads on a busy 2-core machine spin-wait and
    run 30-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return tm.sanity_ids(PROMPT)


@pytest.mark.parametrize("arch", tm.TINY_ARCHS)
def test_tiny_model(arch: str, tmp_path: Path, prompt: list[int]) -> None:
    path = tm.build_tiny(arch, tmp_path / arch, window=WINDOW)

    # The directory: safetensors weights, config with the family's model_type, SmolLM2's tokenizer.
    assert (path / "model.safetensors").is_file() and not list(path.glob("*.bin"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[arch]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == config["vocab_size"] == tm.VOCAB_SIZE
    assert tokenizer.decode(prompt)  # every id decodes

    # Reload: nothing missing, unexpected or resized, and the same logits as the model build_tiny saved
    # (rebuilt from the same seed: the builder is deterministic).
    reloaded, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    reloaded.eval()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    built = tm.build_model(arch, window=WINDOW)
    built_state, reloaded_state = built.state_dict(), reloaded.state_dict()
    assert built_state.keys() == reloaded_state.keys()
    for key, value in built_state.items():
        assert torch.equal(value, reloaded_state[key]), key
    logits = _logits(built, prompt)
    assert torch.equal(logits, _logits(reloaded, prompt))
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) > PROMPT // 4

    # Vectors are off their neutral values: no norm weight / bias / scale / sink is constant.
    for name, param in reloaded.named_parameters():
        if param.dim() == 1 and param.numel() > 1:
            assert param.std() > 0.05, name

    # Greedy generation past the window, with the cache; each step's logits match a full forward.
    out = reloaded.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                            do_sample=False, return_dict_in_generate=True, output_logits=True)
    seq = out.sequences[0].tolist()
    assert len(seq) == PROMPT + NEW_TOKENS
    full = _logits(reloaded, seq[:-1])[PROMPT - 1:]
    stepwise = torch.stack([step[0] for step in out.logits])
    torch.testing.assert_close(stepwise, full, atol=ATOL, rtol=0)

    _check_features(arch, reloaded, prompt)


def _check_features(arch: str, model, prompt: list[int]) -> None:
    config = model.config

    if arch in LAYER_TYPES:
        assert config.layer_types == LAYER_TYPES[arch]
    if arch in WINDOWED:
        assert config.sliding_window == WINDOW
        # The window bites: the same weights with a window longer than the prompt agree on the first
        # WINDOW positions and nowhere after.
        wide = tm.build_model(arch, window=4096)
        diff = (_logits(model, prompt) - _logits(wide, prompt)).abs().amax(-1)
        assert diff[:WINDOW].max() < ATOL and diff[WINDOW:].min() > 1e-3, diff
    elif arch in ("mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe"):
        assert getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)

    if arch in EXPERTS:
        used = _experts_used(model, prompt)
        moe_layers = {"deepseek_v3": config.num_hidden_layers - 1}.get(arch, config.num_hidden_layers)
        assert len(used) == moe_layers, used
        for name, experts in used.items():
            assert len(experts) > 1 and experts <= set(range(EXPERTS[arch])), (name, experts)

    if arch == "gemma2":
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
        assert config.query_pre_attn_scalar != config.head_dim
    if arch == "gemma3_text":
        assert config.query_pre_attn_scalar != config.head_dim
        assert config.rope_parameters[F]["rope_theta"] != config.rope_parameters[S]["rope_theta"]
    if arch == "gemma4_text":
        assert config.final_logit_softcapping == 30.0
        layers = model.model.layers
        assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True, True]
        assert all(not hasattr(layer.self_attn, "k_proj") for layer in layers[2:])
        assert layers[1].self_attn.v_proj is None and layers[0].self_attn.v_proj is not None  # k_eq_v on full
        assert [layer.self_attn.head_dim for layer in layers] == [16, 32, 16, 32]
        assert layers[2].mlp.intermediate_size == 2 * layers[0].mlp.intermediate_size  # double-wide
        assert model.model.embed_tokens_per_layer.weight.shape == (tm.VOCAB_SIZE, 4 * 8)  # PLE
        assert config.rope_parameters[F]["rope_type"] == "proportional"
        scalars = torch.cat([layer.layer_scalar for layer in layers])
        assert (scalars != 1).all()
    if arch == "gpt_oss":
        sinks = torch.stack([layer.self_attn.sinks for layer in model.model.layers])
        assert (sinks != 0).all() and sinks.std() > 0.5
        assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 32.0
        assert model.model.layers[0].mlp.experts.gate_up_proj_bias.std() > 0.1
    if arch == "deepseek_v3":
        layers = model.model.layers
        assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "shared_experts")
        attn = layers[0].self_attn
        assert attn.q_a_proj is not None and attn.kv_a_proj_with_mqa.out_features == 16 + 8
        assert config.rope_parameters["rope_type"] == "yarn" and config.rope_interleave
        assert (layers[1].mlp.gate.e_score_correction_bias != 0).all()
    if arch == "phi3":
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")
        assert config.rope_parameters["partial_rotary_factor"] == 0.75
        assert config.rope_parameters["rope_type"] == "longrope"
    if arch == "olmo2":
        layer = model.model.layers[0]
        assert hasattr(layer, "post_feedforward_layernorm") and not hasattr(layer, "input_layernorm")
        assert layer.self_attn.q_norm.weight.shape == (config.hidden_size,)  # over all heads at once
    if arch == "granite":
        assert all(getattr(config, k) != 1.0 for k in
                   ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"))


def test_tiny_config_overrides() -> None:
    """Benchmarks build bigger shapes of a family: the per-layer lists follow the layer count."""
    config = tm.tiny_config("gemma4_text", hidden_size=256, num_hidden_layers=6, num_experts=8)
    assert (config.hidden_size, config.num_experts) == (256, 8)
    assert config.layer_types == [S, F, S, F, S, F] and config.num_kv_shared_layers == 3
    assert tm.tiny_config("gpt_oss", window=128).sliding_window == 128
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        tm.tiny_config("gpt2")
