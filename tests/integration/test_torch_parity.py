"""Our torch decoder against transformers' reference forward, on small random models.

Each architecture (Llama with llama3 rope scaling and untied head, Mistral
with a (4096-token, here inactive) sliding window, Qwen2 with q/k/v bias and
tied embeddings, Qwen3 with per-head q/k RMSNorm and a head_dim apart from
hidden/heads, Qwen3-MoE with 8 experts, top 2 renormalised, one dense layer
among sparse ones, Mixtral with 4 experts, top 2) is built with random weights, saved as an HF
model directory, loaded by TorchBackend, and driven through mixed steps:
prefill, chunked prefill, decode, prefix-cache hits, all in one batch. Every
logits row we return must match transformers' full-sequence forward at that
position (float32; tolerance 1e-4 absolute on logits of magnitude ~1-10 —
observed error is ~1e-6).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from cllm.backends.torch import attention, moe
from cllm.backends.torch.backend import TorchBackend
from cllm.config import load_config

ATOL = 1e-4
BLOCK = 4
COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-5,
)


def _llama() -> torch.nn.Module:
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters=rope))


def _mistral() -> torch.nn.Module:
    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=4096, tie_word_embeddings=False))


def _qwen2() -> torch.nn.Module:
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True))


def _qwen3() -> torch.nn.Module:
    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False))


def _qwen3_moe() -> torch.nn.Module:
    # Layer 1 is a dense MLP (mlp_only_layers), layers 0 and 2 sparse.
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, head_dim=24, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    ))


def _mixtral() -> torch.nn.Module:
    return MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))


ARCHS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
}
SPARSE_LAYERS = {"qwen3_moe": [True, False, True], "mixtral": [True, True, True]}  # the MoE archs' sparse layers


def _randomize_non_matrix_params(model: torch.nn.Module) -> None:
    """transformers initialises biases to 0 and norm weights to 1; make them matter."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name else 0.0))


