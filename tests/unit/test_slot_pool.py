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
