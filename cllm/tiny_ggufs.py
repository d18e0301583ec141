"""The tiny GGUF test assets: cllm.tiny_models' random decoders through llama.cpp's own converter.

``TINY_GGUFS`` names each shipped file (``tests/assets/models/``) and how it is made;
``build_tiny_gguf(name, out_dir)`` rebuilds it: the seeded tiny model (``build_tiny``, SmolLM2's
tokenizer), then ``convert_hf_to_gguf.py --outtype q8_0`` from llama-cpp-python 0.3.36's sources
(``cllm.tiny_vlms.LLAMA_CPP_SOURCES``). Same seed, same converter: the same bytes.

Each keeps the file small (~5.3 MB: the 49,152-row embedding in q8_0 plus the vocabulary, so embeddings
are tied where the family allows) and builds the model so that its GGUF can say all of it:
``reads_as`` lists what a file cannot carry and how llama.cpp (and cllm's torch backend) read it
instead; ``config()`` is the transformers config of the model the file holds, the reference the tests
load the file's dequantized weights into.

Converter settings a tiny model needs and a published one does not:
- phi3: ``tokenizer_class`` GPT2Tokenizer in tokenizer_config.json (as Phi-4 ships): the converter takes
  any other Phi-3 tokenizer for a SentencePiece one and requires tokenizer.model.
- gemma2: the converter only knows Gemma 2's SentencePiece vocabulary; SmolLM2's BPE one goes through
  ``_set_vocab_gpt2``, as its Gemma 3 converter does by itself when there is no tokenizer.model.
- phi3: a model name without "phi3" / "phi-3" (Phi-4-mini's is "Phi 4 Mini Instruct"): llama.cpp gives
  such models' ``</s>`` token an attribute and fails to load a vocabulary without one
  ("error loading model vocabulary: unordered_map::at").
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cllm.tiny_models import S, build_tiny, tiny_config

WINDOW = 16  # sliding windows of the tiny models these files were built from
OUTTYPE = "q8_0"


@dataclass(frozen=True, slots=True)
class TinyGGUF:
    """One tiny GGUF asset."""

    arch: str  # cllm.tiny_models architecture
    overrides: dict[str, Any] = field(default_factory=dict)  # build_tiny overrides of the tiny config
    reads_as: dict[str, Any] = field(default_factory=dict)  # config fields the GGUF cannot carry, as read back
    tokenizer_class: str | None = None  # tokenizer_config.json's tokenizer_class for the converter
    gpt2_vocab: bool = False  # run the converter with its Gemma 2 vocabulary writer on the BPE path
    model_name: str | None = None  # --model-name (general.name); default: from the model directory's name

    def config(self) -> Any:
        """The transformers config of the model the file holds."""
        return tiny_config(self.arch, window=WINDOW, **{**self.overrides, **self.reads_as})


TINY_GGUFS: dict[str, TinyGGUF] = {
    # llama.cpp's Gemma 3 has a fixed 5:1 sliding pattern (this converter writes none: 4 layers read as all
    # sliding) and scales attention by 1/sqrt(head_dim) (no query_pre_attn_scalar in GGUF).
    "tiny-gemma3-text-q8_0.gguf": TinyGGUF("gemma3_text", reads_as=dict(layer_types=[S] * 4, query_pre_attn_scalar=16)),
    "tiny-gemma2-q8_0.gguf": TinyGGUF("gemma2", overrides=dict(query_pre_attn_scalar=16), gpt2_vocab=True),
    "tiny-qwen3-q8_0.gguf": TinyGGUF("qwen3", overrides=dict(tie_word_embeddings=True)),
    "tiny-qwen3-moe-q8_0.gguf": TinyGGUF("qwen3_moe", overrides=dict(tie_word_embeddings=True)),
    "tiny-phi3-q8_0.gguf": TinyGGUF("phi3", overrides=dict(tie_word_embeddings=True), tokenizer_class="GPT2Tokenizer",
                                    model_name="Tiny Phi-4-mini"),
}

# Runs convert_hf_to_gguf.py with Gemma 2's vocabulary written as a GPT-2 BPE one.
_GPT2_VOCAB_RUNNER = """\
import runpy, sys
sys.path.insert(0, {sources!r})
import conversion.gemma
conversion.gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name='__main__')
"""


def build_tiny_gguf(name: str, out_dir: Path, *, seed: int = 0, sources: Path | None = None) -> Path:
    """Rebuild the asset ``name`` (a key of TINY_GGUFS) as ``out_dir/name``; ``sources``: llama.cpp's sources
    (default ``cllm.tiny_vlms.LLAMA_CPP_SOURCES``)."""
    from cllm.tiny_vlms import LLAMA_CPP_SOURCES, _check_sources, _run

    if name not in TINY_GGUFS:
        raise ValueError(f"unknown tiny GGUF {name!r}; one of {', '.join(TINY_GGUFS)}")
    asset, out_dir = TINY_GGUFS[name], Path(out_dir)
    sources = Path(sources) if sources is not None else LLAMA_CPP_SOURCES
    script = _check_sources(sources)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cllm-tiny-gguf-") as tmp:
        model_dir = build_tiny(asset.arch, Path(tmp) / asset.arch, seed=seed, window=WINDOW, **asset.overrides)
        if asset.tokenizer_class:
            config_file = model_dir / "tokenizer_config.json"
            config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                               "tokenizer_class": asset.tokenizer_class}, indent=2))
        command = [str(script)]
        if asset.gpt2_vocab:
            runner = Path(tmp) / "convert.py"
            runner.write_text(_GPT2_VOCAB_RUNNER.format(sources=str(sources), script=str(script)))
            command = [str(runner)]
        if asset.model_name:
            command += ["--model-name", asset.model_name]
        out = Path(tmp) / name
        _run([sys.executable, *command[:1], str(model_dir), *command[1:], "--outtype", OUTTYPE, "--outfile", str(out)],
             sources)
        shutil.move(str(out), str(out_dir / name))
    return out_dir / name


def main() -> None:
    """``python -m cllm.tiny_ggufs OUT_DIR [NAME ...]``: rebuild the assets (all by default)."""
    out_dir, names = Path(sys.argv[1]), sys.argv[2:] or list(TINY_GGUFS)
    for name in names:
        path = build_tiny_gguf(name, out_dir)
        print(f"{path} {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()


__all__ = ["OUTTYPE", "TINY_GGUFS", "TinyGGUF", "WINDOW", "build_tiny_gguf"]
