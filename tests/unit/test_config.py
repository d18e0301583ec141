"""Config layering and validation."""
from __future__ import annotations

from pathlib import Path

import pytest

from cllm.config import CllmConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_config_yaml_documents_every_default():
    assert load_config(ROOT / "config.yaml", environ={}) == CllmConfig()
    text = (ROOT / "config.yaml").read_text()
    for section, fields in CllmConfig().model_dump().items():
        for key in fields:
            assert f"  {key}:" in text, f"config.yaml lacks {section}.{key}"


def test_layers_file_env_kwargs(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  n_ctx: 2048\n  n_seq_max: 4\nscheduler:\n  policy: priority\n")
    cfg = load_config(f, environ={"CLLM_N_CTX": "4096", "CLLM_MAX_WAITING": "7"}, n_seq_max=2)
    assert (cfg.model.n_ctx, cfg.model.n_seq_max, cfg.scheduler.policy, cfg.scheduler.max_waiting) == (4096, 2, "priority", 7)


@pytest.mark.parametrize("kwargs, text", [
    ({"n_ctx": 10}, "n_ctx"), ({"policy": "lifo"}, "policy"), ({"bogus": 1}, "bogus"),
    ({"n_batch": 64, "max_num_batched_tokens": 128}, "max_num_batched_tokens"), ({"port": 70000}, "port"),
])
def test_invalid_values_name_the_key(kwargs, text):
    with pytest.raises(ValueError, match=text):
        load_config(None, environ={}, **kwargs)


def test_bad_env_value_is_rejected():
    with pytest.raises(ValueError, match="n_seq_max"):
        load_config(None, environ={"CLLM_N_SEQ_MAX": "many"})


def test_unknown_backend_lists_valid_names():
    from cllm.backends.registry import get_backend_factory
    with pytest.raises(KeyError, match="llama_cpp"):
        get_backend_factory("nope")


def test_missing_model_file_names_the_path(tmp_path):
    from cllm.model_path import resolve_model_path
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(str(missing))


def test_set_and_a_flag_for_the_same_setting_take_the_flag():
    # `cllm serve --set max_num_seqs=16` used to die with a TypeError (the flag's None was passed too).
    from cllm.cli import _config
    cfg = _config(None, ["max_num_seqs=16", "n_ubatch=256"], max_num_seqs=None)
    assert (cfg.scheduler.max_num_seqs, cfg.llama_cpp.n_ubatch) == (16, 256)
    assert _config(None, ["max_num_seqs=16"], max_num_seqs=8).scheduler.max_num_seqs == 8
