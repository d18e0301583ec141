"""llama_cpp.weights on the real model: which file llama.cpp runs, what a converted copy guarantees.

Guaranteed (and asserted): a converted copy holds every tensor of the file, each weight within the
target type's rounding of the file's own value (Q8_0: its block's max * (1/254 + 2**-11); F16: |w| *
2**-11 + 2**-25), with the same vocabulary and chat template; it is written once and reused. Not
guaranteed: the same greedy tokens as the file (measured over 300 tokens of README text: top-1 agreement
94.7 %, mean KL 0.0073 nats; asserted with room: >= 85 %, < 0.03).
"""
from __future__ import annotations

import logging
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

import cllm
from cllm.backends.llama_cpp.weights import cpu_has_avx2, prepare_weights
from cllm.model_path import resolve_model_path

GREEDY = cllm.SamplingParams(max_tokens=16, temperature=0)
README = Path(__file__).resolve().parents[2] / "README.md"


def dequantized(path: Path) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
            for t in gguf.GGUFReader(str(path)).tensors}


def teacher_forced(path: Path, ids: list[int]) -> np.ndarray:
    """Log-softmax of every position's logits, one batch, from llama-cpp-python's own Llama."""
    model = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, logits_all=True, n_threads=1,
                            flash_attn=True, verbose=False)
    try:
        model.eval(ids)
        logits = np.array(model.scores[: len(ids)], dtype=np.float64)
    finally:
        model.close()
    z = logits - logits.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.fixture()
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path))
    return tmp_path / "weights"


@pytest.mark.parametrize("target", ["q8_0", "f16"])
def test_a_converted_copy_holds_the_files_weights_within_the_targets_rounding(cache_home: Path, target: str) -> None:
    source = resolve_model_path(None)
    out = prepare_weights(source, target, gpu_layers=0, n_threads=2)
    assert out.parent == cache_home and out.is_file() and out != source
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == {"F32", target.upper()}
    original, copy = dequantized(source), dequantized(out)
    assert original.keys() == copy.keys()
    for name, w in original.items():
        if target == "q8_0":
            blocks = w.reshape(-1, 32)
            bound = np.abs(blocks).max(axis=1, keepdims=True) * (1 / 254 + 2**-11)
            assert (np.abs(copy[name].reshape(-1, 32) - blocks) <= bound + 1e-12).all(), name
        else:
            assert (np.abs(copy[name] - w) <= np.abs(w) * 2**-11 + 2**-25).all(), name
    # written once: the second call finds the copy and leaves it alone
    stamp = out.stat().st_mtime_ns
    assert prepare_weights(source, target, gpu_layers=0, n_threads=2) == out and out.stat().st_mtime_ns == stamp


def test_the_q8_0_copy_tracks_the_files_predictions(cache_home: Path) -> None:
    source = resolve_model_path(None)
    out = prepare_weights(source, "q8_0", gpu_layers=0, n_threads=2)
    tokenizer = llama_cpp.Llama(model_path=str(source), vocab_only=True, verbose=False)
    ids = tokenizer.tokenize(README.read_text()[:1500].encode())[:300]
    assert len(ids) == 300
    a, b = teacher_forced(source, ids), teacher_forced(out, ids)
    agreement = (a.argmax(axis=1) == b.argmax(axis=1)).mean()
    kl = (np.exp(a) * (a - b)).sum(axis=1).mean()
    assert agreement >= 0.85 and 0 < kl < 0.03, (agreement, kl)


def test_engine_runs_the_copy_auto_picks_and_names_the_model_after_the_file() -> None:
    source = resolve_model_path(None)
    with cllm.LLM(n_threads=1, n_seq_max=2) as llm:
        backend = llm.engine.backend
        assert backend.model_path == source
        # the embedded model is Q4_1 and small, and CI runs no GPU layers: auto converts exactly on AVX2
        assert (backend.weights_path != source) == cpu_has_avx2()
        chat_copy = llm.chat([{"role": "user", "content": "Say hi"}], GREEDY)[0]
    with cllm.LLM(n_threads=1, n_seq_max=2, weights="file") as llm:
        assert llm.engine.backend.weights_path == source
        chat_file = llm.chat([{"role": "user", "content": "Say hi"}], GREEDY)[0]
    # the same chat template and vocabulary either way: the same prompt tokens
    assert chat_copy.prompt_token_ids == chat_file.prompt_token_ids


def test_an_impossible_copy_is_an_error_when_asked_for_and_the_file_under_auto(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("CLLM_CACHE_DIR", str(blocker))  # the cache directory cannot be made
    source = resolve_model_path(None)
    with pytest.raises(ValueError, match="llama_cpp.weights='q8_0': could not convert"):
        prepare_weights(source, "q8_0", gpu_layers=0, n_threads=1)
    if cpu_has_avx2():  # where auto would convert, it runs the file and says why
        with caplog.at_level(logging.WARNING, logger="cllm.llama_cpp"):
            assert prepare_weights(source, "auto", gpu_layers=0, n_threads=1) == source
        assert "keeping SmolLM2-135M-Instruct.Q4_1.gguf as it is" in caplog.text
