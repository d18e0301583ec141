"""Decode-graph buckets and padding (cllm/backends/torch/cuda_graphs.py), on CPU without capture.

The captured CUDA graphs replay exactly the step run here over the same static
buffers; what CPU can check is the part that decides correctness: bucket choice,
padding rows confined to the scratch block, and real rows unchanged by padding
(up to the GEMM kernel picked for a larger batch: float rounding, ATOL).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.backends.torch.attention import SeqChunk, build_attention_batch
from cllm.backends.torch.backend import TorchBackend
from cllm.backends.torch.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets, pad_decode
from cllm.config import load_config

ATOL = 1e-5
BLOCK = 4


def test_buckets_cover_every_batch_size_with_little_padding():
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and graph_buckets(256)[-1] == 256
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20] and graph_buckets(1) == [1] and graph_buckets(3) == [1, 2, 3]
    buckets = graph_buckets(64)
    for n in range(1, 65):
        b = bucket_for(n, buckets)
        assert b is not None and n <= b and (b - n < 8 or n <= 4) and b in buckets
    assert bucket_for(65, buckets) is None  # larger steps run eagerly


def test_pad_decode_adds_scratch_rows_and_refuses_prefill_chunks():
    chunks = [SeqChunk(0, 1, 9, (3, 5, 7)), SeqChunk(1, 1, 2, (1,))]
    ids, padded = pad_decode(np.array([11, 12]), chunks, 4, scratch_block=99)
    assert ids.tolist() == [11, 12, 0, 0]
    assert padded[:2] == chunks and all(p.block_ids == (99,) and p.start_pos == 0 and p.num_tokens == 1 for p in padded[2:])
    assert [p.row_start for p in padded] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="pure decode"):
        pad_decode(np.array([1, 2, 3]), [SeqChunk(0, 3, 0, (1,))], 4, scratch_block=99)


@pytest.fixture(scope="module", params=["native", "transformers"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TorchBackend:
    """The native decoder, and the generic path (transformers' forward over the pool), whose decode steps
    the graphs also capture on CUDA."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    built = TorchBackend(load_config(environ={}, backend="torch", model=str(path), dtype="float32", device="cpu",
                                     block_size=BLOCK, n_ctx=128, n_seq_max=8, n_threads=1, attention="flex",
                                     model_impl=request.param))
    assert built.model_impl == request.param
    return built


