"""llama.cpp GPU settings on the real embedded model: offload detection, KV cache types, offload_kqv.

This machine's llama-cpp-python is a CPU build (llama_supports_gpu_offload() is False); the
detection is tested by substituting the probe, and the resolved value is checked where it
enters llama.cpp (the params handed to llama_model_load_from_file / llama_init_from_model).
"""
from __future__ import annotations

import llama_cpp as C
import numpy as np
import pytest

import cllm
from cllm.backends.llama_cpp import native, offload
from cllm.backends.llama_cpp.backend import LlamaCppBackend
from cllm.backends.llama_cpp.offload import ALL_LAYERS, KV_CACHE_TYPES, resolve_gpu_layers
from cllm.config import load_config

PROMPT = "The capital of France is"


def test_gpu_layers_default_follows_the_builds_offload_support(monkeypatch):
    assert resolve_gpu_layers(None, lambda: True) == ALL_LAYERS
    assert resolve_gpu_layers(None, lambda: False) == 0
    assert resolve_gpu_layers(-1, lambda: False) == ALL_LAYERS
    assert resolve_gpu_layers(7, lambda: True) == 7
    # the default probe is llama.cpp's own
    monkeypatch.setattr(offload.C, "llama_supports_gpu_offload", lambda: True)
    assert resolve_gpu_layers(None) == ALL_LAYERS
    monkeypatch.setattr(offload.C, "llama_supports_gpu_offload", lambda: False)
    assert resolve_gpu_layers(None) == 0


def test_this_build_is_detected_as_it_is():
    assert offload.gpu_offload_supported() is bool(C.llama_supports_gpu_offload())


class Spy:
    """Records the params llama.cpp receives, then calls through."""

    def __init__(self, real):
        self.real, self.params = real, []

    def __call__(self, first, params):
        self.params.append(params)
        return self.real(first, params)


@pytest.mark.parametrize("supported, setting, expected", [(True, None, ALL_LAYERS), (False, None, 0), (False, 5, 5)])
def test_resolved_layers_and_context_settings_reach_llama_cpp(monkeypatch, supported, setting, expected):
    load, init = Spy(C.llama_model_load_from_file), Spy(C.llama_init_from_model)
    monkeypatch.setattr(native.C, "llama_model_load_from_file", load)
    monkeypatch.setattr(native.C, "llama_init_from_model", init)
    monkeypatch.setattr(offload.C, "llama_supports_gpu_offload", lambda: supported)
    cfg = load_config(environ={}, n_threads=1, n_ctx=512, n_seq_max=2, n_gpu_layers=setting, type_k="q8_0",
                      type_v="q8_0", flash_attn=True, offload_kqv=False)
    backend = LlamaCppBackend(cfg)
    try:
        assert backend.n_gpu_layers == expected
        assert load.params[-1].n_gpu_layers == expected
        ctx = init.params[-1]
        assert (ctx.type_k, ctx.type_v, ctx.offload_kqv) == (KV_CACHE_TYPES["q8_0"], KV_CACHE_TYPES["q8_0"], False)
        assert ctx.flash_attn_type == C.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # a CPU build ignores the offload request and still runs the model
        ids = backend.tokenizer.encode(PROMPT)
        assert backend.admit("s", ids) is not None
        logits = backend.forward_batch(ids, list(range(len(ids))), ["s"] * len(ids))
        assert logits.shape == (1, backend.tokenizer.vocab_size) and np.isfinite(logits).all()
    finally:
        backend.close()


def test_defaults_keep_an_f16_kv_cache_and_kqv_offload():
    cfg = load_config(environ={})
    lc = cfg.llama_cpp
    assert (lc.n_gpu_layers, lc.type_k, lc.type_v, lc.offload_kqv) == (None, "f16", "f16", True)
    assert native.model_params(n_gpu_layers=3).n_gpu_layers == 3


@pytest.mark.parametrize("kwargs, text", [
    ({"type_k": "q3_k"}, "type_k"), ({"type_v": "int8", "flash_attn": True}, "type_v"),
    ({"type_v": "q8_0", "flash_attn": False}, r"type_v='q8_0'.*flash_attn"), ({"flash_attn": "sometimes"}, "flash_attn"),
    ({"n_gpu_layers": -2}, "n_gpu_layers"),
])
def test_bad_settings_name_the_value(kwargs, text):
    with pytest.raises(ValueError, match=text):
        load_config(None, environ={}, **kwargs)


def test_q8_0_kv_cache_runs_on_cpu_and_agrees_with_f16():
    """A q8_0 K and V cache (flash attention) on CPU: coherent text, logprobs near the f16 cache's."""
    params = cllm.SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    outs = {}
    for name, kw in {"f16": {}, "q8_0": dict(type_k="q8_0", type_v="q8_0", flash_attn=True),
                     "q8_0_k_only": dict(type_k="q8_0")}.items():
        with cllm.LLM(n_threads=1, n_seq_max=2, n_ctx=512, **kw) as llm:
            outs[name] = llm.generate([PROMPT], params)[0].outputs[0]
    assert "Paris" in outs["q8_0"].text and "Paris" in outs["q8_0_k_only"].text
    ref = outs["f16"]
    for name in ("q8_0", "q8_0_k_only"):
        got = outs[name]
        # 8-bit KV rounding moves logprobs by a few hundredths here; greedy tokens agree until a near-tie
        n = 0
        while n < len(ref.token_ids) and got.token_ids[n] == ref.token_ids[n]:
            n += 1
        assert n >= 4, (name, got.text, ref.text)
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(got.logprobs[:n], ref.logprobs[:n])]
        assert max(diffs) < 0.25, (name, diffs)
