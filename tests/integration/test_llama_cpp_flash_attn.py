"""``flash_attn: auto`` on a CPU: this machine's timing of serving steps decides, once, and llama.cpp gets the verdict.

The probe itself runs the real model (both settings, every step kind, timed); its choice depends on the
CPU, so the tests assert the rule (on unless the geometric mean of the steps' ratios says slower by more
than MARGIN), the cache (measured once per key, the times kept) and that the backend hands llama.cpp
exactly the verdict, never which verdict this machine gets.
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


def test_the_probe_times_serving_steps_with_both_settings_on_the_real_model(model: LlamaModelHandle) -> None:
    shape = fa.probe_shape(model, n_ubatch=512, kv_unified=False)
    assert shape.long_context == fa.LONG_CONTEXT and shape.batch == fa.BATCH and shape.chunk == 512
    small = fa.ProbeShape(batch=3, long_context=256, chunk=64, kv_unified=False)  # (the same steps, quicker)
    steps = fa.measure(model, 1, small)
    assert set(steps) == {"decode 1 seq at 64", "decode 1 seq at 256", "decode 3 seqs at 64", "decode 3 seqs at 256",
                          f"verify {fa.VERIFY_TOKENS} tokens at 256", "prefill 64 tokens"}
    assert all(len(t) == 2 and all(0 < ms < 10_000 for ms in t) for t in steps.values())
    # more work takes longer, with either kernel (what says the steps ran as named)
    for on in (0, 1):
        assert steps["prefill 64 tokens"][on] > steps["decode 1 seq at 64"][on]


def test_the_probe_shape_keeps_its_kv_within_the_bound(model: LlamaModelHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa, "PROBE_KV_BYTES", 256 << 20)
    shape = fa.probe_shape(model, n_ubatch=2048, kv_unified=True)
    per_seq = shape.seq_cells * model.kv_bytes_per_token("f16", "f16")
    assert 2 < shape.batch == int((256 << 20) // (2 * per_seq)) < fa.BATCH
    assert shape.chunk == 512 and shape.kv_unified


def steps_of(*ratios: float) -> dict[str, list[float]]:
    return {f"step {i}": [100.0 * r, 100.0] for i, r in enumerate(ratios)}


@pytest.mark.parametrize("ratios, verdict", [((0.5,), True), ((2.0,), False), ((1.04,), True), ((1.06,), False),
                                             ((0.5, 2.0), True), ((0.7, 0.7, 1.9), True), ((0.9, 1.1, 1.3), False)])
def test_the_verdict_is_the_geometric_mean_of_the_steps_ratios_within_the_margin(ratios, verdict) -> None:
    v = fa.decide(steps_of(*ratios))
    assert v.setting is verdict and v.reason == "measured"
    assert v.ratio == pytest.approx(float(np.exp(np.mean(np.log(ratios)))), abs=1e-3)


def test_auto_measures_once_per_key_and_keeps_every_steps_times(cache: Path, model: LlamaModelHandle,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(fa, "measure", lambda m, n, shape: calls.append((n, shape)) or steps_of(1.2, 1.1))
    kw = dict(model=model, model_path=resolve_model_path(None), gpu_layers=0, type_v="f16")
    first = fa.resolve_flash_attn("auto", n_threads=1, **kw)
    assert first.setting is False and first.reason == "measured"
    again = fa.resolve_flash_attn("auto", n_threads=1, **kw)  # from the cache: measured once
    assert (again.setting, again.reason, again.ratio, again.steps) == (False, "measured before", first.ratio, first.steps)
    assert len(calls) == 1
    fa.resolve_flash_attn("auto", n_threads=2, **kw)  # another thread count is another measurement
    fa.resolve_flash_attn("auto", n_threads=1, kv_unified=True, **kw)  # and so is another KV layout
    assert [(n, s.kv_unified) for n, s in calls] == [(1, False), (2, False), (1, True)]
    kept = json.loads(cache.read_text())
    assert len(kept) == 3 and all(f"probe{fa.PROBE_VERSION}" in key for key in kept)
    assert {"flash_attn": False, "ratio": first.ratio, "steps": steps_of(1.2, 1.1)} in kept.values()
    assert "off (measured before: 1.15x the time of off over 2 serving steps)" == again.text()


def test_explicit_settings_gpus_and_quantised_v_are_never_probed(cache: Path, model: LlamaModelHandle,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa, "measure", lambda *a: pytest.fail("probed"))
    kw = dict(model=model, model_path=resolve_model_path(None), n_threads=1)
    assert fa.resolve_flash_attn(True, gpu_layers=0, type_v="f16", **kw).setting is True
    assert fa.resolve_flash_attn(False, gpu_layers=0, type_v="f16", **kw).text() == "off (setting)"
    gpu = fa.resolve_flash_attn("auto", gpu_layers=-1, type_v="f16", **kw)  # llama.cpp's own choice
    assert (gpu.setting, gpu.reason) == ("auto", "gpu")
    quantised = fa.resolve_flash_attn("auto", gpu_layers=0, type_v="q8_0", **kw)  # needs flash attention
    assert (quantised.setting, quantised.reason) == ("auto", "quantised V cache")
    assert not cache.exists()


@pytest.mark.parametrize("verdict, expected", [(True, C.LLAMA_FLASH_ATTN_TYPE_ENABLED),
                                               (False, C.LLAMA_FLASH_ATTN_TYPE_DISABLED)])
def test_the_backend_runs_llama_cpp_with_the_verdict(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                     verdict: bool, expected: int) -> None:
    monkeypatch.setattr(fa, "measure", lambda m, n, shape: steps_of(0.5 if verdict else 2.0))
    init = Spy(C.llama_init_from_model)
    monkeypatch.setattr(native.C, "llama_init_from_model", init)
    backend = LlamaCppBackend(load_config(environ={}, n_threads=1, n_ctx=512, n_seq_max=2))
    try:
        assert backend.flash_attn is verdict and backend.flash_attn_verdict.setting is verdict
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
    v = fa.resolve_flash_attn("auto", **kw)
    assert v.setting == "auto" and v.reason.startswith("probe failed: llama.cpp could not create a context")
    assert not cache.exists()


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"KEY": {"flash_attn": "yes"}}', '{"KEY": 3}',
                                     '{"KEY": {"flash_attn": true, "on_ms": 1.0, "off_ms": 2.0}}'])
def test_a_damaged_verdict_file_means_a_new_measurement(cache: Path, model: LlamaModelHandle,
                                                        monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    monkeypatch.setattr(fa, "measure", lambda m, n, shape: steps_of(2.0))
    kw = dict(model=model, model_path=resolve_model_path(None), gpu_layers=0, type_v="f16", n_threads=1)
    fa.resolve_flash_attn("auto", **kw)
    (key,) = json.loads(cache.read_text())  # the real key, then a damaged entry or file in its place
    cache.write_text(content.replace("KEY", key.replace("\\", "\\\\").replace('"', '\\"')))
    assert fa.resolve_flash_attn("auto", **kw).setting is False
    assert json.loads(cache.read_text())[key]["flash_attn"] is False