def test_padding_rows_leave_real_rows_and_their_kv_unchanged(backend: TorchBackend) -> None:
    rng = np.random.default_rng(0)
    prompts = {"a": 7, "b": 12, "c": 3}
    for seq, n in prompts.items():
        tokens = rng.integers(0, 300, size=n).tolist()
        assert backend.admit(seq, tokens) is not None
        backend.forward_batch(tokens, list(range(n)), [seq] * n)
    for seq, n in prompts.items():
        assert backend.reserve(seq, n + 1)
    ids = rng.integers(0, 300, size=3)
    chunks = [SeqChunk(i, 1, n, backend.blocks.sequence(seq).block_ids) for i, (seq, n) in enumerate(prompts.items())]
    scratch = backend._scratch_block
    real_blocks = [b for c in chunks for b in c.block_ids]
    assert scratch not in real_blocks and scratch == backend.blocks.num_blocks  # no sequence can own it
    with torch.inference_mode():
        batch = build_attention_batch(chunks, backend.kv, q_per_kv=2, mode="flex", flex_fn=backend._flex_fn)
        eager = backend.model(torch.from_numpy(ids), torch.tensor(list(prompts.values())), backend.kv,
                              batch, torch.arange(3))
        kv_before = backend.kv.k.clone(), backend.kv.v.clone()
        graphs = DecodeGraphs(backend.model, backend.kv, buckets=graph_buckets(8), scratch_block=scratch,
                              flex_fn=backend._flex_fn, capture=False, q_per_kv=2)
        padded = graphs.run(ids, chunks)  # bucket 4: one padding row
        np.testing.assert_allclose(padded.numpy(), eager.numpy(), atol=ATOL, rtol=0)
        again = graphs.run(ids, chunks)  # the bucket's buffers are reused
        np.testing.assert_allclose(again.numpy(), padded.numpy(), atol=0, rtol=0)
        # six rows (each sequence twice, writing the same K/V to the same slots) -> bucket 8, two pads
        twice = chunks + [SeqChunk(3 + i, 1, c.start_pos, c.block_ids) for i, c in enumerate(chunks)]
        more = graphs.run(np.concatenate([ids, ids]), twice)
        np.testing.assert_allclose(more[:3].numpy(), eager.numpy(), atol=ATOL, rtol=0)
    # Padding wrote only the scratch block: every other block's K/V is as the eager step left it.
    for before, after in zip(kv_before, (backend.kv.k, backend.kv.v)):
        keep = torch.ones(before.shape[2], dtype=torch.bool)
        keep[scratch] = False
        np.testing.assert_allclose(after[:, :, keep].numpy(), before[:, :, keep].numpy(), atol=ATOL, rtol=0)
    assert len(graphs._by_size) == 2 and all(b.graph is None for b in graphs._by_size.values())


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_a_tail_after_a_cached_prefix_attends_as_its_own_prefill_would(tmp_path: "pytest.TempPathFactory", attention: str) -> None:
    """A short chunk after a cached prefix joins the step's decode group, one query per token
    (attention.is_tail): its logits equal those of the same tokens evaluated in one prefill, within
    float32 rounding (the kernels differ), alone and beside another sequence's decode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    backend = TorchBackend(load_config(environ={}, backend="torch", model=str(tmp_path), dtype="float32", device="cpu",
                                       block_size=BLOCK, n_ctx=256, n_seq_max=8, n_threads=1, attention=attention))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 300, size=19).tolist()
    other = rng.integers(0, 300, size=7).tolist()
    assert backend.admit("whole", tokens, reuse_prefix=False) is not None and backend.reserve("whole", 19)
    whole = np.asarray(backend.forward_batch(tokens, list(range(19)), ["whole"] * 19, all_logits_for=["whole"]))[1:]
    # the same tokens: 12 first (three whole blocks), then a 7-token tail beside a decode of "other"
    for seq, toks in (("split", tokens[:12]), ("other", other)):
        assert backend.admit(seq, toks, reuse_prefix=False) is not None and backend.reserve(seq, 20)
        backend.forward_batch(toks, list(range(len(toks))), [seq] * len(toks))
    tail = tokens[12:]
    logits = np.asarray(backend.forward_batch([5] + tail, [7] + list(range(12, 19)), ["other"] + ["split"] * 7,
                                              logits_for=["other", "split"], all_logits_for=["split"]))
    np.testing.assert_allclose(logits[2:], whole[12:], atol=1e-4, rtol=0)  # every tail token's logits
    np.testing.assert_allclose(logits[1], whole[18], atol=1e-4, rtol=0)


def test_the_capture_check_replays_on_other_inputs_than_the_capture_s(backend: TorchBackend) -> None:
    """DecodeGraphs.check, run after each capture: a replay that computes the step passes; one that
    returns what the capture's own inputs gave (a frozen step) is refused."""
    graphs = DecodeGraphs(backend.model, backend.kv, buckets=graph_buckets(8), scratch_block=backend._scratch_block,
                          flex_fn=backend._flex_fn, capture=False, q_per_kv=2)
    with torch.inference_mode():
        bucket = graphs._bucket(8)  # built on padding rows, as a capture is
        frozen = graphs._step(bucket).clone()
        graphs.check(bucket, replay=lambda: graphs._step(bucket))
        with pytest.raises(RuntimeError, match="captured graph of 8 rows gave logits"):
            graphs.check(bucket, replay=lambda: frozen)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_mixed_steps_run_decodes_and_tails_through_the_graphs_and_keep_every_row(tmp_path, model_impl: str) -> None:
    """Steps with decodes and short tails (attention.is_tail) beside other chunks
    (TorchBackend._forward_split): the decodes and the tails' tokens go through the graph buckets, one
    row each, the rest eagerly; a tail that no longer fits the largest bucket runs eagerly too. Every
    requested row (logits_for in any order, every row of an all_logits_for sequence) matches the one
    eager step of a backend without graphs, within float32 rounding (the kernels differ), and so does
    the K/V both leave behind."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    backends = [TorchBackend(load_config(environ={}, backend="torch", model=str(tmp_path), dtype="float32", device="cpu",
                                         block_size=BLOCK, n_ctx=256, n_seq_max=8, n_threads=1, attention="flex",
                                         model_impl=model_impl))
                for _ in range(2)]
    split, eager = backends
    split._graphs = DecodeGraphs(split.model, split.kv, buckets=graph_buckets(8), scratch_block=split._scratch_block,
                                 flex_fn=split._flex_fn, capture=False, q_per_kv=2)
    rng = np.random.default_rng(2)
    prompts = {seq: rng.integers(0, 300, size=n).tolist() for seq, n in (("a", 9), ("b", 14), ("c", 5), ("e", 3))}
    fresh = rng.integers(0, 300, size=11).tolist()  # "d": a new prompt, prefilled in a mixed step
    tail_c, tail_e = rng.integers(0, 300, size=6).tolist(), rng.integers(0, 300, size=7).tolist()
    long_c = rng.integers(0, 300, size=40).tolist()  # longer than a tail: a chunk of its own
    steps = [  # (flat ids, positions, sequences, logits_for, all_logits_for)
        # decodes of a and b, a fresh prefill, c's tail: a, b and c's 6 tokens through bucket 8, d eagerly
        ([7, *fresh, 8, *tail_c], [9, *range(11), 14, *range(5, 11)], ["a"] + ["d"] * 11 + ["b"] + ["c"] * 6,
         ["c", "b", "d", "a"], ["c"]),
        # decodes and a tail only, 3 + 7 rows: more than bucket 8 holds, so e's tail runs eagerly
        ([5, 6, 9, *tail_e], [10, 15, 11, *range(3, 10)], ["a", "b", "d"] + ["e"] * 7, ["e", "a", "d", "b"], ["e"]),
        # a decode beside a chunk too long to be a tail
        ([4, *long_c], [11, *range(11, 51)], ["a"] + ["c"] * 40, ["a", "c"], ()),
    ]
    results: list[list[np.ndarray]] = [[], []]
    for b, out in zip(backends, results):
        for seq, toks in prompts.items():
            assert b.admit(seq, toks, reuse_prefix=False) is not None and b.reserve(seq, len(toks) + 50)
            b.forward_batch(toks, list(range(len(toks))), [seq] * len(toks))
        assert b.admit("d", fresh, reuse_prefix=False) is not None and b.reserve("d", len(fresh) + 2)
        for flat, pos, seqs, logits_for, all_for in steps:
            out.append(np.asarray(b.forward_batch(flat, pos, seqs, logits_for=logits_for, all_logits_for=all_for)))
    assert [r.shape[0] for r in results[0]] == [4 + 6, 4 + 7, 2]
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert sorted(split._graphs._by_size) == [1, 4, 8]  # 8 rows, then 3 (e's tail eagerly), then 1
    for a, b in ((split.kv.k, eager.kv.k), (split.kv.v, eager.kv.v)):
        keep = torch.ones(a.shape[2], dtype=torch.bool)
        keep[split._scratch_block] = False
        np.testing.assert_allclose(a[:, :, keep].numpy(), b[:, :, keep].numpy(), atol=1e-4, rtol=0)


def test_the_persistent_batch_rewrites_only_rows_whose_table_changed(backend: TorchBackend, monkeypatch) -> None:
    """The buckets' host mirror after each step equals a fresh rebuild of every input, while only rows that
    hold another sequence, or whose sequence reached a new block, have their mask rows rebuilt, and only
    those and rows not one token further have their KV write slot looked up (the others' advance by one)."""
    from cllm.backends.torch import cuda_graphs

    rebuilt: list[int] = []  # rows of mask arrays rebuilt
    looked_up: list[int] = []  # rows whose write slot was looked up in their table
    for name, counts in (("decode_mask_arrays", rebuilt), ("slot_mapping", looked_up)):
        original = getattr(cuda_graphs, name)
        monkeypatch.setattr(cuda_graphs, name, lambda first, *args, _f=original, _c=counts, **kw: (
            _c.append(len(first)), _f(first, *args, **kw))[1])
    graphs = DecodeGraphs(backend.model, backend.kv, buckets=graph_buckets(8), scratch_block=backend._scratch_block,
                          flex_fn=backend._flex_fn, capture=False, q_per_kv=2)
    a, b, c = [10, 11, 17], [12, 13, 14, 18], [15]  # block tables (BLOCK = 4 tokens each)

    def step(rows: list[tuple[list[int], int]]) -> tuple[int, int]:
        chunks = [SeqChunk(i, 1, pos, table) for i, (table, pos) in enumerate(rows)]
        ids = np.arange(len(rows), dtype=np.int64) + 7
        size = bucket_for(len(rows), graphs.buckets)
        padded_ids, padded = pad_decode(ids, chunks, size, backend._scratch_block)
        bucket = graphs._bucket(size)
        rebuilt.clear(), looked_up.clear()  # (building the bucket rebuilds its idle rows once)
        graphs._fill(bucket, padded_ids, padded)
        counts = sum(rebuilt), sum(looked_up)
        for name, values in graphs._arrays(padded_ids, padded).items():
            np.testing.assert_array_equal(bucket.inputs.host[name], values, err_msg=name)
        return counts

    # (tables rebuilt, slots looked up); the padding row sits at position 0 every step: always looked up
    assert step([(a, 5), (b, 8), (c, 2)]) == (4, 4)  # first use of bucket 4: every row (3 + 1 padding)
    assert step([(a, 6), (b, 9), (c, 3)]) == (0, 1)  # each sequence one further, no new block: only the padding
    c.append(16)
    assert step([(a, 7), (b, 10), (c, 4)]) == (1, 2)  # c reached its second block
    assert step([(a, 7), (b, 11), (c, 5)]) == (0, 2)  # a stayed at its position: looked up again
    assert step([(b, 12), (a, 8), (c, 6)]) == (2, 3)  # two rows changed hands
    a = list(a)  # a table replaced (a sequence cut back): its row is rewritten even with equal contents
    assert step([(b, 13), (a, 9), (c, 7)]) == (1, 2)
    assert step([(b, 14), (a, 10)]) == (2, 2)  # bucket 2 first used: both rows


def test_a_step_launched_ahead_takes_its_ids_on_the_device(backend: TorchBackend) -> None:
    """The lookahead's decode step (ids a device tensor, copied into the graph's ids buffer after the host's
    inputs) computes exactly what the same step with host ids does."""
    rng = np.random.default_rng(5)
    for seq, n in (("x", 6), ("y", 10)):
        tokens = rng.integers(0, 300, size=n).tolist()
        assert backend.admit(seq, tokens) is not None and backend.reserve(seq, n + 1)
        backend.forward_batch(tokens, list(range(n)), [seq] * n)
    chunks = [SeqChunk(i, 1, n, backend.blocks.sequence(seq).block_ids) for i, (seq, n) in enumerate((("x", 6), ("y", 10)))]
    graphs = DecodeGraphs(backend.model, backend.kv, buckets=graph_buckets(8), scratch_block=backend._scratch_block,
                          flex_fn=backend._flex_fn, capture=False, q_per_kv=2)
    ids = np.array([17, 42], dtype=np.int64)
    with torch.inference_mode():
        on_host = graphs.run(ids, chunks).clone()
        on_device = graphs.run(torch.from_numpy(ids), chunks).clone()
    np.testing.assert_array_equal(on_device.numpy(), on_host.numpy())
