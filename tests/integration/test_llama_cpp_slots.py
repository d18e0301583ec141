"""Issue 9 defects 8 and 9 on the real model: which slot a prompt takes, and what it reports cached."""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import numpy as np
import pytest

import cllm

GREEDY = cllm.SamplingParams(max_tokens=8, temperature=0)
CONVERSATION = [{"role": "user", "content": "Tell me a long story about a dragon who learns to bake bread. " * 8}]


@pytest.fixture()
def llm():
    with cllm.LLM(n_threads=1, n_seq_max=4) as llm:
        yield llm


@pytest.mark.parametrize("prompt_cache_mib", [None, 0])
def test_unrelated_prompt_leaves_a_cached_conversation_alone(prompt_cache_mib):
    # "Hi" shares only the chat header: cutting the conversation's slot in place would lose more than
    # it keeps, so "Hi" takes an empty slot, with or without the host prompt cache (which would
    # otherwise have to take the conversation), and the conversation comes back whole.
    with cllm.LLM(n_threads=1, n_seq_max=4, prompt_cache_mib=prompt_cache_mib) as llm:
        llm.chat(CONVERSATION, GREEDY)
        backend = llm.engine.backend
        held = [s for s in backend._pool.idle() if s.tokens]
        assert len(held) == 1 and len(held[0].tokens) > 100
        conversation_tokens = list(held[0].tokens)
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY)  # shares only the chat header
        in_slots = any(s.tokens == conversation_tokens for s in backend._pool.idle())
        assert in_slots and len(backend._saved) == 0
        again = llm.chat(CONVERSATION, GREEDY)[0]
    assert again.usage.cached_tokens >= len(conversation_tokens) - 9  # the whole prompt but its last token


class _NoPartialRemoval:
    """The llama.cpp context as a recurrent model's memory behaves: partial seq_rm is refused."""

    def __init__(self, ctx):
        self._ctx = ctx

    def seq_rm(self, seq_id, p0=-1, p1=-1):
        if p0 > 0:
            return False
        return self._ctx.seq_rm(seq_id, p0, p1)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def test_refused_partial_removal_reports_nothing_cached_and_decodes_correctly():
    prompt_a = "The history of bread begins in the ancient Near East, where people"
    prompt_b = "The history of bread begins in the ancient Near East. Later, in Rome,"
    with cllm.LLM(n_threads=1, n_seq_max=2, prefix_cache=False) as plain:
        expected = plain.generate([prompt_b], GREEDY)[0].outputs[0].token_ids
    with cllm.LLM(n_threads=1, n_seq_max=1, slot_prompt_similarity=0.1) as llm:
        backend = llm.engine.backend
        backend._ctx = _NoPartialRemoval(backend._ctx)
        llm.generate([prompt_a], GREEDY)
        out = llm.generate([prompt_b], GREEDY)[0]
    assert out.usage.cached_tokens == 0  # the slot had to be emptied, and admit says so
    assert out.outputs[0].token_ids == expected  # both evaluated the whole prompt fresh and alone


def test_llama_cpp_warnings_reach_python_logging_at_warning_level(caplog):
    # Issue 9 defect 10: one sequence with n_ctx above the trained context makes llama.cpp warn.
    caplog.set_level(logging.DEBUG, logger="cllm.llama_cpp")
    with cllm.LLM(n_threads=1, n_seq_max=1, n_ctx=16384):
        pass
    warnings = [r for r in caplog.records if r.name == "cllm.llama_cpp" and r.levelno == logging.WARNING]
    assert any("n_ctx_train" in r.getMessage() for r in warnings)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records if r.name == "cllm.llama_cpp")
    assert any(r.levelno == logging.DEBUG for r in caplog.records if r.name == "cllm.llama_cpp")  # load chatter


def test_rolled_back_admission_is_not_counted_in_prefix_stats(llm):
    # Issue 9: an admission the scheduler rolls back (no KV room) is retried later; counting it at
    # admission counted its prompt and its hit twice. Stats count a sequence when it first runs.
    prompt = "The history of bread begins in the ancient Near East, where people first ground grain"
    llm.generate([prompt], GREEDY)
    backend = llm.engine.backend
    before = backend.prefix_cache_stats()
    ids = llm.engine.tokenize_prompt(prompt)
    assert backend.admit("rolled-back", ids).num_cached_tokens > 0
    backend.release("rolled-back")
    assert backend.prefix_cache_stats() == before
    out = llm.generate([prompt], GREEDY)[0]
    queried, hits = backend.prefix_cache_stats()
    assert (queried - before[0], hits - before[1]) == (len(ids), out.usage.cached_tokens)
    assert out.usage.cached_tokens > 0


