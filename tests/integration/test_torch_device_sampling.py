"""The torch backend handing its logits to the engine as a tensor (sampler="torch"), on the real model.

On CUDA this keeps the logits on the GPU; on CPU it runs the same code path. The
same engine then runs with host logits (the numpy sampler) for comparison: the
prompts are shorter than a KV block, so no prefix-cache hit changes how the
second run computes, the logits are the same, greedy tokens are equal and
logprobs agree to the float rounding of the two log-softmax implementations.
A seeded request repeats itself exactly.
"""
from __future__ import annotations

import numpy as np
import torch

import cllm

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = cllm.SamplingParams(max_tokens=12, temperature=0, logprobs=2)
SEEDED = cllm.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=1234, repetition_penalty=1.1)


def test_device_sampler_in_the_engine_matches_the_numpy_sampler(monkeypatch):
    with cllm.LLM(backend="torch", dtype="float32", device="cpu", n_threads=1, n_ctx=512, n_seq_max=4,
                  sampler="torch") as llm:
        backend = llm.engine.backend
        assert backend.blocks.block_size > max(len(llm.tokenizer.encode(p)) for p in PROMPTS)
        original, seen = backend.forward_batch, []

        def spy(*args, **kwargs):
            out = original(*args, **kwargs)
            seen.append(type(out))
            return out

        monkeypatch.setattr(backend, "forward_batch", spy)
        on_device = llm.generate(PROMPTS, GREEDY)
        seeded = [llm.generate(PROMPTS[:1], SEEDED)[0].outputs[0].token_ids for _ in range(2)]
        assert seen and set(seen) == {torch.Tensor}
        seen.clear()
        backend._device_sampling = False  # the same engine with host logits and the numpy sampler
        on_host = llm.generate(PROMPTS, GREEDY)
        assert seen and set(seen) == {np.ndarray}
    for a, b in zip(on_device, on_host):
        ta, tb = a.outputs[0], b.outputs[0]
        assert ta.token_ids == tb.token_ids and ta.text == tb.text
        for la, lb in zip(ta.logprobs, tb.logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-4
            assert [t.token_id for t in la.top] == [t.token_id for t in lb.top]
    assert "Paris" in on_device[0].outputs[0].text
    assert len(seeded[0]) == 12 and seeded[0] == seeded[1]
