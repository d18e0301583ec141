"""A Llama-3.x-style GGUF (llama3 rope scaling carried as a ``rope_freqs.weight`` tensor):
the torch backend's logits against llama.cpp's on the same file.

The file is written here with the ``gguf`` package: random float32 weights, untied LM head,
grouped-query attention, rope base 500000 and llama3 frequency factors computed as Meta's
conversion script does (factor 8, original context 64 so most rotary pairs are scaled at the
positions tested), plus the embedded model's tokenizer metadata. llama.cpp runs it with an f32
KV cache, so both backends compute in float32: the only differences are summation order and
the two rope implementations (ATOL below; observed 2e-5 on logits up to 13; ignoring
rope_freqs puts them 11.7 apart).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from cllm.backends.llama_cpp.backend import LlamaCppBackend
from cllm.backends.torch.backend import TorchBackend
from cllm.backends.torch.model import rope_inv_freq
from cllm.config import load_config
from cllm.model_path import resolve_model_path

ATOL = 2e-3
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
HEAD_DIM = HIDDEN // HEADS
THETA = 500000.0


def llama3_freq_factors(factor=8.0, low=1.0, high=4.0, original=64) -> np.ndarray:
    """Meta's llama3 rope scaling as the per-pair divisors convert_hf_to_gguf.py writes to rope_freqs."""
    freqs = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_llama3_gguf(path: Path) -> None:
    src = gguf.GGUFReader(str(resolve_model_path(None)))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for field in src.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)

    def rand(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, HIDDEN, scale=1.0))
    w.add_tensor("output_norm.weight", 1 + rand(HIDDEN))
    w.add_tensor("output.weight", rand(vocab, HIDDEN, scale=0.3))
    w.add_tensor("rope_freqs.weight", llama3_freq_factors())
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + rand(HIDDEN))
        w.add_tensor(p + "attn_q.weight", rand(HEADS * HEAD_DIM, HIDDEN, scale=0.3))
        w.add_tensor(p + "attn_k.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3))
        w.add_tensor(p + "attn_v.weight", rand(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.3))
        w.add_tensor(p + "attn_output.weight", rand(HIDDEN, HEADS * HEAD_DIM))
        w.add_tensor(p + "ffn_norm.weight", 1 + rand(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama3") / "tiny-llama3.gguf"
    write_llama3_gguf(path)
    return path


def run(backend, prompt: list[int], steps: int) -> np.ndarray:
    """Prefill, then greedy decode steps; the logits row of every evaluated position after the prompt."""
    assert backend.admit("s", prompt) is not None
    rows = [backend.forward_batch(prompt, list(range(len(prompt))), ["s"] * len(prompt))[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(backend.forward_batch([tokens[-1]], [len(tokens) - 1], ["s"])[0])
    backend.release("s", keep_cache=False)
    return np.stack(rows)


def llama_cpp_rows(path: Path, prompt: list[int], steps: int) -> np.ndarray:
    common = dict(model=str(path), n_threads=1, n_ctx=256, n_seq_max=1, n_batch=256)
    # f32 KV and no flash attention: llama.cpp's CPU flash-attention kernel rounds K/V/Q to f16 (3e-2 apart)
    llama = LlamaCppBackend(load_config(environ={}, **common, type_k="f32", type_v="f32", flash_attn=False))
    try:
        return run(llama, prompt, steps)
    finally:
        llama.close()


def test_torch_backend_applies_rope_freqs_and_matches_llama_cpp(llama3_gguf: Path) -> None:
    common = dict(model=str(llama3_gguf), n_threads=1, n_ctx=256, n_seq_max=1, n_batch=256)
    prompt = np.random.default_rng(1).integers(100, 40000, size=40).tolist()
    ref = llama_cpp_rows(llama3_gguf, prompt, 12)
    torch_backend = TorchBackend(load_config(environ={}, **common, backend="torch", device="cpu", dtype="float32"))
    assert torch_backend.model_impl == "native"  # a GGUF's weights are dequantized at load: not "quantized"
    rope = torch_backend.spec.rope
    assert rope.freq_factors is not None and np.allclose(rope.freq_factors, llama3_freq_factors())
    got = run(torch_backend, prompt, 12)
    assert np.abs(ref).max() > 1.0  # logits large enough for the tolerance to mean something
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    # The check is sensitive to the factors: the same weights with plain rope are far off.
    plain = dataclasses.replace(rope, freq_factors=None)
    torch_backend.model.inv_freq = rope_inv_freq(plain, HEAD_DIM)
    off = run(torch_backend, prompt, 0)
    assert np.abs(off[0] - ref[0]).max() > 20 * ATOL


def test_the_transformers_path_applies_rope_freqs_too(llama3_gguf: Path) -> None:
    """transformers' GGUF reader drops rope_freqs; the loader divides its model's rotary frequencies by them."""
    prompt = np.random.default_rng(1).integers(100, 40000, size=40).tolist()
    ref = llama_cpp_rows(llama3_gguf, prompt, 4)
    backend = TorchBackend(load_config(environ={}, model=str(llama3_gguf), n_threads=1, n_ctx=256, n_seq_max=1,
                                       backend="torch", device="cpu", dtype="float32", model_impl="transformers"))
    assert backend.model_impl == "transformers"
    np.testing.assert_allclose(run(backend, prompt, 4), ref, atol=ATOL, rtol=0)
