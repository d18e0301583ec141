"""docs/architectures.md's table, generated from the architecture test matrix (issue 40).

Runs tests/integration/test_torch_architectures.py (every tiny model of cllm.tiny_models on the torch
backend, against transformers; the tiny GGUFs of cllm.tiny_ggufs on it) and writes which path serves each
architecture and whether its case passed. Usage: ``python benchmarks/architecture_table.py [--out docs/architectures.md]``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from cllm.backends.torch.loader import SUPPORTED_ARCHITECTURES
from cllm.backends.torch.model_impl import LINEAR_ATTENTION_TYPES
from cllm.tiny_ggufs import TINY_GGUFS
from cllm.tiny_models import TINY_ARCHS

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/integration/test_torch_architectures.py"
FEATURES = {  # what the tiny model keeps of its family (cllm/tiny_models.py)
    "qwen3_moe": "MoE (8 experts, top 2, normalised), per-head q/k norm",
    "mixtral": "MoE (4 experts, top 2)",
    "gemma2": "sliding/full alternating, attention (50) and final (30) logit softcaps, query_pre_attn_scalar, (1+w) norms",
    "gemma3_text": "sliding, sliding, sliding, full; local and global rope (linear x8), q/k norms, query_pre_attn_scalar",
    "gemma4_text": "sliding/full; global layers with their own head_dim and 1 K/V head, K = V, partial proportional rope; "
                   "shared-KV last layers, per-layer embeddings, MoE, final softcap",
    "phi3": "fused qkv and gate_up projections, longrope with partial rotary 0.75",
    "olmo2": "post-norms, q/k norms over the whole projection",
    "granite": "embedding, residual, attention and logits multipliers",
    "gpt_oss": "attention sinks, sliding/full alternating, yarn rope, MoE (biases, clamped SwiGLU)",
    "deepseek_v3": "MLA (low-rank q and kv, decoupled rope, V narrower than K; cached as expanded K/V), yarn rope, "
                   "dense first layer, grouped sigmoid routing with a shared expert",
    "mistral_window": "Mistral v0.1-style sliding window on every layer",
    "llama": "llama3 rope scaling, untied head",
    "mistral": "no window",
    "qwen2": "q/k/v biases, tied embeddings",
    "qwen3": "per-head q/k norm, head_dim apart from hidden/heads",
}

GGUF_ASSET = {asset.arch: name for name, asset in TINY_GGUFS.items()}  # the GGUF test's case id per architecture
# Architectures without a shipped tiny GGUF: what happens to their llama.cpp-converted GGUF on the torch backend
# (transformers 5.24, llama-cpp-python 0.3.36's convert_hf_to_gguf.py), and whose limit it is.
GGUF_OTHERS = {
    "mixtral": "refused: read as a dense Llama (transformers)",
    "gemma4_text": "transformers cannot read it (transformers)",
    "olmo2": "transformers cannot read it (transformers)",
    "granite": "transformers cannot read it (transformers)",
    "gpt_oss": "transformers cannot read it (transformers)",
    "deepseek_v3": "transformers cannot read it (transformers)",
    "mistral_window": "reads as llama, window dropped (llama.cpp)",
    "llama": "native (tests/integration/test_llama3_gguf.py)",
    "mistral": "reads as llama: native",
    "qwen2": "not built (tiny model's tokenizer, see below)",
}
GGUF_NOTES = """\
## GGUF files on the torch backend

`--backend torch --model FILE.gguf` reads the file with transformers' GGUF reader (weights dequantized to
float32) and runs it on the path `model_impl` picks. The GGUF column above: the tiny model converted by
llama.cpp's own `convert_hf_to_gguf.py --outtype q8_0` (`cllm/tiny_ggufs.py`, shipped in
`tests/assets/models/`), served on the torch backend, every logits row within 1e-4 (log-probabilities) of
transformers' forward of the model the file holds (its dequantized weights in the family's own config) and
the greedy tokens equal to `generate` (`test_a_gguf_runs_on_the_torch_backend`).

transformers' reader (5.24) takes a fixed table of GGUF keys per architecture and leaves the config
class's defaults for the rest; the loader puts back from the file what changes the model
(`cllm/backends/torch/gguf_fixes.py`), as llama.cpp reads it: Qwen3's head_dim (without it the GGUFs of
Qwen3-0.6B, -4B and -32B fail to load), Qwen3-MoE's expert width (transformers' default, 768, is
Qwen3-30B-A3B's; other widths fail to load), Phi-3's partial rotary and longrope factors (Phi-4-mini, Phi-3.5-mini), Gemma 3's linear rope scaling on global
layers (4B and up) and local rope base, Gemma 2's softcaps, the Gemma 2 / 3 attention scale (GGUF has no
`query_pre_attn_scalar`: llama.cpp's 1/sqrt(head_dim), 1/sqrt(hidden / heads) for the 27B models, where
transformers' default 256 is wrong), linear rope scaling in any family, and Llama 3's `rope_freqs` on
both paths. A GGUF whose rope scaling neither reader carries over (yarn, ...) is refused. On the five
tiny files the torch backend and llama.cpp (`--backend llama_cpp`, f32 KV) give the same argmax, their
log-probabilities 0.05-0.08 apart (llama.cpp's q8_0 matmuls round activations to 8 bits); without these
values the Gemma 2, Gemma 3 and Phi-3 files are 1.3-2 apart and the Qwen3 / Qwen3-MoE ones do not load.

The other architectures' GGUFs (those transformers cannot read, or reads leaving weights unset, are refused
at load with the llama.cpp route):

