"""``flash_attn: auto`` on a CPU: this machine's measurement decides, once, and llama.cpp gets the verdict.

The probe itself runs the real model (both settings, timed); its choice depends on the CPU, so the
tests assert the rule (on unless slower by more than MARGIN), the cache (measured once per key) and
that the backend hands llama.cpp exactly the verdict, never which verdict this machine gets.
"""
from __future__ import annotations

import json
from pathlib import Path

import llama_cpp as C
import numpy as np
import pytest

from cllm.backends.llama_cpp import flash_attn as fa
from cllm.backends.llama_cpp import native
from cllm.backends.llama_cpp.backend import LlamaCppBackend
from cllm.backends.llama_cpp.native import LlamaModelHandle
from cllm.config import load_config
from cllm.model_path import resolve_model_path
from tests.integration.test_llama_cpp_gpu_settings import Spy


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CLLM_CACHE_DIR", str(tmp_path))
    return tmp_path / "flash_attn.json"


@pytest.fixture(scope="module")
def model() -> LlamaModelHandle:
    handle = LlamaModelHandle(path=resolve_model_path(None))
    yield handle
    handle.close()


def test_the_probe_times_both_settings_on_the_real_model(model: LlamaModelHandle) -> None:
    on_ms, off_ms = fa.measure(model, n_threads=1)
    assert 0 < on_ms < 10_000 and 0 < off_ms < 10_000


@pytest.mark.parametrize("on_ms, off_ms, verdict", [(50.0, 100.0, True), (100.0, 50.0, False),
                                                     (104.0, 100.0, True), (106.0, 100.0, False)])
def test_auto_keeps_flash_attention_unless_it_is_slower_by_more_than_the_margin(
        cache: Path, model: LlamaModelHandle, monkeypatch: pytest.MonkeyPatch, on_ms, off_ms, verdict) -> None:
    calls = []
    monkeypatch.setattr(fa, "measure", lambda m, n: calls.append(n) or (on_ms, off_ms))
    kw = dict(model=model, model_path=resolve_model_path(None), gpu_layers=0, type_v="f16")
    assert fa.resolve_flash_attn("auto", n_threads=1, **kw) is verdict
    assert fa.resolve_flash_attn("auto", n_threads=1, **kw) is verdict  # from the cache: measured once
    assert calls == [1]
    fa.resolve_flash_attn("auto", n_threads=2, **kw)  # another thread count is another measurement
    assert calls == [1, 2]
    (entry,) = [v for k, v in json.loads(cache.read_text()).items() if k.endswith("|1")]
    assert entry == {"flash_attn": verdict, "on_ms": on_ms, "off_ms": off_ms}


def test_explicit_settings_gpus_and_quantised_v_are_never_probed(cache: Path, model: LlamaModelHandle,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa, "measure", lambda m, n: pytest.fail("probed"))
    kw = dict(model=model, model_path=resolve_model_path(None), n_threads=1)
    assert fa.resolve_flash_attn(True, gpu_layers=0, type_v="f16", **kw) is True
    assert fa.resolve_flash_attn(False, gpu_layers=0, type_v="f16", **kw) is False
    assert fa.resolve_flash_attn("auto", gpu_layers=-1, type_v="f16", **kw) == "auto"  # llama.cpp's own choice
    assert fa.resolve_flash_attn("auto", gpu_layers=0, type_v="q8_0", **kw) == "auto"  # needs flash attention
    assert not cache.exists()


@pytest.mark.parametrize("verdict, expected", [(True, C.LLAMA_FLASH_ATTN_TYPE_ENABLED),
                                               (False, C.LLAMA_FLASH_ATTN_TYPE_DISABLED)])
def test_the_backend_runs_llama_cpp_with_the_verdict(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                     verdict: bool, expected: int) -> None:
    monkeypatch.setattr(fa, "measure", lambda m, n: (1.0, 2.0) if verdict else (2.0, 1.0))
    init = Spy(C.llama_init_from_model)
    monkeypatch.setattr(native.C, "llama_init_from_model", init)
    backend = LlamaCppBackend(load_config(environ={}, n_threads=1, n_ctx=512, n_seq_max=2))
    try:
        assert backend.flash_attn is verdict
        assert init.params[-1].flash_attn_type == expected
        ids = backend.tokenizer.encode("The capital of France is")
        assert backend.admit("s", ids) is not None
        logits = backend.forward_batch(ids, list(range(len(ids))), ["s"] * len(ids))
        assert np.isfinite(logits).all()
    finally:
        backend.close()


def test_a_failed_probe_leaves_llama_cpp_its_own_auto_and_keeps_nothing(cache: Path, model: LlamaModelHandle,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("llama.cpp could not create a context")

    monkeypatch.setattr(fa, "LlamaContextHandle", broken)
    kw = dict(model=model, model_path=resolve_model_path(None), gpu_layers=0, type_v="f16", n_threads=1)
    assert fa.resolve_flash_attn("auto", **kw) == "auto"
    assert not cache.exists()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"KEY": {"flash_attn": "yes"}}', '{"KEY": 3}'])
def test_a_damaged_verdict_file_means_a_new_measurement(cache: Path, model: LlamaModelHandle,
                                                        monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    monkeypatch.setattr(fa, "measure", lambda m, n: (100.0, 50.0))
    kw = dict(model=model, model_path=resolve_model_path(None), gpu_layers=0, type_v="f16", n_threads=1)
    fa.resolve_flash_attn("auto", **kw)
    (key,) = json.loads(cache.read_text())  # the real key, then a damaged entry or file in its place
    cache.write_text(content.replace("KEY", key.replace("\\", "\\\\").replace('"', '\\"')))
    assert fa.resolve_flash_attn("auto", **kw) is False
    assert json.loads(cache.read_text())[key]["flash_attn"] is False