def test_kv_unified_head_that_cannot_reserve_is_not_readmitted_every_step():
    # Issue 9 defect 6 on the real backend: with one shared KV pool too small for both requests, the
    # second waits; its admission (prefix scan, truncation, seq_cp) runs once while the first decodes,
    # and again once the first has finished, not on every one of the first's steps.
    with cllm.LLM(n_threads=1, n_seq_max=2, kv_unified=True, n_ctx=256) as llm:
        backend = llm.engine.backend
        admits: list[str] = []
        real_admit = backend.admit

        def counting_admit(sequence_id, token_ids):
            admits.append(sequence_id)
            return real_admit(sequence_id, token_ids)
        backend.admit = counting_admit
        long_prompt = "The history of bread begins in the ancient Near East. " * 12  # ~130 tokens
        params = cllm.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        first, second = llm.generate([long_prompt, "Tell me about rivers. " + long_prompt], params)
    assert first.outputs[0].finish_reason == second.outputs[0].finish_reason == "length"
    assert len(first.outputs[0].token_ids) == len(second.outputs[0].token_ids) == 40
    counts = collections.Counter(admits)
    # the waiting one: refused at least once, admitted once after; 40 decode steps, not 40 admissions
    assert len(counts) == 2 and 2 <= max(counts.values()) <= 3, counts


def test_batch_reaches_llama_cpp_in_seq_id_order_and_logits_come_back_in_the_callers():
    """llama.cpp's split KV cache micro-batches only consecutive seq_ids in batch order, so the backend
    sorts the batch by seq_id; the caller's order must not matter at all (same micro-batches: bit-exact)."""
    from cllm.backends.llama_cpp.backend import LlamaCppBackend
    from cllm.config import load_config

    seen: list[list[int]] = []

    class Recording(LlamaCppBackend):
        def _run_decode(self) -> int:
            seen.append(self._batch.seq[: self._batch.struct.n_tokens].tolist())
            return super()._run_decode()

    prompts = {"a": [1, 504, 3101, 288], "b": [1, 9906, 17, 3224, 42, 7], "c": [1, 2000, 30]}

    def run(order: list[str]) -> dict[str, np.ndarray]:
        backend = Recording(load_config(environ={}, n_threads=1, n_seq_max=6, n_ctx=6 * 256, prefix_cache=False))
        try:
            # seq_ids in admission order: 'c' gets 0, 'a' 1, 'b' 2 -- the batch order below differs
            for sid in ("c", "a", "b"):
                backend.admit(sid, prompts[sid])
                backend.reserve(sid, 16)
            flat = [t for s in order for t in prompts[s]]
            pos = [i for s in order for i in range(len(prompts[s]))]
            ids = [s for s in order for _ in prompts[s]]
            rows = backend.forward_batch(flat, pos, ids, all_logits_for=["b"])
            return {"last": rows[:3], "b_all": rows[3:], "wanted": list(dict.fromkeys(order))}
        finally:
            backend.close()

    first, second = run(["a", "b", "c"]), run(["b", "c", "a"])
    assert all(batch == sorted(batch) for batch in seen) and len(seen) == 2
    for name in ("a", "b", "c"):  # rows come back in the caller's order of first appearance
        i, j = first["wanted"].index(name), second["wanted"].index(name)
        np.testing.assert_array_equal(first["last"][i], second["last"][j])
    assert first["b_all"].shape[0] == len(prompts["b"])
    np.testing.assert_array_equal(first["b_all"], second["b_all"])
    np.testing.assert_array_equal(first["b_all"][-1], first["last"][first["wanted"].index("b")])


@pytest.mark.parametrize("prompt_cache_mib", [None, 0])
def test_a_short_prompt_seen_before_is_not_prefilled_again(prompt_cache_mib):
    # The cached slot holds prompt + output: cutting it in place would lose more than it keeps, so
    # the prompt takes an empty slot and the prefix is copied over (save + load: ~1 ms here), with
    # or without the host prompt cache.
    prompt = "The quick brown fox jumps over the lazy dog near the river bank."
    params = cllm.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with cllm.LLM(n_threads=1, n_seq_max=4, prompt_cache_mib=prompt_cache_mib) as llm:
        first = llm.generate([prompt], params)[0]
        assert 8 <= len(first.prompt_token_ids) < 32
        again = llm.generate([prompt], params)[0]
        assert again.usage.cached_tokens == len(again.prompt_token_ids) - 1
        n = len(first.prompt_token_ids)
        holders = [s for s in llm.engine.backend._pool.idle() if s.tokens[:n] == first.prompt_token_ids]
        saved = llm.engine.backend._saved
    assert len(holders) == 2 and len(saved) == 0  # the first request's cache is still whole beside the copy


