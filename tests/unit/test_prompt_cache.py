"""The llama.cpp backend's host prompt cache: lookup by longest prefix, LRU within a byte bound."""
from __future__ import annotations

import random

import pytest

from cllm.backends.llama_cpp.prompt_cache import PromptCache
from cllm.backends.llama_cpp.sizing import prompt_cache_bytes
from cllm.backends.llama_cpp.slot_pool import common_prefix_len


def test_take_returns_the_longest_prefix_and_removes_it():
    cache = PromptCache(capacity_bytes=100)
    cache.put([1, 2, 3, 4, 5], b"a" * 10)
    cache.put([1, 2, 9], b"b" * 10)
    cache.put([7, 8], b"c" * 10)
    entry, n = cache.take([1, 2, 3, 4, 6, 6], min_match=2)
    assert entry.tokens == (1, 2, 3, 4, 5) and entry.state == b"a" * 10 and n == 4
    assert len(cache) == 2 and cache.num_bytes == 20
    assert cache.take([1, 2, 3, 4, 6, 6], min_match=3) is None  # (1, 2, 9) shares only 2
    assert cache.take([5, 5], min_match=0) is None  # nothing shares a token
    entry, n = cache.take([7, 8], min_match=2)
    assert entry.tokens == (7, 8) and n == 2


def test_byte_bound_evicts_the_oldest_and_an_oversized_state_is_not_kept():
    cache = PromptCache(capacity_bytes=25)
    cache.put([1], b"x" * 10)
    cache.put([2], b"y" * 10)
    cache.put([1], b"z" * 10)  # saved again: now the newest, one entry
    cache.put([3], b"w" * 10)  # 30 bytes: the oldest ([2]) goes
    assert len(cache) == 2 and cache.num_bytes == 20
    assert cache.take([2], min_match=1) is None and cache.take([1], min_match=1)[0].state == b"z" * 10
    cache.put([4], b"v" * 26)
    assert cache.take([4], min_match=1) is None and len(cache) == 1
    with pytest.raises(ValueError):
        PromptCache(capacity_bytes=-1)


def test_bisection_finds_what_a_full_scan_finds():
    rng = random.Random(0)
    cache = PromptCache(capacity_bytes=1 << 30)
    keys = [[rng.randrange(4) for _ in range(rng.randrange(1, 9))] for _ in range(300)]
    for k in keys:
        cache.put(k, b"s")
    stored = {tuple(k) for k in keys}
    for _ in range(300):
        query = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        best = max(common_prefix_len(k, query) for k in stored)
        got = cache.take(query, min_match=1)
        assert (got[1] if got else 0) == best
        if got:
            stored.discard(got[0].tokens)
            cache.put(list(got[0].tokens), b"s")  # put it back: the next query sees the same set
            stored.add(got[0].tokens)


def test_prompt_cache_bytes_defaults_to_an_eighth_of_memory_at_most_8_gib():
    assert prompt_cache_bytes(None, available_bytes=16 << 30) == 2 << 30
    assert prompt_cache_bytes(None, available_bytes=256 << 30) == 8 << 30
    assert prompt_cache_bytes(64, available_bytes=16 << 30) == 64 << 20
    assert prompt_cache_bytes(0, available_bytes=16 << 30) == 0
