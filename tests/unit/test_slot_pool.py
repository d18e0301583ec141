"""The llama.cpp seq_id pool's bookkeeping under threads (no model needed)."""
from __future__ import annotations

import threading
import time

import pytest

from cllm.backends.llama_cpp import slot_pool
from cllm.backends.llama_cpp.slot_pool import SeqSlotPool, common_prefix_len


class _SlowOwnerSlot(slot_pool.Slot):
    """A slot whose ``owner`` takes a moment to read: a check-then-set in the pool that is not under
    its lock then lets another thread in between, every time rather than once in a while."""

    @property
    def owner(self) -> str | None:
        value = self.__dict__.get("_owner")
        time.sleep(0.0005)
        return value

    @owner.setter
    def owner(self, value: str | None) -> None:
        self.__dict__["_owner"] = value


def test_acquire_release_is_exclusive_under_threads(monkeypatch):
    monkeypatch.setattr(slot_pool, "Slot", _SlowOwnerSlot)
    pool = SeqSlotPool(size=2)
    errors: list[str] = []
    holders: dict[int, str] = {}
    guard = threading.Lock()
    start = threading.Barrier(6)
    slots = pool.idle()

    def worker(t: int) -> None:
        start.wait()
        for i in range(40):
            rid = f"t{t}-{i}"
            try:  # (no lock held here: acquire alone must refuse a slot that another thread holds)
                slot = pool.acquire(rid, slots[i % 2])
            except ValueError:
                continue  # another thread took it first: the refusal is the exclusivity
            with guard:
                if slot.seq_id in holders:
                    errors.append(f"seq {slot.seq_id} held by {holders[slot.seq_id]} and {rid}")
                holders[slot.seq_id] = rid
            time.sleep(0.001)  # use the slot a while, so that a second holder shows up meanwhile
            with guard:
                holders.pop(slot.seq_id, None)
            if pool.release(rid) is not slot:
                errors.append(f"{rid} released, but not from seq {slot.seq_id}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert pool.num_in_use() == 0 and len(pool.idle()) == 2
    assert all(s.owner is None for s in pool.idle())


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


def test_choose_with_no_empty_slot_cuts_the_matched_tail_rather_than_evict_another_prompt():
    # A full pool of prompt + answer caches (tail longer than the prompt): a prompt seen before
    # must reuse its own slot in place, not copy into the LRU slot and evict another prompt's cache
    # (which then misses and evicts the next: measured 61 of 64 repeated prompts prefilled again).
    pool = SeqSlotPool(size=3)
    a, b, c = sorted(pool.idle(), key=lambda s: s.seq_id)
    for rid, slot in (("x", a), ("y", b), ("z", c)):
        pool.acquire(rid, slot), pool.release(rid)
    a.tokens = [1, 2, 3, 4] + list(range(100, 110))  # a is the least recently used
    b.tokens = [5, 6, 7, 8] + list(range(200, 210))
    c.tokens = [9, 9, 9, 9] + list(range(300, 310))
    slot, match = pool.choose([5, 6, 7, 8], min_match=2)
    assert slot is b and match.slot is b and match.length == 4
    # A header shared with a long conversation: evicting a short LRU cache loses fewer tokens.
    b.tokens = [5, 6] + list(range(1000, 3000))
    slot, match = pool.choose([5, 6, 40, 41], min_match=2)
    assert slot is a and match.slot is b and match.length == 2


def test_choose_packed_takes_the_idle_seq_id_next_to_a_running_one_whatever_it_holds():
    # Split KV: running seq_ids must stay consecutive, so the prompt goes to the lowest idle seq_id and
    # the match (here in another slot) is reported for the caller to move over.
    pool = SeqSlotPool(size=4)
    s0, s1, s2, s3 = sorted(pool.idle(), key=lambda s: s.seq_id)
    pool.acquire("running", s0)
    s1.tokens, s2.tokens = [7, 7, 7], [1, 2, 3, 4]
    slot, match = pool.choose([1, 2, 3, 9], min_match=2, pack=True)
    assert slot is s1 and match.slot is s2 and match.length == 3
    slot, match = pool.choose([5, 5], min_match=2, pack=True)
    assert slot is s1 and match is None


def test_choose_packed_keeps_running_seq_ids_next_to_each_other():
    pool = SeqSlotPool(size=6)
    s = sorted(pool.idle(), key=lambda x: x.seq_id)
    s[4].tokens = [1, 2, 3, 4, 5]  # a cached prompt + answer
    # Nothing runs: the match is used in place (it keeps more than it loses)...
    slot, match = pool.choose([1, 2, 3, 4], min_match=2, pack=True)
    assert slot is s[4] and match.slot is s[4]
    pool.acquire("r4", s[4])
    # ...and the next prompt goes next to it, not to the lowest empty seq_id (0): a gap splits batches.
    slot, match = pool.choose([9, 9], min_match=2, pack=True)
    assert slot is s[3] and match is None


def test_choose_packed_weighs_the_cut_against_the_lru_victim_as_unpacked():
    # One rule for both modes: with no empty candidate, a short header match in a long conversation
    # is not cut in place when evicting the least recently used neighbour loses fewer tokens.
    pool = SeqSlotPool(size=3)
    s0, s1, s2 = sorted(pool.idle(), key=lambda s: s.seq_id)
    pool.acquire("old", s2), pool.release("old")  # s2 used before s0, so s2 is the LRU idle slot
    pool.acquire("running", s1)
    s0.tokens = [5, 6] + list(range(1000, 3000))
    s2.tokens = [9, 9, 9]
    slot, match = pool.choose([5, 6, 40, 41], min_match=2, pack=True)
    assert slot is s2 and match.slot is s0 and match.length == 2
    # A match that keeps more than it loses is still reused in place.
    s0.tokens = [5, 6, 40, 7]
    slot, match = pool.choose([5, 6, 40, 41], min_match=2, pack=True)
    assert slot is s0 and match.length == 3