def _spread_routers(model: torch.nn.Module) -> None:
    """Router logits 4x the initialiser's, so the experts chosen depend strongly on the token (at 1x one of
    the tiny Mixtral's layers sent 29 tokens to only two expert pairs; test_moe_routing checks the spread)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(4.0)


def _backend(model_dir: Path, **overrides: object) -> TorchBackend:
    settings = dict(backend="torch", model=str(model_dir), dtype="float32", device="cpu", block_size=BLOCK,
                    n_ctx=256, n_seq_max=8, n_threads=2)
    settings.update(overrides)
    return TorchBackend(load_config(environ={}, **settings))


def _built(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module, Path]:
    torch.manual_seed(0)
    model = ARCHS[name]().eval()
    _randomize_non_matrix_params(model)
    _spread_routers(model)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return name, model, path


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module, Path]:
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(SPARSE_LAYERS))
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module, Path]:
    return _built(request.param, tmp_path_factory)


class Driver:
    """Feeds a backend scheduler-style steps and keeps every logits row it returns, by position."""

    def __init__(self, backend: TorchBackend) -> None:
        self.backend = backend
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.logits: dict[str, dict[int, np.ndarray]] = {}

    def admit(self, seq: str, tokens: list[int]) -> int:
        admission = self.backend.admit(seq, tokens)
        assert admission is not None
        self.tokens[seq], self.computed[seq], self.logits[seq] = list(tokens), admission.num_cached_tokens, {}
        return admission.num_cached_tokens

    def step(self, plan: dict[str, int]) -> None:
        """Run ``plan`` (seq -> tokens to evaluate; 0 = decode: sample greedily, then evaluate it)."""
        flat, pos, owners = [], [], []
        for seq, n in plan.items():
            if n == 0:
                last = self.logits[seq][self.computed[seq] - 1]
                self.tokens[seq].append(int(last.argmax()))
                n = 1
            start = self.computed[seq]
            assert self.backend.reserve(seq, start + n)
            flat += self.tokens[seq][start : start + n]
            pos += range(start, start + n)
            owners += [seq] * n
            self.computed[seq] = start + n
        order = list(reversed(plan))  # rows in an order other than the batch's
        rows = self.backend.forward_batch(flat, pos, owners, logits_for=order)
        assert rows.shape == (len(plan), self.backend.spec.vocab_size) and rows.dtype == np.float32
        for seq, row in zip(order, rows):
            self.logits[seq][self.computed[seq] - 1] = row


def _assert_matches_reference(model: torch.nn.Module, driver: Driver) -> int:
    checked = 0
    for seq, by_pos in driver.logits.items():
        with torch.no_grad():
            ref = model(torch.tensor([driver.tokens[seq]])).logits[0].numpy()
        assert np.abs(ref).max() > 1.0  # logits large enough for the tolerance to mean something
        for p, row in by_pos.items():
            np.testing.assert_allclose(row, ref[p], atol=ATOL, rtol=0, err_msg=f"{seq} at position {p}")
            checked += 1
    return checked


@pytest.mark.parametrize("decode_kernel", ["sdpa", "matmul", "flex"])
def test_mixed_batches_match_transformers(
    arch_model: tuple[str, torch.nn.Module, Path], decode_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model, path = arch_model
    # Decode groups switch from SDPA to matmul attention above a size; force each kernel.
    monkeypatch.setattr(attention, "MATMUL_DECODE_MIN_KEYS", 0 if decode_kernel == "matmul" else 1 << 62)
    # flex: FlexAttention over the paged pool (eager here: the pool is tiny) for decode and cached-prefix chunks.
    backend = _backend(path, attention="flex" if decode_kernel == "flex" else "sdpa")
    rng = np.random.default_rng(7)
    prompts = {name: rng.integers(0, 300, size=n).tolist() for name, n in (("a", 17), ("b", 5), ("c", 31))}
    d = Driver(backend)
    for seq, tokens in prompts.items():
        assert d.admit(seq, tokens) == 0
    d.step({"a": 10, "b": 5, "c": 7})  # two prefill chunks and a whole short prompt
    d.step({"a": 7, "b": 0, "c": 20})  # chunk continuing after cached context, decode
    # "d" shares a's first 13 tokens: three full blocks (12 tokens) come from the cache.
    assert d.admit("d", prompts["a"][:13] + [5, 6, 7]) == 12
    d.step({"b": 0, "a": 0, "d": 4, "c": 4})  # decode rows first, then chunks
    for _ in range(6):
        d.step({"a": 0, "b": 0, "c": 0, "d": 0})  # pure decode batch
    # A finished sequence's blocks stay cached: "a" resubmitted in full recomputes only its last block.
    full_a = list(d.tokens["a"])
    backend.release("a")
    assert d.admit("a2", full_a) == (len(full_a) - 1) // BLOCK * BLOCK
    d.step({"a2": len(full_a) - d.computed["a2"], "b": 0})  # a chunk, then a decode row
    d.step({"a2": 0, "b": 0})
    assert _assert_matches_reference(model, d) == 38  # every returned row was checked
    queried, hits = backend.prefix_cache_stats()
    assert queried == 17 + 5 + 31 + 16 + len(full_a) and hits == 12 + (len(full_a) - 1) // BLOCK * BLOCK


def test_state_swap_round_trip(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    _, model, path = arch_model
    backend = _backend(path)
    d = Driver(backend)
    d.admit("s", list(range(40, 61)))
    d.step({"s": 21})
    d.step({"s": 0})
    state = backend.save_state("s")
    backend.release("s", keep_cache=False)  # nothing left to hit in the cache
    assert backend.admit("s", d.tokens["s"]).num_cached_tokens == 0
    assert backend.restore_state("s", state, d.tokens["s"][: d.computed["s"]])
    d.step({"s": 0})
    d.step({"s": 0})
    _assert_matches_reference(model, d)


def test_restore_when_the_cache_holds_more_than_the_snapshot(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    _, model, path = arch_model
    backend = _backend(path)
    d = Driver(backend)
    prompt = list(range(60, 81))  # 21 tokens
    d.admit("s", prompt)
    d.step({"s": 6})  # swapped out after its first chunk
    state = backend.save_state("s")
    backend.release("s", keep_cache=False)
    d.admit("u", prompt)
    d.step({"u": 21})  # another request caches five full blocks of the same prompt
    assert backend.admit("s", prompt).num_cached_tokens == 20
    # The scheduler resumes from the snapshot's 6 tokens; the surplus cached blocks
    # must not be written into when s computes positions 6..20 again.
    assert backend.restore_state("s", state, prompt[:6])
    d.computed["s"] = 6
    d.step({"s": 15, "u": 0})
    d.step({"s": 0, "u": 0})
    _assert_matches_reference(model, d)


def test_kv_full_reserve_fails_and_forward_raises(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    from cllm.backends.base import KVCacheFullError

    _, _, path = arch_model
    backend = _backend(path, n_ctx=64)  # 16 blocks of 4
    assert backend.capacity.kv_tokens == 64
    backend.admit("x", list(range(40)))
    assert backend.reserve("x", 40)
    backend.admit("y", list(range(100, 140)))
    assert not backend.reserve("y", 40)  # 10 more blocks do not fit in the 6 left
    assert backend.kv_usage() == pytest.approx(10 / 16)
    with pytest.raises(KVCacheFullError) as err:
        backend.forward_batch(list(range(100, 140)), list(range(40)), ["y"] * 40)
    assert err.value.sequence_ids == ["y"]


def test_admission_cap_and_capacity(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    _, _, path = arch_model
    backend = _backend(path, n_seq_max=2, n_ctx=1000, n_batch=128)
    cap = backend.capacity
    assert (cap.max_num_seqs, cap.max_batch_tokens, cap.max_model_len, cap.kv_tokens) == (2, 128, 512, 1000)
    assert backend.admit("a", [1, 2]) is not None and backend.admit("b", [3]) is not None
    assert backend.num_free_slots() == 0
    assert backend.admit("c", [4]) is None
    backend.release("a")
    backend.release("a")
    assert backend.num_free_slots() == 1 and backend.admit("c", [4]) is not None


def test_chunk_without_logits_then_the_rest(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    _, model, path = arch_model
    backend = _backend(path)
    tokens = list(range(10, 30))
    backend.admit("a", tokens)
    empty = backend.forward_batch(tokens[:12], range(12), ["a"] * 12, logits_for=[])
    assert empty.shape == (0, backend.spec.vocab_size) and empty.dtype == np.float32
    last = backend.forward_batch(tokens[12:], range(12, 20), ["a"] * 8)
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0, -1].numpy()
    np.testing.assert_allclose(last[0], ref, atol=ATOL, rtol=0)


def test_positions_must_continue_the_sequence(arch_model: tuple[str, torch.nn.Module, Path]) -> None:
    from cllm.backends.base import BackendError

    _, _, path = arch_model
    backend = _backend(path)
    backend.admit("a", [1, 2, 3])
    with pytest.raises(BackendError, match="positions must continue"):
        backend.forward_batch([2, 3], [1, 2], ["a", "a"])
    with pytest.raises(BackendError, match="not admitted"):
        backend.forward_batch([2], [0], ["ghost"])
    # in a batch of several sequences the error names the one whose positions are off
    backend.admit("b", [4, 5])
    with pytest.raises(BackendError, match="sequence 'b': positions must continue from its 0") as err:
        backend.forward_batch([1, 2, 3, 4, 5], [0, 1, 2, 0, 2], ["a", "a", "a", "b", "b"])
    assert err.value.sequence_ids == ["b"]
    with pytest.raises(BackendError, match="'a': positions must continue") as err:
        backend.forward_batch([1, 4], [1, 0], ["a", "b"])  # a decode-shaped step (one row per sequence)
    assert err.value.sequence_ids == ["a"]
    with pytest.raises(BackendError, match="contiguous"):
        backend.forward_batch([1, 4, 2], [0, 0, 1], ["a", "b", "a"])
    backend.forward_batch([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], ["a", "a", "a", "b", "b"])  # right: accepted


def _save_tiny_tokenizer(path: Path) -> None:
    """A 290-entry byte-level BPE, so the engine can run the tiny model end to end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_engine_under_kv_pressure_matches_transformers(
    arch_model: tuple[str, torch.nn.Module, Path], preemption_mode: str
) -> None:
    """cllm.LLM on the tiny model with a KV pool too small for all requests: preemption must not change outputs."""
    import cllm

    name, model, path = arch_model
    if not (path / "tokenizer.json").is_file():
        _save_tiny_tokenizer(path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 290, size=n).tolist() for n in (9, 14, 20, 6, 17, 11)]
    max_tokens = 20
    with cllm.LLM(model=str(path), backend="torch", dtype="float32", device="cpu", block_size=BLOCK, n_ctx=96,
                  n_seq_max=6, n_threads=2, preemption_mode=preemption_mode) as llm:
        outs = llm.generate(prompts, cllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert llm.stats().num_preemptions > 0  # 6 requests x up to 40 tokens cannot share 96 slots
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), f"{name}: {prompt}"


