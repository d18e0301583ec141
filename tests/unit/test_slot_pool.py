"""The llama.cpp seq_id pool's bookkeeping under threads (no model needed)."""
from __future__ import annotations

import threading

import pytest

from cllm.backends.llama_cpp.slot_pool import SeqSlotPool, common_prefix_len


def test_acquire_release_is_exclusive_under_threads():
    pool = SeqSlotPool(size=4)
    errors: list[str] = []
    holders: dict[int, str] = {}
    guard = threading.Lock()

    def worker(t: int) -> None:
        for i in range(300):
            rid = f"t{t}-{i}"
            with pool.lock:
                idle = pool.idle()
                if not idle:
                    continue
                slot = pool.acquire(rid, idle[0])
            with guard:
                if slot.seq_id in holders:
                    errors.append(f"seq {slot.seq_id} held by {holders[slot.seq_id]} and {rid}")
                holders[slot.seq_id] = rid
            with guard:
                holders.pop(slot.seq_id)
            pool.release(rid)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert pool.num_in_use() == 0 and len(pool.idle()) == 4


def test_double_acquire_and_foreign_slot_rejected():
    pool = SeqSlotPool(size=2)
    slot = pool.idle()[0]
    pool.acquire("a", slot)
    with pytest.raises(ValueError):
        pool.acquire("b", slot)
    with pytest.raises(ValueError):
        pool.acquire("a", pool.idle()[0])
    assert pool.release("a") is slot and pool.release("a") is None


def test_best_prefix_prefers_longest_then_idle():
    pool = SeqSlotPool(size=3)
    s0, s1, s2 = pool.idle()
    s0.tokens, s1.tokens, s2.tokens = [1, 2, 3], [1, 2, 3, 4], [9]
    pool.acquire("live", s1)
    match = pool.best_prefix([1, 2, 3, 4, 5])
    assert match.slot is s1 and match.length == 4
    assert common_prefix_len([1, 2], [1, 3]) == 1
    with pytest.raises(ValueError):
        SeqSlotPool(size=0)


def test_choose_ignores_a_short_match_and_prefers_an_empty_slot():
    # Issue 9 defect 8: a prompt sharing only a header must not evict a long cached conversation.
    pool = SeqSlotPool(size=3)
    conversation = [1, 2, 3] + list(range(100, 2100))
    cached = pool.idle()[0]
    cached.tokens = list(conversation)
    unrelated = [1, 2, 3, 7, 8, 9, 10, 11]
    slot, match = pool.choose(unrelated, min_match=4)
    assert slot is not cached and not slot.tokens and match is None
    header_heavy = [1, 2, 3, 7]  # a useful match, but reusing in place would cut 2,000 tokens
    slot, match = pool.choose(header_heavy, min_match=2)
    assert slot is not cached and not slot.tokens and match.slot is cached and match.length == 3
    follow_up = conversation + [5, 6]
    slot, match = pool.choose(follow_up, min_match=len(follow_up) // 2)
    assert slot is cached and match.length == len(conversation)


def test_choose_takes_the_least_recently_used_slot_when_none_is_empty():
    pool = SeqSlotPool(size=2)
    a, b = pool.idle()
    pool.acquire("x", a), pool.release("x")
    pool.acquire("y", b), pool.release("y")
    a.tokens, b.tokens = [1, 2, 3, 4], [1, 9, 9, 9]
    slot, match = pool.choose([1, 5, 6, 7], min_match=2)
    assert slot is a and match is None  # a was used longest ago; the 1-token match is not worth it


def test_choose_takes_the_empty_slot_with_the_lowest_seq_id():
    # llama.cpp's split KV cache micro-batches only consecutive seq_ids: keep the running ones packed.
    pool = SeqSlotPool(size=4)
    s0, s1, s2, s3 = sorted(pool.idle(), key=lambda s: s.seq_id)
    for rid, slot in (("w", s3), ("x", s0), ("y", s2), ("z", s1)):  # every slot used once, in another order
        pool.acquire(rid, slot)
    for rid in ("z", "x"):
        pool.release(rid)  # s1 then s0 free again, both empty; s0 was released last
    slot, match = pool.choose([5, 6, 7], min_match=2)
    assert slot is s0 and match is None
