"""BlockManager: allocation, ref counts, prefix-cache hits, LRU eviction, no leaks."""
from __future__ import annotations

import random

import pytest

from cllm.backends.torch.block_manager import BlockManager, chain_hash

BS = 4


def make(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks=num_blocks, block_size=BS)


def fill(bm: BlockManager, seq_id: str, tokens: list[int]) -> None:
    """Admit, reserve and mark every token computed (as a forward pass would)."""
    cached = bm.admit(seq_id, tokens)
    assert bm.reserve(seq_id, len(tokens))
    bm.record_computed(seq_id, cached, tokens[cached:])


def test_reserve_allocates_ceil_blocks_and_release_frees_them() -> None:
    bm = make(8)
    assert bm.admit("a", list(range(10))) == 0
    assert bm.reserve("a", 10)
    table = bm.sequence("a").block_ids
    assert len(table) == 3 and len(set(table)) == 3
    assert all(bm.ref_count(b) == 1 for b in table)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.reserve("a", 12) and len(bm.sequence("a").block_ids) == 3  # still fits
    assert bm.reserve("a", 13) and len(bm.sequence("a").block_ids) == 4
    bm.release("a")
    assert bm.num_free_blocks == 8 and "a" not in bm
    bm.release("a")  # idempotent
    assert bm.num_free_blocks == 8


def test_full_blocks_are_hashed_with_chained_hashes() -> None:
    bm = make(8)
    tokens = list(range(10))
    fill(bm, "a", tokens)
    table = bm.sequence("a").block_ids
    h0 = chain_hash(None, tokens[0:4])
    h1 = chain_hash(h0, tokens[4:8])
    assert bm.block_hash(table[0]) == h0
    assert bm.block_hash(table[1]) == h1
    assert bm.block_hash(table[2]) is None  # partial block: not shareable
    assert bm.num_cached_blocks == 2
    # The same block content after a different prefix hashes differently.
    assert chain_hash(chain_hash(None, [9, 9, 9, 9]), tokens[4:8]) != h1


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = make(8)
    fill(bm, "a", list(range(10)))
    a_table = list(bm.sequence("a").block_ids)
    cached = bm.admit("b", list(range(9)) + [99, 98])
    assert cached == 8
    assert bm.sequence("b").block_ids == a_table[:2]
    assert bm.ref_count(a_table[0]) == 2 and bm.ref_count(a_table[1]) == 2
    assert (bm.queried_tokens, bm.hit_tokens) == (10, 0)  # b is counted once it runs
    assert bm.reserve("b", 11)
    bm.record_computed("b", 8, [99, 98])
    assert (bm.queried_tokens, bm.hit_tokens) == (10 + 11, 8)
    bm.release("a")
    assert bm.ref_count(a_table[0]) == 1  # b still holds it
    assert bm.ref_count(a_table[2]) == 0
    bm.release("b")
    assert bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 2  # freed but still answering lookups


def test_hit_never_covers_the_last_token() -> None:
    bm = make(8)
    tokens = list(range(8))  # exactly two full blocks
    fill(bm, "a", tokens)
    bm.release("a")
    # Everything is cached, but the block holding the last token is recomputed:
    # writing its K/V must not touch a shared block.
    assert bm.admit("b", tokens) == 4
    assert len(bm.sequence("b").block_ids) == 1
    assert bm.admit("c", tokens + [8]) == 8  # one more token: both full blocks are usable


def test_freed_cached_blocks_are_reused_by_a_later_admission() -> None:
    bm = make(4)
    fill(bm, "a", list(range(9)))
    table = list(bm.sequence("a").block_ids)
    bm.release("a")
    assert bm.admit("b", list(range(9))) == 8
    assert bm.sequence("b").block_ids == table[:2]
    assert bm.num_free_blocks == 2


def test_unhashed_free_blocks_go_before_cached_ones_and_cached_evict_lru() -> None:
    bm = make(4)
    fill(bm, "old", [1, 1, 1, 1, 7])  # block 0 cached, block 1 partial
    old_cached = bm.sequence("old").block_ids[0]
    bm.release("old")
    fill(bm, "new", [2, 2, 2, 2, 7])
    new_cached = bm.sequence("new").block_ids[0]
    bm.release("new")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    # Two blocks: the two unhashed free ones come first, no cached block is evicted.
    assert bm.admit("x", [5]) == 0 and bm.reserve("x", 8)
    assert old_cached not in bm.sequence("x").block_ids and new_cached not in bm.sequence("x").block_ids
    assert bm.num_cached_blocks == 2
    # A third block must evict a cached one: the least recently freed ("old").
    assert bm.reserve("x", 12)
    assert old_cached in bm.sequence("x").block_ids
    assert bm.block_hash(old_cached) is None and bm.num_cached_blocks == 1
    assert bm.admit("y", [1, 1, 1, 1, 7]) == 0  # its prefix is gone
    assert bm.admit("z", [2, 2, 2, 2, 7]) == 4  # the newer one survived


def test_reserve_returns_false_without_partial_allocation() -> None:
    bm = make(4)
    bm.admit("a", [1])
    assert bm.reserve("a", 8)  # 2 blocks
    bm.admit("b", [2])
    assert not bm.reserve("b", 12)  # needs 3, only 2 free
    assert bm.sequence("b").block_ids == []
    assert bm.num_free_blocks == 2
    assert bm.reserve("b", 8)
    assert not bm.reserve("a", 9)  # growing by one block fails too
    assert len(bm.sequence("a").block_ids) == 2 and bm.num_free_blocks == 0


