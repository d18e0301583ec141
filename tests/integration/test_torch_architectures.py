"""The torch backend on every architecture of the matrix (issue 40), against transformers.

Each tiny random model (cllm.tiny_models: seeded, float32, every distinguishing feature of its
family on, sliding windows of 16 tokens) is served by TorchBackend on the path ``model_impl``
picks (and the four native families on both paths), and driven as the scheduler drives it: three
prompts longer than the window, prefilled in chunks beside each other, then 16 greedy decode steps
in one batch, a fourth prompt whose start hits the prefix cache, and a preemption (a sequence let go
without its cache and recomputed from its tokens). What is guaranteed and asserted:

- every logits row the backend returns is within ATOL of transformers' full forward at that
  position (teacher-forced on the same tokens), as log-probabilities; the rows cover prompts and
  generations past the window, prefix-cache hits, batches and the recomputed sequence;
- the 16 greedy tokens equal transformers' ``generate`` (EOS ignored) up to the first step where
  transformers' own top two logits are closer than TIE (there the float32 rounding of either side
  may pick either; no step is excused otherwise — the test counts how many were).
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cllm.backends.torch.backend import TorchBackend
from cllm.backends.torch.loader import SUPPORTED_ARCHITECTURES
from cllm.config import load_config
from cllm.tiny_ggufs import TINY_GGUFS
from cllm.tiny_models import TINY_ARCHS, build_tiny
from tests.integration.test_torch_parity import Driver

ATOL = 1e-4  # log-probabilities, float32 (observed ~1e-6)
TIE = 1e-3  # transformers' top-two logit gap below which greedy may go either way
WINDOW = 16
BLOCK = 4
NEW_TOKENS = 16
NATIVE = [a for a in TINY_ARCHS if a in SUPPORTED_ARCHITECTURES or a == "mistral_window"]
CASES = [(a, "auto") for a in TINY_ARCHS] + [(a, "transformers") for a in NATIVE]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _model_dir(built: dict[str, Path], arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if arch not in built:
        built[arch] = build_tiny(arch, tmp_path_factory.mktemp(arch), seed=0, window=WINDOW)
    return built[arch]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize(("arch", "impl"), CASES, ids=[f"{a}-{i}" for a, i in CASES])
def test_matches_transformers(arch: str, impl: str, built: dict[str, Path],
                              tmp_path_factory: pytest.TempPathFactory) -> None:
    path = _model_dir(built, arch, tmp_path_factory)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_against_transformers(arch, impl, path, reference)


def check_against_transformers(arch: str, impl: str, path: Path, reference: torch.nn.Module) -> TorchBackend:
    """Serve the model directory ``path`` on TorchBackend (float32, CPU, ``model_impl`` ``impl``), drive it
    as described above and compare every row and greedy token with ``reference`` (transformers' model of
    the same weights, float32); the backend, for further checks."""
    backend = TorchBackend(load_config(environ={}, backend="torch", model=str(path), dtype="float32", device="cpu",
                                       block_size=BLOCK, n_ctx=256, n_seq_max=8, n_threads=2, model_impl=impl))
    expected_impl = "native" if impl == "auto" and arch in NATIVE else ("transformers" if impl == "transformers" else None)
    if expected_impl:
        assert backend.model_impl == expected_impl
    windows = set(getattr(reference.config, "layer_types", None) or ()) & {"sliding_attention"}
    if arch in ("mistral_window", "gemma2", "gemma3_text", "gemma4_text", "gpt_oss") or windows:
        assert WINDOW in backend._windows  # the window is live: prompts below are longer than it

    rng = np.random.default_rng(11)
    vocab = reference.config.get_text_config().vocab_size
    prompts = {name: rng.integers(100, min(vocab, 40000), size=n).tolist() for name, n in (("a", 40), ("b", 23), ("c", 37))}
    d = Driver(backend)
    for seq, tokens in prompts.items():
        assert d.admit(seq, tokens) == 0
    d.step({"a": 24, "b": 23, "c": 10})  # chunks beside a whole prompt
    d.step({"a": 16, "b": 0, "c": 27})  # chunks after cached context beside a decode
    for _ in range(NEW_TOKENS - 1):
        d.step({"a": 0, "b": 0, "c": 0})
    # "d" shares a's first 29 tokens: 7 full blocks (28 tokens) from the prefix cache.
    assert d.admit("d", prompts["a"][:29] + [7, 8, 9]) == 28
    d.step({"a": 0, "d": 4, "b": 0})
    # Preemption by recompute: "b" is let go with its cache dropped, then re-admitted with every token
    # it had and recomputed in one chunk beside the others' decodes.
    b_tokens, b_rows = list(d.tokens["b"]), d.logits["b"]
    backend.release("b", keep_cache=False)
    assert d.admit("b", b_tokens) == 0
    d.logits["b"].update(b_rows)  # its rows from before the preemption are checked too
    d.step({"b": len(b_tokens), "a": 0, "d": 0})
    for _ in range(3):
        d.step({"a": 0, "b": 0, "c": 0, "d": 0})

    # Every row against transformers' forward of its sequence (a row at position p depends on the
    # first p + 1 tokens only, which never change; the recomputed "b" gave its last position again).
    worst, checked = 0.0, 0
    with torch.no_grad():
        for seq, by_pos in d.logits.items():
            ref = reference(torch.tensor([d.tokens[seq]])).logits[0].numpy()
            for position, row in by_pos.items():
                worst = max(worst, float(np.abs(_log_softmax(row) - _log_softmax(ref[position])).max()))
                checked += 1
    assert worst <= ATOL, f"{arch} ({backend.model_impl}): log-probabilities off by {worst:.2e}"
    assert checked == 3 + 3 + 3 * (NEW_TOKENS - 1) + 3 + 2 + 4 * 3  # distinct (sequence, position) rows

    # Greedy tokens against transformers' generate, EOS ignored.
    excused = 0
    no_eos = copy.deepcopy(reference.generation_config)
    no_eos.eos_token_id, no_eos.pad_token_id = None, 0
    for seq, prompt in prompts.items():
        ours = d.tokens["a" if seq == "a" else seq][len(prompt) : len(prompt) + NEW_TOKENS]
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     generation_config=no_eos, max_new_tokens=NEW_TOKENS, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(prompt):].tolist()
        for i, (mine, ref_token) in enumerate(zip(ours, theirs)):
            if mine == ref_token:
                continue
            top2 = torch.topk(out.scores[i][0], 2).values
            assert float(top2[0] - top2[1]) < TIE, (
                f"{arch} {seq}: greedy token {i} is {mine}, transformers' {ref_token} (gap {float(top2[0] - top2[1]):.2e})")
            excused += 1
            break  # a near tie: the continuations may differ from here on
    assert excused <= 1, f"{arch}: {excused} of 3 generations met a near tie; the model's logits are too flat to test"
    return backend


ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"
GGUF_NEW_TOKENS = 6
CHATML, CHATML_IDS = "<|im_start|>user\nHi<|im_end|>", [1, 4093, 198, 26843, 2]  # as SmolLM2's tokenizer reads it


@pytest.mark.parametrize("name", list(TINY_GGUFS))
def test_a_gguf_runs_on_the_torch_backend(name: str) -> None:
    """A tiny GGUF of each family (llama.cpp's converter, q8_0; cllm.tiny_ggufs) on the path ``model_impl``
    auto picks: every row within ATOL (log-probabilities) of transformers' forward of the model the file
    holds (its dequantized weights in the family's own config, TinyGGUF.config: so whatever transformers'
    GGUF reader drops and the loader must put back is checked), and the greedy tokens equal ``generate``."""
    asset, path = TINY_GGUFS[name], ASSETS / name
    # moe_dense_decode off: no crossover timing at load (~2 s; the matrix above covers that path)
    backend = TorchBackend(load_config(environ={}, backend="torch", model=str(path), dtype="float32", device="cpu",
                                       block_size=BLOCK, n_ctx=256, n_seq_max=4, n_threads=2, moe_dense_decode="off"))
    assert backend.model_impl == ("native" if asset.arch in NATIVE else "transformers")
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=name, config=asset.config(),
                                                     dtype=torch.float32).eval()
    windows = set(reference.config.get_text_config().to_dict().get("layer_types") or ()) & {"sliding_attention"}
    assert backend._windows == ((WINDOW,) if windows else ())
    # SmolLM2's tokenizer, read from the file's vocabulary: control tokens and byte-level BPE.
    assert backend.tokenizer.encode(CHATML, add_special=False) == CHATML_IDS
    d = Driver(backend)
    prompt = list(range(300, 340))
    d.admit("a", prompt)
    d.admit("b", prompt[:10])
    d.step({"a": 25, "b": 10})
    d.step({"a": 15, "b": 0})
    for _ in range(GGUF_NEW_TOKENS):
        d.step({"a": 0, "b": 0})
    worst = 0.0
    with torch.no_grad():
        for seq, by_pos in d.logits.items():
            ref = reference(torch.tensor([d.tokens[seq]])).logits[0].numpy()
            for position, row in by_pos.items():
                worst = max(worst, float(np.abs(_log_softmax(row) - _log_softmax(ref[position])).max()))
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=GGUF_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert worst <= ATOL, f"{name} ({backend.model_impl}): log-probabilities off by {worst:.2e}"
    assert d.tokens["a"][len(prompt):] == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "deepseek_v3", "gemma4_text"])
def test_embeddings_on_the_transformers_path(arch: str, built: dict[str, Path],
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """Pooled hidden states of inputs packed in one forward (one longer than the window) equal
    transformers' decoder run on each input alone, mean-pooled."""
    path = _model_dir(built, arch, tmp_path_factory)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    backend = TorchBackend(load_config(environ={}, backend="torch", model=str(path), dtype="float32", device="cpu",
                                       n_ctx=256, n_seq_max=4, n_threads=2, embedding_pooling="mean"))
    assert backend.model_impl == "transformers" and backend.supports_embeddings
    rng = np.random.default_rng(5)
    inputs = [rng.integers(100, 40000, size=n).tolist() for n in (40, 9, 23)]
    ours = backend.embed(inputs)
    with torch.no_grad():
        for row, ids in zip(ours, inputs):
            want = reference.get_decoder()(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
            np.testing.assert_allclose(row, want, atol=ATOL, rtol=0)
