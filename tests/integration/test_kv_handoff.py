"""KV hand-off between two engines in one process, on the real embedded model (both backends).

What is guaranteed (docs/reproducibility.md): the same requests in the same batch, same build and
thread count, same prefix-cache state give bit-identical tokens. A hand-off keeps all of that: the
request runs alone on both engines (1 thread each, prefix cache off), the second engine gets a
byte-exact copy of the first one's KV and evaluates the same tokens in the same steps a single
engine would. So greedy output with a hand-off must equal greedy output without one, exactly.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import cllm
from cllm.engine.llm_engine import LLMEngine
from cllm.handoff.local import hand_off
from cllm.handoff.transfer import KVReceiver, KVSender, TransferStatus, send
from tests.integration.test_torch_parity import _llama, _randomize_non_matrix_params, _save_tiny_tokenizer
from tests.unit.fakes import run_all

PROMPT = "The three primary colors are"
LONG_PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
               "The story should mention the sea, a storm, an old friend and a cat named Pepper.")
GREEDY = cllm.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)  # always 24 tokens
# Prompts are prefilled in 16-token chunks (so a hand-off can happen mid-prefill); both engines of a
# pair, and the reference run, use the same chunks.
SETTINGS = dict(n_threads=1, n_seq_max=2, n_ctx=1024, prefix_cache=False, max_num_batched_tokens=16)
TORCH_SETTINGS = dict(n_threads=1, n_seq_max=2, n_ctx=256, backend="torch", dtype="float32", device="cpu", block_size=4)


def steps(engine: LLMEngine, n: int) -> None:
    for _ in range(n):
        engine.step()


@pytest.fixture(scope="module")
def llama_pair() -> Iterator[tuple[cllm.LLM, cllm.LLM]]:
    with cllm.LLM(**SETTINGS) as a, cllm.LLM(**SETTINGS) as b:
        yield a, b


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random Llama with a byte-level tokenizer: the torch backend loads it in a moment (the
    embedded GGUF takes a minute to dequantise per engine on this machine, and this test needs three)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = _llama()
    _randomize_non_matrix_params(model)
    model.save_pretrained(path)
    _save_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def torch_pair(tiny_llama: str) -> Iterator[tuple[cllm.LLM, cllm.LLM]]:
    with cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as a, cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as b:
        yield a, b


@contextlib.contextmanager
def evaluated_tokens(engine: LLMEngine) -> Iterator[list[int]]:
    """Counts the tokens the engine's forward passes evaluate meanwhile ([count]): a receiver whose
    KV import failed silently recomputes the whole request, with the same output."""
    backend = engine.backend
    forward = backend.forward_batch
    counted = [0]

    def counting(flat_ids, *args, **kwargs):
        counted[0] += len(flat_ids)
        return forward(flat_ids, *args, **kwargs)
    backend.forward_batch = counting  # (an instance attribute shadows the method)
    try:
        yield counted
    finally:
        del backend.forward_batch


def missing_tokens(num_prompt: int, num_output: int, kv_tokens: int) -> int:
    """What the receiver evaluates when the KV of ``kv_tokens`` tokens arrived: the rest of the
    prompt and output, less the last token sampled (never evaluated)."""
    return num_prompt + num_output - 1 - kv_tokens


def reference(llm: cllm.LLM, prompt: str, params: cllm.SamplingParams) -> list[int]:
    llm.engine.add_request(prompt, params, request_id="ref")
    return run_all(llm.engine)["ref"].outputs[0].token_ids


def test_llama_cpp_greedy_output_is_identical_through_a_hand_off(llama_pair):
    a, b = llama_pair
    expected = reference(a, PROMPT, GREEDY)
    a.engine.add_request(PROMPT, GREEDY, request_id="h")
    steps(a.engine, 9)  # prefill + 9 tokens on engine A
    report = hand_off(a.engine, b.engine, "h", chunk_bytes=32 * 1024)
    assert report.kv_tokens == len(a.tokenizer.encode(PROMPT)) + 8  # the 9th token is not in KV yet
    assert a.engine.num_handed_off >= 1
    assert report.num_chunks == -(-report.kv_bytes // (32 * 1024)) > 1
    assert a.engine.backend.num_free_slots() == 2 and not a.engine.has_unfinished()
    with evaluated_tokens(b.engine) as evaluated:
        out = run_all(b.engine)["h"]
    assert out.outputs[0].token_ids == expected
    assert evaluated == [missing_tokens(len(a.tokenizer.encode(PROMPT)), 24, report.kv_tokens)]
    assert out.outputs[0].text == a.tokenizer.decode(expected)
    assert out.usage.completion_tokens == 24 and out.outputs[0].finish_reason == "length"
    assert b.engine.backend.num_free_slots() == 2


def test_llama_cpp_hand_off_mid_prefill(llama_pair):
    """A prompt moves after its first 16-token prefill chunk; the rest of the prefill and the decode
    run on the other engine in the same chunks a single engine would use."""
    a, b = llama_pair
    expected = reference(a, LONG_PROMPT, GREEDY)
    a.engine.add_request(LONG_PROMPT, GREEDY, request_id="p")
    steps(a.engine, 1)
    report = hand_off(a.engine, b.engine, "p", chunk_bytes=64 * 1024)
    num_prompt = len(a.tokenizer.encode(LONG_PROMPT))
    assert report.kv_tokens == 16 < num_prompt
    with evaluated_tokens(b.engine) as evaluated:
        assert run_all(b.engine)["p"].outputs[0].token_ids == expected
    assert evaluated == [missing_tokens(num_prompt, len(expected), 16)]  # the imported 16 are not recomputed


def test_llama_cpp_interrupted_transfer_resumes(llama_pair):
    a, b = llama_pair
    expected = reference(a, PROMPT, GREEDY)
    a.engine.add_request(PROMPT, GREEDY, request_id="i")
    steps(a.engine, 5)
    snap, segments = a.engine.export_request("i")
    sender = KVSender("i", segments, 16 * 1024)
    receiver = KVReceiver(sender.header)
    assert send(sender, receiver, max_chunks=3) is TransferStatus.TRANSFERRING  # the link drops
    assert receiver.next_index == 3 and sender.header.num_chunks > 3
    assert send(sender, receiver) is TransferStatus.DONE  # resumed from chunk 3
    b.engine.import_request(snap, receiver.segments())
    with evaluated_tokens(b.engine) as evaluated:
        assert run_all(b.engine)["i"].outputs[0].token_ids == expected
    assert snap.num_computed_tokens == len(a.tokenizer.encode(PROMPT)) + 4  # 5 tokens sampled, the 5th not in KV
    assert evaluated == [missing_tokens(len(a.tokenizer.encode(PROMPT)), len(expected), snap.num_computed_tokens)]


def test_llama_cpp_seeded_sample_continues_its_random_stream(llama_pair):
    a, b = llama_pair
    params = cllm.SamplingParams(max_tokens=16, temperature=0.9, seed=1234)
    expected = reference(a, PROMPT, params)
    a.engine.add_request(PROMPT, params, request_id="s")
    steps(a.engine, 6)
    hand_off(a.engine, b.engine, "s", chunk_bytes=1 << 20)
    assert run_all(b.engine)["s"].outputs[0].token_ids == expected


def test_torch_hand_off_scatter_gathers_over_non_contiguous_blocks(torch_pair, tiny_llama):
    """Two requests decode together on A (so their block tables interleave), both move to B between
    the same two steps, and finish there in the same batch: every step evaluates what a single engine
    would. The reference runs on a third, fresh engine: the torch backend always caches prefixes,
    and a cache hit changes how a prompt is evaluated (docs/reproducibility.md)."""
    a, b = torch_pair
    params = cllm.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = {"h": [5, 17, 42, 99, 7, 250, 31], "other": [64, 3, 128, 11, 200]}
    with cllm.LLM(model=tiny_llama, **TORCH_SETTINGS) as ref:
        for rid, prompt in prompts.items():
            ref.engine.add_request(prompt, params, request_id=rid)
        expected = {rid: out.outputs[0].token_ids for rid, out in run_all(ref.engine).items()}
    for rid, prompt in prompts.items():
        a.engine.add_request(prompt, params, request_id=rid)
    steps(a.engine, 10)
    blocks = list(a.engine.backend.blocks.sequence("h").block_ids)
    assert any(y != x + 1 for x, y in zip(blocks, blocks[1:])), blocks  # gathered from scattered blocks
    reports = [hand_off(a.engine, b.engine, rid, chunk_bytes=4096) for rid in prompts]
    assert all(r.num_chunks > 1 for r in reports)
    assert a.engine.backend.blocks.num_used_blocks == 0
    with evaluated_tokens(b.engine) as evaluated:
        outs = run_all(b.engine)
    assert {rid: out.outputs[0].token_ids for rid, out in outs.items()} == expected
    assert evaluated == [sum(missing_tokens(len(prompts[r.request_id]), 24, r.kv_tokens) for r in reports)]
    assert b.engine.backend.blocks.num_used_blocks == 0  # every block given back


def test_llama_cpp_constrained_request_keeps_its_grammar_through_a_hand_off(llama_pair):
    """The receiving engine restarts the request's grammar matcher and replays the tokens so far, so
    the output stays inside the grammar and equals the output without a hand-off."""
    a, b = llama_pair
    params = cllm.SamplingParams(max_tokens=40, temperature=0, json_object=True)
    prompt = "Describe a cat as a JSON object:"
    expected = reference(a, prompt, params)
    a.engine.add_request(prompt, params, request_id="j")
    steps(a.engine, 6)
    report = hand_off(a.engine, b.engine, "j", chunk_bytes=1 << 20)
    assert report.kv_tokens > 0
    with evaluated_tokens(b.engine) as evaluated:
        out = run_all(b.engine)["j"].outputs[0]
    assert out.token_ids == expected
    assert evaluated == [missing_tokens(len(a.tokenizer.encode(prompt)), len(expected), report.kv_tokens)]
    assert out.text.lstrip().startswith("{")