def test_release_without_keep_cache_drops_hashes() -> None:
    bm = make(8)
    fill(bm, "a", list(range(9)))
    fill(bm, "b", list(range(9)))  # shares a's two full blocks
    shared = bm.sequence("a").block_ids[:2]
    bm.release("a", keep_cache=False)
    assert all(bm.block_hash(b) is None for b in shared)
    assert bm.ref_count(shared[0]) == 1  # b still uses them
    assert bm.admit("c", list(range(9))) == 0  # no longer matched
    bm.release("b")
    bm.release("c")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 0


def test_twin_blocks_computed_concurrently_keep_one_hash_entry() -> None:
    bm = make(8)
    tokens = list(range(9))
    for seq in ("a", "b"):  # both admitted before either computed anything
        assert bm.admit(seq, tokens) == 0
        assert bm.reserve(seq, len(tokens))
    bm.record_computed("a", 0, tokens)
    bm.record_computed("b", 0, tokens)
    assert bm.num_cached_blocks == 2
    assert all(bm.block_hash(b) is None for b in bm.sequence("b").block_ids)
    # b's later blocks still chain correctly by value: grow b past a third full block.
    assert bm.reserve("b", 13)
    bm.record_computed("b", 9, [9, 10, 11])
    bm.release("a")
    bm.release("b")
    assert bm.admit("c", list(range(12)) + [0]) == 12


def test_admit_twice_is_an_error_and_unknown_sequence_is_named() -> None:
    bm = make(4)
    bm.admit("a", [1])
    with pytest.raises(ValueError, match="already admitted"):
        bm.admit("a", [1])
    with pytest.raises(KeyError, match="'ghost'"):
        bm.reserve("ghost", 4)


def test_no_block_leaks_after_random_traffic() -> None:
    rng = random.Random(1234)
    bm = make(24)
    live: dict[str, list[int]] = {}
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(5)]
    for i in range(200):
        if live and (rng.random() < 0.4 or len(live) >= 6):
            seq = rng.choice(sorted(live))
            bm.release(seq, keep_cache=rng.random() < 0.8)
            del live[seq]
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        seq = f"r{i}"
        cached = bm.admit(seq, tokens)
        assert cached < len(tokens) and cached % BS == 0
        if not bm.reserve(seq, len(tokens)):
            bm.release(seq)
            continue
        bm.record_computed(seq, cached, tokens[cached:])
        live[seq] = tokens
        _check_invariants(bm, live)
    for seq in list(live):
        bm.release(seq)
    assert len(bm) == 0
    assert bm.num_free_blocks == 24
    assert all(bm.ref_count(b) == 0 for b in range(24))


def _check_invariants(bm: BlockManager, live: dict[str, list[int]]) -> None:
    held: dict[int, int] = {}
    for seq in live:
        for b in bm.sequence(seq).block_ids:
            held[b] = held.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0)
    assert bm.num_free_blocks == bm.num_blocks - len(held)


def test_truncate_lets_go_of_shared_blocks_and_keeps_the_table_length() -> None:
    bm = make(8)
    fill(bm, "a", list(range(13)))  # three full blocks cached
    shared = list(bm.sequence("a").block_ids[:3])
    assert bm.admit("b", list(range(13))) == 12
    assert bm.reserve("b", 13)
    bm.truncate("b", 6)  # keep one full block; positions 4.. must go to b's own blocks
    table = bm.sequence("b").block_ids
    assert table[0] == shared[0] and len(table) == 4
    assert not set(table[1:]) & set(shared)
    assert bm.sequence("b").num_computed == 4
    assert [bm.ref_count(b) for b in shared] == [2, 1, 1]
    bm.release("a")
    bm.release("b")
    assert bm.num_free_blocks == 8


# ---- issue 9 defect 18 -------------------------------------------------------------------

def test_chain_digest_is_blake2b_not_python_hash() -> None:
    digest = chain_hash(None, [1, 2, 3, 4])
    assert isinstance(digest, bytes) and len(digest) == 16
    assert chain_hash(None, [1, 2, 3, 4]) == digest and chain_hash(digest, [1, 2, 3, 4]) != digest


def test_a_digest_collision_never_serves_other_tokens_kv(monkeypatch) -> None:
    from cllm.backends.torch import block_manager
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"always-the-same")
    bm = make(8)
    fill(bm, "victim", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.num_cached_blocks >= 1
    assert bm.admit("attacker", [9, 9, 9, 9, 9, 9, 9, 9, 9]) == 0  # same digest, other tokens: a miss
    assert bm.admit("same", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # the genuine prefix still hits


def test_rolled_back_admission_is_not_counted_as_a_hit() -> None:
    bm = make(8)
    fill(bm, "a", list(range(10)))
    before = (bm.queried_tokens, bm.hit_tokens)
    assert bm.admit("b", list(range(9)) + [99]) == 8
    bm.release("b")  # the scheduler could not reserve room and rolled the admission back
    assert (bm.queried_tokens, bm.hit_tokens) == before
