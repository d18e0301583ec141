"""A compile failure never fails a request (issue 28): the torch backend falls back to SDPA.

On CPU the backend is put on FlexAttention (what CUDA uses) and its flex function is made to raise
the error torch.compile raised on an H200 (InductorError from a FlexAttention lowering). Requests
still finish, with exactly the tokens of a backend that ran SDPA from the start: the step that met
the failure is rerun with SDPA, and so is every later step without a graph. Any other error still
fails the step's requests, as before.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch._inductor.exc import InductorError

import cllm
from cllm.backends.torch.backend import TorchBackend
from cllm.backends.torch.compile_errors import is_compile_error
from cllm.config import load_config
from tests.integration.test_torch_parity import _llama, _randomize_non_matrix_params, _save_tiny_tokenizer

SETTINGS = dict(backend="torch", dtype="float32", device="cpu", block_size=4, n_ctx=512, n_seq_max=4, n_threads=1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]  # the second shares a prefix
GREEDY = cllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama-fallback")
    torch.manual_seed(0)
    model = _llama()
    _randomize_non_matrix_params(model)
    model.save_pretrained(path)
    _save_tiny_tokenizer(Path(path))
    return str(path)


def _backend(model: str, attention: str) -> TorchBackend:
    return TorchBackend(load_config(environ={}, model=model, attention=attention, **SETTINGS))


def _failing(*args: object, **kwargs: object) -> torch.Tensor:
    raise InductorError(RuntimeError("LoweringException: NoValidChoicesError: No choices to select"), "flex_attention")


def _generate(backend: TorchBackend) -> list[cllm.RequestOutput]:
    llm = cllm.LLM(backend=backend, config=load_config(environ={}, **SETTINGS))
    try:
        # The second call's prompts hit the prefix cache: chunks after a cached prefix (FlexAttention's
        # own prefill kernel on CUDA) run too.
        return llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()


def test_compile_errors_are_told_from_other_errors() -> None:
    assert is_compile_error(InductorError(RuntimeError("x"), "target"))
    try:
        try:
            raise InductorError(RuntimeError("x"), "target")
        except InductorError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert is_compile_error(outer)
    assert not is_compile_error(RuntimeError("CUDA out of memory"))
    assert not is_compile_error(ValueError("bad shape"))


def test_a_compile_failure_falls_back_to_sdpa_with_the_same_tokens(tiny: str, caplog: pytest.LogCaptureFixture) -> None:
    reference = _generate(_backend(tiny, "sdpa"))
    backend = _backend(tiny, "flex")
    backend._flex_fn = _failing  # every FlexAttention call now fails as a compile would
    with caplog.at_level(logging.WARNING, logger="cllm.torch"):
        outputs = _generate(backend)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(outputs)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert backend._eager_attention == "sdpa"
    warnings = [r for r in caplog.records if "failed to compile" in r.getMessage()]
    assert len(warnings) == 1  # logged once, then SDPA directly


def test_other_errors_still_fail_the_step(tiny: str) -> None:
    backend = _backend(tiny, "flex")

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("not a compiler error")
    backend._flex_fn = broken
    llm = cllm.LLM(backend=backend, config=load_config(environ={}, **SETTINGS))
    try:
        out = llm.generate([PROMPTS[0]], GREEDY)[0]
    finally:
        llm.close()
    assert out.outputs[0].finish_reason == "error" and "not a compiler error" in (out.error or "")
    assert backend._eager_attention == "flex"