- mixtral: llama.cpp writes Mixtral as architecture `llama` with expert tensors; transformers' reader
  builds a dense `LlamaForCausalLM` and finds none of its MLP weights (it would leave them randomly
  initialised; the loader refuses a model with unread weights).
- gemma4_text: transformers' reader passes the converter's per-layer `gemma4.feed_forward_length` array
  (the double-wide MLP of the KV-sharing layers) into `Gemma4TextConfig.intermediate_size`, an int:
  `StrictDataclassFieldValidationError: Validation error for field 'intermediate_size'`. (Converting the
  tiny model also needs a Gemma-style vocabulary: `Gemma4Model.set_vocab` uses `LlamaHfVocab`, which
  rejects SmolLM2's byte-level BPE: "Cannot find Llama BPE tokenizer".)
- gpt_oss: `load_gguf_checkpoint` reads the `gpt-oss.rope.scaling.*` keys with `reader.fields[key].parts[0]`
  (the key's length, not its value) and `float()` of that array raises
  `TypeError: only 0-dimensional arrays can be converted to Python scalars`.
- olmo2, granite, deepseek_v3 (GGUF `deepseek2`): not in transformers' GGUF table:
  `ValueError: GGUF model with architecture olmo2 is not supported yet.`
- mistral_window: llama.cpp writes Mistral as architecture `llama` without the window (llama.cpp ignores
  it); the file runs natively as the Llama it describes.
- llama, mistral: not shipped as converted files; the Llama path (native, and the transformers path with
  `rope_freqs`) is checked against llama.cpp on a Llama-3-style GGUF in `tests/integration/test_llama3_gguf.py`.
- qwen2: the tiny Qwen2 is not converted: transformers 5 loads its tokenizer as `Qwen2Tokenizer` (by
  model type), whose pre-tokenizer is not SmolLM2's, and the converter rejects it ("BPE pre-tokenizer was
  not recognized"); a property of the tiny model, not of Qwen2 checkpoints.
"""


def run_matrix() -> dict[str, str]:
    """Case id -> passed | failed | skipped."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", TEST, f"--junitxml={report}"], cwd=ROOT, check=False)
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            name = case.get("name", "")
            case_id = name[name.index("[") + 1 : -1] if "[" in name else name
            failed = case.find("failure") is not None or case.find("error") is not None
            outcomes[case_id] = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        return outcomes


def render(outcomes: dict[str, str]) -> str:
    def mark(case_id: str) -> str:
        return {"passed": "matches", "failed": "**fails**", "skipped": "skipped"}.get(outcomes.get(case_id, ""), "not run")

    lines = [
        "# Architectures each backend serves",
        "",
        f"Generated by `python benchmarks/architecture_table.py` from `{TEST}`: each architecture's tiny",
        "random model (`cllm/tiny_models.py`, float32, sliding windows of 16 tokens) on the torch backend, driven",
        "through chunked prefill, a batch of three sequences, 16 greedy decode steps, a prefix-cache hit and a",
        "preemption, every returned logits row within 1e-4 (log-probabilities) of transformers' forward and the",
        "greedy tokens equal to transformers' `generate`. \"matches\" means that case passed on the run that wrote this file.",
        "",
        "| architecture | what the tiny model keeps | torch, `model_impl: auto` | torch, `model_impl: transformers` "
        "| torch, a GGUF (see below) | llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for arch in TINY_ARCHS:
        native = arch in SUPPORTED_ARCHITECTURES or arch == "mistral_window"
        path = "native" if native else "transformers"
        auto = f"{path}: {mark(f'{arch}-auto')}"
        generic = mark(f"{arch}-transformers") if native else "(same as auto)"
        gguf = f"{path}: {mark(GGUF_ASSET[arch])}" if arch in GGUF_ASSET else GGUF_OTHERS.get(arch, "not tested")
        lines.append(f"| {arch} | {FEATURES.get(arch, '')} | {auto} | {generic} | {gguf} | serves (GGUF) |")
    lines += [
        f"| {', '.join(LINEAR_ATTENTION_TYPES[:2])} (Gated DeltaNet hybrids) | linear-attention layers | refused at load, "
        "with the llama.cpp route | refused | refused | serves (GGUF) |",
        "",
        "The llama.cpp column is issue 40's measurement (each model through llama.cpp's `convert_hf_to_gguf.py`,",
        "then `--backend llama_cpp`); this script does not re-run it. Any other decoder transformers'",
        "`AutoModelForCausalLM` knows runs on the transformers path too; those above are the ones tested.",
        "",
        "gpt-oss as published (`openai/gpt-oss-*`, experts in MXFP4: `quant_method: mxfp4`) runs on the torch backend",
        "with its experts dequantized at load, exactly, into the configured `dtype` (transformers' log line says",
        "bf16 whatever the dtype; gpt-oss-20b then holds about 42 GB in bfloat16): `tests/integration/test_gpt_oss_mxfp4.py`,",
        "the tiny gpt_oss above with MXFP4 experts. `model_impl: native` refuses quantized checkpoints.",
        "",
        GGUF_NOTES,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"))
    args = parser.parse_args()
    text = render(run_matrix())
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
