"""gpt-oss with MXFP4 experts (as openai/gpt-oss-* are published) on the torch backend (issue 40, item 4).

The tiny gpt-oss of cllm.tiny_models with its expert weights quantized by ``mxfp4_quantize`` and saved
under the hub's names (``*_blocks`` / ``*_scales``, ``quantization_config.quant_method: mxfp4``).
Asserted: our quantizer's bytes decode to the same weights through transformers' dequantizer as through
ours; the backend's loaded experts are exactly our dequantization, in the dtype asked for; and the model
serves as every architecture of the matrix does (test_torch_architectures: every logits row within 1e-4
of transformers' forward of the same checkpoint, dequantized, float32; 16 greedy tokens equal to its
``generate``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from cllm.backends.torch.backend import TorchBackend
from cllm.config import load_config
from cllm.tiny_models import (MXFP4_BLOCK, build_model, build_tiny_mxfp4, mxfp4_dequantize, mxfp4_quantize,
                              mxfp4_reference)
from tests.integration.test_torch_architectures import WINDOW, check_against_transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"), seed=0, window=WINDOW)


def _experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()
            if name.rpartition(".")[2] in ("gate_up_proj", "down_proj")}


def test_the_checkpoint_is_laid_out_as_the_hub_s(checkpoint: Path) -> None:
    state = load_file(str(checkpoint / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.gate_up_proj"
    blocks, scales = state[f"{prefix}_blocks"], state[f"{prefix}_scales"]
    # [experts, out (2 x intermediate), in / 32, 16 bytes] and [experts, out, in / 32], as gpt-oss-20b's.
    assert blocks.dtype == scales.dtype == torch.uint8
    assert tuple(blocks.shape) == (4, 64, 64 // MXFP4_BLOCK, 16) and tuple(scales.shape) == (4, 64, 2)
    assert prefix not in state and f"{prefix}_bias" in state


def test_our_mxfp4_decodes_the_same_through_transformers(checkpoint: Path) -> None:
    """Our blocks through transformers' dequantizer equal our own dequantization exactly, and that is
    the float weight within each block's rounding step."""
    state = load_file(str(checkpoint / "model.safetensors"))
    reference = mxfp4_reference(checkpoint)
    assert len(reference) == 2 * 4  # gate_up_proj and down_proj of 4 layers
    for name, weight in reference.items():
        theirs = convert_moe_packed_tensors(state[f"{name}_blocks"], state[f"{name}_scales"], dtype=torch.float32)
        assert theirs.dtype == weight.dtype == torch.float32
        assert torch.equal(theirs, weight), name
    original = build_model("gpt_oss", seed=0, window=WINDOW).state_dict()
    for name, weight in reference.items():
        blocks, scales = mxfp4_quantize(original[name])
        assert torch.equal(mxfp4_dequantize(blocks, scales), weight)
        # The step between E2M1 values is at most 2 (4 -> 6) times the block's scale: error <= 1 x scale.
        scale = torch.exp2(scales.float() - 127).repeat_interleave(MXFP4_BLOCK, dim=-1).transpose(1, 2)
        assert bool(((original[name] - weight).abs() <= scale).all()), name
        assert float((original[name] - weight).abs().max()) > 0  # the weights really went through FP4


def test_mxfp4_round_trip_of_exact_values() -> None:
    """Values already on the E2M1 grid times a power of two survive exactly, signs and zeros included."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0] * 2)
    weight = torch.stack([grid * 2.0 ** -5, grid * 2.0 ** 3, torch.zeros(32)], dim=1)[None]  # [1, 32 in, 3 out]
    blocks, scales = mxfp4_quantize(weight)
    assert scales[0].tolist() == [[127 - 5], [127 + 3], [0]]
    assert torch.equal(mxfp4_dequantize(blocks, scales), weight)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.zeros(1, 48, 4))


def test_serves_like_transformers_with_the_experts_it_encodes(checkpoint: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     quantization_config=Mxfp4Config(dequantize=True)).eval()
    expected = mxfp4_reference(checkpoint)
    assert all(torch.equal(w, expected[n]) for n, w in _experts(reference).items())
    backend = check_against_transformers("gpt_oss", "auto", checkpoint, reference)
    assert backend.model_impl == "transformers"
    loaded = _experts(backend.model.hf)
    assert sorted(loaded) == sorted(expected)
    for name, weight in loaded.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, expected[name]), name


def test_bfloat16_loads_the_experts_exactly(checkpoint: Path) -> None:
    backend = TorchBackend(load_config(environ={}, backend="torch", model=str(checkpoint), dtype="bfloat16",
                                       device="cpu", n_ctx=64, n_seq_max=2, n_threads=2))
    expected = mxfp4_reference(checkpoint)
    for name, weight in _experts(backend.model.hf).items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight.float(), expected[name]), name


def test_native_is_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"model_impl=native .*quantized \(quant_method mxfp4\)"):
        TorchBackend(load_config(environ={}, backend="torch", model=str(checkpoint), dtype="float32", device="cpu",
                                 n_ctx=64, n_seq_max=2, n_threads=2, model_impl="native"))
