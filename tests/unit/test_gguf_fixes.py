"""GGUF files on the torch backend: our header reader (gguf_metadata) against gguf-py's, the values
transformers' GGUF reader drops put back (gguf_fixes), and files transformers cannot read refused
(loader). The files are written here with gguf-py, a few KB each."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from transformers import AutoConfig

from cllm.backends.torch.gguf_fixes import complete_config
from cllm.backends.torch.gguf_metadata import ArrayLength, GGUFMetadata, read_gguf_metadata
from cllm.backends.torch.loader import load_model


def _meta(arch: str, **fields: object) -> GGUFMetadata:
    return GGUFMetadata(Path(f"{arch}.gguf"), {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in fields.items()}})


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_reader_agrees_with_gguf_py(tmp_path: Path) -> None:
    path = tmp_path / "all-types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for method, value in [("uint8", 200), ("int8", -100), ("uint16", 60000), ("int16", -30000), ("uint32", 4_000_000_000),
                          ("int32", -2_000_000_000), ("float32", 0.1), ("bool", True), ("string", "héllo"),
                          ("uint64", 2**63), ("int64", -(2**62)), ("float64", 1 / 3)]:
        getattr(w, f"add_{method}")(f"t.{method}", value)
    w.add_array("t.short", [1, 2, 3])
    w.add_array("t.short_str", ["a", "bc"])
    w.add_array("t.long_str", [f"tok{i}" for i in range(3000)])  # past ARRAY_KEEP: counted, not kept
    w.add_array("t.long_f32", [0.5] * 2000)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal(7).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("c.weight", gguf.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    _finish(w)

    ours, theirs = read_gguf_metadata(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value, got = field.contents(), ours.fields[key]
        if key.startswith("t.long"):  # ARRAY_KEEP
            assert got == ArrayLength(len(value))
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-7)
        else:
            assert got == value, key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.shape, info.ggml_type, info.offset) == (tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset)
        if t.name != "c.weight":
            np.testing.assert_array_equal(ours.tensor(t.name), np.asarray(t.data, dtype=np.float32).reshape(-1))
    with pytest.raises(ValueError, match="expected F32 or F16"):
        ours.tensor("c.weight")
    assert ours.tensor("missing.weight") is None and ours.architecture == "llama"


def test_a_non_gguf_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(tmp_path / "x.gguf")


def test_plain_keys_transformers_drops() -> None:
    qwen3 = AutoConfig.for_model("qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    fixed, changes = complete_config(qwen3, _meta("qwen3", **{"attention.key_length": 24}))
    assert changes == {"head_dim": 24} and fixed.head_dim == 24 and fixed.hidden_size == 64
    moe = AutoConfig.for_model("qwen3_moe", hidden_size=64, num_attention_heads=4, moe_intermediate_size=768)
    assert complete_config(moe, _meta("qwen3moe", expert_feed_forward_length=32))[0].moe_intermediate_size == 32
    llama = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4)
    assert complete_config(llama, _meta("llama", **{"rope.freq_base": 10000.0})) == (llama, {})


@pytest.mark.parametrize(("model_type", "layers", "scalar"), [
    ("gemma2", 4, 16), ("gemma2", 46, 36), ("gemma3_text", 4, 16), ("gemma3_text", 62, 36)])
def test_gemma_attention_scale_as_llama_cpp_reads_it(model_type: str, layers: int, scalar: int) -> None:
    """1/sqrt(head_dim), except the 27B models (46 / 62 layers): 1/sqrt(hidden / heads); never the default 256."""
    config = AutoConfig.for_model(model_type, hidden_size=144, num_attention_heads=4, head_dim=16,
                                  num_hidden_layers=layers)
    arch = "gemma3" if model_type == "gemma3_text" else model_type
    fixed, _ = complete_config(config, _meta(arch, **{"attention.key_length": 16}))
    assert fixed.query_pre_attn_scalar == scalar


def test_gemma3_rope_scaling_and_local_base() -> None:
    config = AutoConfig.for_model("gemma3_text", hidden_size=64, num_attention_heads=4, head_dim=16)
    fixed, _ = complete_config(config, _meta("gemma3", **{
        "attention.key_length": 16, "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 20_000.0,
        "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert fixed.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert fixed.rope_parameters["sliding_attention"]["rope_theta"] == 20_000.0


def test_phi3_partial_rotary_and_longrope(tmp_path: Path) -> None:
    path = tmp_path / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_rope_dimension_count(12)  # of head_dim 16
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_attn_factors(1.19)
    w.add_tensor("rope_factors_short.weight", np.arange(1, 7, dtype=np.float32))
    w.add_tensor("rope_factors_long.weight", np.arange(2, 8, dtype=np.float32))
    _finish(w)
    config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, max_position_embeddings=131072)
    fixed, _ = complete_config(config, read_gguf_metadata(path))
    rope = fixed.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert rope["short_factor"] == [1, 2, 3, 4, 5, 6] and rope["long_factor"] == [2, 3, 4, 5, 6, 7]
    assert rope["original_max_position_embeddings"] == 4096 and rope["attention_factor"] == pytest.approx(1.19)


def test_linear_rope_scaling_is_carried_and_others_refused() -> None:
    llama = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4)
    fixed, _ = complete_config(llama, _meta("llama", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}))
    assert fixed.rope_parameters["rope_type"] == "linear" and fixed.rope_parameters["factor"] == 4.0
    with pytest.raises(ValueError, match="rope scaling .*'yarn'.*llama_cpp"):
        complete_config(llama, _meta("llama", **{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}))


def _write_model(path: Path, arch: str, ffn: str) -> None:
    """A 1-layer model of GGUF architecture ``arch`` (32-token vocabulary, width 32), its MLP dense
    (``ffn`` "dense") or as 2 experts (``ffn`` "experts": llama.cpp's Mixtral layout)."""
    w = gguf.GGUFWriter(str(path), arch)
    for method, value in [("context_length", 64), ("embedding_length", 32), ("block_count", 1),
                          ("feed_forward_length", 64), ("head_count", 2), ("head_count_kv", 2),
                          ("rope_dimension_count", 16), ("layer_norm_rms_eps", 1e-5), ("vocab_size", 32)]:
        getattr(w, f"add_{method}")(value)
    shapes = {"token_embd": (32, 32), "output_norm": (32,), "output": (32, 32), "blk.0.attn_norm": (32,),
              "blk.0.ffn_norm": (32,), **{f"blk.0.{n}": (32, 32) for n in ("attn_q", "attn_k", "attn_v", "attn_output")}}
    if ffn == "experts":
        w.add_expert_count(2)
        w.add_expert_used_count(1)
        shapes.update({"blk.0.ffn_gate_inp": (2, 32), "blk.0.ffn_gate_exps": (2, 64, 32),
                       "blk.0.ffn_up_exps": (2, 64, 32), "blk.0.ffn_down_exps": (2, 32, 64)})
    else:
        shapes.update({"blk.0.ffn_gate": (64, 32), "blk.0.ffn_up": (64, 32), "blk.0.ffn_down": (32, 64)})
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    _finish(w)


def test_a_mixtral_gguf_read_as_a_dense_llama_is_refused(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as architecture "llama" with expert tensors; transformers' reader builds a
    dense Llama whose MLP weights it never finds (randomly initialised): refused, not served."""
    _write_model(tmp_path / "mixtral.gguf", "llama", "experts")
    with pytest.raises(ValueError, match=r"as a 'llama' model but finds no weights in it for model\.layers\.0\.mlp.*llama_cpp"):
        load_model(tmp_path / "mixtral.gguf")


def test_a_gguf_architecture_transformers_cannot_read_is_refused_with_the_llama_cpp_route(tmp_path: Path) -> None:
    _write_model(tmp_path / "olmo2.gguf", "olmo2", "dense")
    with pytest.raises(ValueError, match=r"transformers' GGUF reader cannot read olmo2\.gguf \(GGUF architecture "
                                         r"'olmo2'\).*not supported.*--backend llama_cpp"):
        load_model(tmp_path / "olmo2.gguf")