def test_an_architecture_without_a_native_decoder_is_refused_by_model_impl_native(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model_impl=native cannot run this 'gpt2' model.*llama, mistral, qwen2, qwen3"):
        _backend(tmp_path, model_impl="native")
    assert _backend(tmp_path).model_impl == "transformers"  # auto: transformers' model code


def test_a_linear_attention_hybrid_is_refused_with_what_is_served(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5_text", "layer_types": '
                                          '["linear_attention", "full_attention"]}')
    with pytest.raises(ValueError, match=r"cannot run model architecture 'qwen3_5_text'.*recurrent state.*"
                                         r"runs natively: llama.*convert_hf_to_gguf\.py.*--backend llama_cpp"):
        _backend(tmp_path)


def test_moe_routing_differs_per_token(moe_model: tuple[str, torch.nn.Module, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE models' parity means something only if tokens go to different experts: check they do."""
    name, _, path = moe_model
    backend = _backend(path)
    assert [w.moe is not None for w in backend.model.layers] == SPARSE_LAYERS[name]
    chosen: list[torch.Tensor] = []
    route = moe.route

    def recording(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(*args)
        chosen.append(experts)
        return weights, experts

    monkeypatch.setattr(moe, "route", recording)
    backend.admit("a", list(range(0, 290, 10)))
    backend.forward_batch(list(range(0, 290, 10)), range(29), ["a"] * 29)
    assert len(chosen) == sum(SPARSE_LAYERS[name])
    for experts in chosen:  # every sparse layer: several top-1 experts and many distinct top-k sets
        assert len(set(experts[:, 0].tolist())) >= 2
        assert len({tuple(sorted(row)) for row in experts.tolist()}) >= 3


@pytest.mark.parametrize("dense", ["off", "forced"])
def test_moe_dense_decode_matches_transformers(
    moe_model: tuple[str, torch.nn.Module, Path], dense: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.moe_dense_decode: batches that reach most experts run as two GEMMs over all of them (forced here
    at every batch size; at load it is timed) and agree with transformers as the per-expert loop does."""
    _, model, path = moe_model
    backend = _backend(path, moe_dense_decode="on" if dense == "forced" else "off")
    sparse = [w.moe for w in backend.model.layers if w.moe is not None]
    assert all((m.dense is not None) == (dense == "forced") for m in sparse)
    for m in sparse:
        m.dense_max_tokens = 1 << 30 if dense == "forced" else 0
    ran: list[int] = []
    dense_cpu = moe._dense_cpu
    monkeypatch.setattr(moe, "_dense_cpu", lambda h, *rest: ran.append(h.shape[0]) or dense_cpu(h, *rest))
    rng = np.random.default_rng(3)
    d = Driver(backend)
    for seq, n in (("a", 9), ("b", 14), ("c", 6), ("e", 11)):
        d.admit(seq, rng.integers(0, 300, size=n).tolist())
    d.step({"a": 9, "b": 14, "c": 6, "e": 11})
    for _ in range(5):
        d.step({"a": 0, "b": 0, "c": 0, "e": 0})  # 4 tokens x top 2 = 8 experts: all of them reachable
    assert _assert_matches_reference(model, d) == 24
    assert bool(ran) == (dense == "forced") and (not ran or min(ran) == 4)


def test_moe_stacked_and_per_expert_layouts_load_alike(moe_model: tuple[str, torch.nn.Module, Path]) -> None:
    """transformers >= 5 holds experts stacked (``experts.gate_up_proj``; what a GGUF load hands us) but saves
    them per expert (what test_mixed_batches loads): both layouts must give the same model."""
    from safetensors.torch import load_file

    from cllm.backends.torch.embedding import pooled_hidden_states
    from cllm.backends.torch.loader import spec_from_config
    from cllm.backends.torch.model import CausalLM

    name, model, path = moe_model
    stacked = {k: v.detach() for k, v in model.state_dict().items()}
    saved = load_file(str(path / "model.safetensors"))
    assert any(".experts.gate_up_proj" in k for k in stacked) and not any(".experts.gate_up_proj" in k for k in saved)
    spec = spec_from_config(model.config)
    inputs = [list(range(5, 60, 3)), list(range(100, 112))]
    cpu = torch.device("cpu")
    pooled = [
        pooled_hidden_states(CausalLM(spec, state, dtype=torch.float32, device=cpu), inputs, "mean", cpu)
        for state in (stacked, saved)
    ]
    np.testing.assert_allclose(pooled[0], pooled[1], atol=1e-6, rtol=0)
