"""The sparse MoE MLP's pieces on CPU: routing, the three expert paths against a per-token reference,
weight layouts and which layers are sparse. (Parity of whole MoE models with transformers:
tests/integration/test_torch_parity.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig

from cllm.backends.torch import moe
from cllm.backends.torch.linear import Linear
from cllm.backends.torch.loader import spec_from_config

E, H, I, TOP_K = 6, 16, 8, 2


def _per_expert_state(prefix: str, names: tuple[str, str, str], block: str = "mlp.") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state = {f"{prefix}{block}gate.weight": torch.randn(E, H, generator=gen)}
    for e in range(E):
        gate, up, down = names
        state[f"{prefix}{block}experts.{e}.{gate}.weight"] = torch.randn(I, H, generator=gen) * 0.3
        state[f"{prefix}{block}experts.{e}.{up}.weight"] = torch.randn(I, H, generator=gen) * 0.3
        state[f"{prefix}{block}experts.{e}.{down}.weight"] = torch.randn(H, I, generator=gen) * 0.3
    return state


def _weights(renormalize: bool = True) -> moe.MoEWeights:
    """CPU weights with the stacked tensors kept (load_moe drops them on CPU), so every path can run."""
    state = _per_expert_state("p.", ("gate_proj", "up_proj", "down_proj"))
    w = moe.load_moe(state, "p.", num_experts=E, top_k=TOP_K, renormalize=renormalize, dtype=torch.float32,
                     device=torch.device("cpu"), prepack=True, fp16_weights=False)
    w.gate_up, w.down = moe.stacked_experts(state, moe.moe_tensor_names(state, "p.", E), E)
    w.expert_ids = torch.arange(E)
    w.dense = moe.dense_weights(w.gate_up, w.down, prepack=True)
    return w


def _reference(h: torch.Tensor, w: moe.MoEWeights) -> torch.Tensor:
    """Token by token, expert by expert, as transformers' experts loop computes it."""
    assert w.gate_up is not None and w.down is not None
    weights, experts = moe.route(h, w.router, w.top_k, w.renormalize)
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for weight, e in zip(weights[t], experts[t].tolist()):
            gate, up = F.linear(h[t], w.gate_up[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, w.down[e])
    return out


def _grouped_mm_runs_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("path", ["looped", "grouped", "dense", "dense_cpu"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_paths_match_the_per_token_reference(path: str, tokens: int) -> None:
    if path == "grouped" and not _grouped_mm_runs_on_cpu():
        pytest.skip("this torch has no CPU torch._grouped_mm")
    w = _weights()
    h = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    weights, experts = moe.route(h, w.router, w.top_k, w.renormalize)
    if tokens == 40:  # some experts get several tokens, and the test would prove little if all went to one
        assert len(set(experts.reshape(-1).tolist())) >= 4
    paths = {"looped": moe._looped, "grouped": moe._grouped, "dense": moe._dense, "dense_cpu": moe._dense_cpu}
    got = paths[path](h, w, weights, experts)
    torch.testing.assert_close(got, _reference(h, w), atol=1e-5, rtol=1e-5)


def test_moe_forward_runs_the_loop_on_cpu_and_grouped_when_told() -> None:
    w = _weights()
    h = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe.moe_forward(h, w), _reference(h, w), atol=1e-5, rtol=1e-5)
    assert not w.grouped and not moe.grouped_mm_works(torch.device("cpu"), torch.float32)  # CUDA only
    if _grouped_mm_runs_on_cpu():
        w.grouped = True
        torch.testing.assert_close(moe.moe_forward(h, w), _reference(h, w), atol=1e-5, rtol=1e-5)


def test_cpu_dense_path_runs_for_batches_that_reach_most_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weights()
    ran: list[int] = []
    dense = moe._dense_cpu
    monkeypatch.setattr(moe, "_dense_cpu", lambda h, *rest: ran.append(h.shape[0]) or dense(h, *rest))
    w.dense_max_tokens = 8
    for tokens in (1, 2, 3, 8, 9):  # E = 6, top 2: from 3 tokens on, up to dense_max_tokens
        h = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
        torch.testing.assert_close(moe.moe_forward(h, w), _reference(h, w), atol=1e-5, rtol=1e-5)
    assert ran == [3, 8]
    w.dense = None  # moe_dense_decode off: the loop only
    moe.moe_forward(torch.randn(4, H), w)
    assert ran == [3, 8]


def test_dense_max_tokens_is_a_timed_power_of_two() -> None:
    w = _weights()
    got = moe.dense_max_tokens(w, torch.float32, limit=64, repeats=1)
    assert got in (0, 4, 8, 16, 32, 64)  # from the first batch with T * top_k >= E (3 -> 4)


def test_moe_dense_decode_setting_and_its_memory_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from cllm.backends.torch.device import resolve_moe_dense

    spec = spec_from_config(Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, moe_intermediate_size=16, num_experts=8,
                                           num_experts_per_tok=2, mlp_only_layers=[0]))
    cpu, copy = torch.device("cpu"), 3 * 8 * 3 * 32 * 16 * 4  # 3 sparse layers, 8 experts, float32
    monkeypatch.setattr("os.sysconf", lambda name: {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": 8 * copy}[name])
    assert resolve_moe_dense("auto", spec, 4, cpu) and resolve_moe_dense("on", spec, 4, cpu)
    assert not resolve_moe_dense("auto", spec, 8, cpu)  # the copy would pass 1/8 of the host's memory
    assert resolve_moe_dense("on", spec, 8, cpu) and not resolve_moe_dense("off", spec, 4, cpu)
    assert not resolve_moe_dense("on", spec, 4, torch.device("meta"))  # CPU only
    dense_spec = spec_from_config(Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, num_experts=0))
    assert not resolve_moe_dense("on", dense_spec, 4, cpu)


def test_route_softmax_top_k_and_renormalisation() -> None:
    router = Linear(torch.eye(4), None, prepack=False)
    h = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    probs = torch.softmax(h, dim=-1)
    weights, experts = moe.route(h, router, 2, renormalize=False)
    assert experts.tolist() == [[2, 3]]
    torch.testing.assert_close(weights, probs[:, [2, 3]])
    weights, _ = moe.route(h, router, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, [2, 3]] / probs[:, [2, 3]].sum())


def test_layouts_are_recognised_and_stacked_alike() -> None:
    qwen = _per_expert_state("model.layers.0.", ("gate_proj", "up_proj", "down_proj"))
    mixtral = {k.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.")
               .replace(".down_proj.", ".w2.").replace("mlp.", "block_sparse_moe."): v for k, v in qwen.items()}
    gate_up, down = moe.stacked_experts(qwen, moe.moe_tensor_names(qwen, "model.layers.0.", E), E)
    stacked = {"model.layers.0.mlp.gate.weight": qwen["model.layers.0.mlp.gate.weight"],
               "model.layers.0.mlp.experts.gate_up_proj": gate_up, "model.layers.0.mlp.experts.down_proj": down}
    assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
    assert torch.equal(gate_up[3, :I], qwen["model.layers.0.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(gate_up[3, I:], qwen["model.layers.0.mlp.experts.3.up_proj.weight"])
    for state in (mixtral, stacked):
        names = moe.moe_tensor_names(state, "model.layers.0.", E)
        assert all(n in state for n in names)
        got = moe.stacked_experts(state, names, E)
        assert torch.equal(got[0], gate_up) and torch.equal(got[1], down)
    # Nothing there: the stacked names, for the missing-weights error.
    assert moe.moe_tensor_names({}, "model.layers.0.", E) == [
        "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]


def test_expert_count_must_match_the_config() -> None:
    state = {"p.mlp.gate.weight": torch.zeros(6, H), "p.mlp.experts.gate_up_proj": torch.zeros(6, 2 * I, H),
             "p.mlp.experts.down_proj": torch.zeros(6, H, I)}
    with pytest.raises(ValueError, match="6 experts in the weights, the config says 5"):
        moe.load_moe(state, "p.", num_experts=5, top_k=2, renormalize=True, dtype=torch.float32,
                     device=torch.device("cpu"), prepack=False, fp16_weights=False)


def test_spec_marks_the_sparse_layers() -> None:
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
    qwen = spec_from_config(Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                           num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                                           norm_topk_prob=False))
    assert qwen.moe_layers == (False, True, False, False, False, True)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob) == (8, 2, 16, False)
    assert qwen.qk_norm and qwen.intermediate_size == 48  # the dense layers' MLP width
    mixtral = spec_from_config(MixtralConfig(**common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))
    assert mixtral.moe_layers == (True,) * 6 and mixtral.norm_topk_prob and not mixtral.qk_norm
    assert (mixtral.num_experts, mixtral.moe_intermediate_size) == (4, 24)
