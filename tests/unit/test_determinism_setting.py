"""model.deterministic's setting: validation, what each backend reports, and the ready block's line."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cllm.backends.determinism import OFF, Determinism
from cllm.backends.llama_cpp.determinism import kv_type, report
from cllm.config import CllmConfig, load_config
from cllm.server.ready import ready_lines


def test_off_by_default_and_settable_flat():
    assert load_config(None, environ={}).model.deterministic is False
    assert load_config(None, environ={}, deterministic=True).model.deterministic is True


@pytest.mark.parametrize("setting,words", [({"kv_unified": True}, "kv_unified"), ({"flash_attn": False}, "flash_attn")])
def test_llama_cpp_settings_that_break_the_promise_are_refused(setting, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, environ={}, deterministic=True, **setting)
    load_config(None, environ={}, deterministic=True, backend="torch", **setting)  # (llama.cpp's settings only)


def test_llama_cpp_uses_a_bf16_cache_for_f16_and_f32_and_keeps_other_types():
    assert kv_type("f16", deterministic=True) == kv_type("f32", deterministic=True) == "bf16"
    assert kv_type("q8_0", deterministic=True) == "q8_0"
    assert kv_type("f16", deterministic=False) == "f16"


def test_reports_say_what_is_promised_and_what_is_not():
    assert report(deterministic=False, type_k="f16", type_v="f16", gpu_layers=0) is OFF
    cpu = report(deterministic=True, type_k="bf16", type_v="bf16", gpu_layers=0)
    assert cpu.promised and "KV cache bf16/bf16" in cpu.text() and cpu.text().startswith("bitwise")
    gpu = report(deterministic=True, type_k="bf16", type_v="bf16", gpu_layers=-1)
    assert not gpu.promised and "not promised: all layers on a GPU" in gpu.text()
    assert "off" in OFF.text()


def test_the_ready_block_says_it_for_an_engine_in_its_own_process():
    config = CllmConfig.model_validate({"model": {"deterministic": True}})
    engine = SimpleNamespace(determinism=Determinism(on=True, how=("flash attention on",)), device_text="llama_cpp on CPU")
    text = "\n".join(ready_lines(config, engine=engine, model="m", max_model_len=2048))
    assert "determinism: bitwise, whatever the batch (flash attention on)" in text
    plain = "\n".join(ready_lines(CllmConfig(), engine=SimpleNamespace(determinism=OFF, device_text="x"),
                                  model="m", max_model_len=2048))
    assert "determinism" not in plain