def test_a_prompt_evicted_from_its_slot_comes_back_from_the_host_prompt_cache():
    # The only slot is taken by another prompt: the first prompt's KV goes to host memory and is
    # loaded back for its return, bit-exact with a run whose slot was never taken.
    prompt = "The history of bread begins in the ancient Near East, where people first ground wild grain"
    other = "Write a haiku about the sea at night, with the moon on the water"
    with cllm.LLM(n_threads=1, n_seq_max=4, prompt_cache_mib=0) as roomy:
        roomy.generate([prompt], GREEDY)
        roomy.generate([other], GREEDY)  # takes an empty slot: nothing evicted
        assert sum(1 for s in roomy.engine.backend._pool.idle() if s.tokens) == 2
        expected = roomy.generate([prompt], GREEDY)[0]
    assert expected.usage.cached_tokens == len(expected.prompt_token_ids) - 1
    for mib in (None, 0):  # default on; 0 = off, and the prompt is prefilled again
        with cllm.LLM(n_threads=1, n_seq_max=1, prompt_cache_mib=mib) as llm:
            llm.generate([prompt], GREEDY)
            llm.generate([other], GREEDY)
            assert len(llm.engine.backend._saved) == (0 if mib == 0 else 1)
            out = llm.generate([prompt], GREEDY)[0]
        if mib is None:
            assert out.usage.cached_tokens == expected.usage.cached_tokens
            assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        else:  # a whole-prompt prefill: other kernels than one token's, so no bit-exactness asserted
            assert out.usage.cached_tokens == 0


def test_an_idle_server_engine_saves_finished_sequences_before_their_slots_are_needed():
    # The server's engine (AsyncLLM) copies finished sequences' KV to the host prompt cache while it
    # has nothing else to do, once their clients are no longer expected back (BURST_EXPECT_WITHIN_S),
    # so the prompts that later take those slots find the copies made instead of making them in
    # front of their own prefill; a returning prompt still comes back from the cache.
    prompts = [f"Question {i}: how did people bake bread in the villages of country number {i}?" for i in range(2)]
    others = [f"Write a haiku about the sea at night, number {i}, with the moon on the water" for i in range(2)]
    params = cllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        engine = cllm.AsyncLLM(n_threads=1, n_seq_max=2)
        backend = engine.engine.backend

        async def run(prompt):
            async for out in engine.generate(prompt, params):
                final = out
            return final

        try:
            await asyncio.gather(*(run(p) for p in prompts))
            held = [list(s.tokens) for s in backend._pool.idle() if s.tokens]
            at_finish = sum(t in backend._saved for t in held)  # their clients may still come back
            deadline = time.monotonic() + 10
            while not all(t in backend._saved for t in held) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            saved_idle = sum(t in backend._saved for t in held)
            saves = []
            save_seq = backend._ctx.save_seq
            backend._ctx.save_seq = lambda seq_id: saves.append(seq_id) or save_seq(seq_id)
            await asyncio.gather(*(run(p) for p in others))  # they take both slots
            evicting_saves = len(saves)
            again = await run(prompts[0])
        finally:
            await engine.shutdown(0)
        return held, at_finish, saved_idle, evicting_saves, again

    held, at_finish, saved_idle, evicting_saves, again = asyncio.run(main())
    assert len(held) == 2 and at_finish == 0 and saved_idle == 2
    assert evicting_saves == 0
    assert again.usage.cached_tokens == len(again.prompt_token_ids) - 1


def test_idle_copies_are_bounded_in_size(monkeypatch):
    # A request arriving while the idle engine copies a slot waits for that copy, so only states up
    # to IDLE_SAVE_MAX_BYTES are copied ahead; a longer one is copied when a prompt evicts it.
    from cllm.backends.llama_cpp import backend as llama_backend
    short = "The quick brown fox jumps over the lazy dog."
    long = "Tell me a long story about a dragon who learns to bake bread. " * 6
    params = cllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        engine = cllm.AsyncLLM(n_threads=1, n_seq_max=2)
        backend = engine.engine.backend
        monkeypatch.setattr(llama_backend, "IDLE_SAVE_MAX_BYTES", 40 * backend._kv_bytes_per_token)

        async def run(prompt):
            async for out in engine.generate(prompt, params):
                final = out
            return final

        try:
            await asyncio.gather(run(short), run(long))
            held = sorted((list(s.tokens) for s in backend._pool.idle() if s.tokens), key=len)
            deadline = time.monotonic() + 10
            while held[0] not in backend._saved and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            return [len(t) for t in held], [t in backend._saved for t in held]
        finally:
            await engine.shutdown(0)

    lengths, saved = asyncio.run(main())
    assert lengths[0] <= 40 < lengths[1]
    assert saved == [True, False]
