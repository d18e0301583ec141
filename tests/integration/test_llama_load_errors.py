"""Issue 46 §6: a file llama.cpp cannot load is refused with llama.cpp's own reason; a Hugging Face
directory is told how to convert it; `cllm serve` says the reason in a line and exits non-zero."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cllm.backends.llama_cpp.backend import LlamaCppBackend
from cllm.backends.llama_cpp.native import LlamaModelHandle
from cllm.config import load_config

VOCAB = Path(__file__).resolve().parent.parent / "assets" / "vocab" / "ggml-vocab-phi-3.gguf"


def _rewrite(dst: Path, *, arch: str | None = None, tensor: tuple[str, tuple[int, ...]] | None = None) -> Path:
    """A copy of the Phi-3 vocabulary GGUF with another architecture name or one extra tensor."""
    reader = gguf.GGUFReader(VOCAB)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    if tensor is not None:
        writer.add_tensor(tensor[0], np.zeros(tensor[1], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _load_error(path: Path) -> str:
    with pytest.raises(ValueError) as caught:
        LlamaModelHandle(path=path)
    return str(caught.value)


def test_unknown_architecture_is_named(tmp_path):
    message = _load_error(_rewrite(tmp_path / "m.gguf", arch="nosucharch"))
    assert "unknown model architecture: 'nosucharch'" in message and "not a valid GGUF" not in message


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    message = _load_error(_rewrite(tmp_path / "m.gguf", tensor=("token_embd.weight", (3, 5))))
    assert "token_embd.weight" in message and "wrong shape" in message


def test_a_truncated_file_says_what_llama_cpp_could_not_read(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(VOCAB.read_bytes()[:100_000])
    message = _load_error(path)
    assert "gguf_init_from_reader" in message and "failed to read" in message


def test_a_hugging_face_directory_is_told_how_to_convert_or_use_torch(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError) as caught:
        LlamaCppBackend(load_config(None, model=str(tmp_path)))
    assert "convert_hf_to_gguf.py" in str(caught.value) and 'backend="torch"' in str(caught.value)


def test_serve_says_why_in_a_line_and_exits_non_zero(tmp_path):
    path = _rewrite(tmp_path / "m.gguf", arch="nosucharch")
    run = subprocess.run([sys.executable, "-m", "cllm.cli", "serve", "--model", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "unknown model architecture: 'nosucharch'" in run.stderr
    assert "Traceback" not in run.stderr
