"""Paged KV bookkeeping: fixed-size blocks, per-sequence block tables, prefix cache.

Pure Python, no tensors: it decides *which* cache slots a sequence owns; the
tensors live in :mod:`kv_cache`. Design (vLLM v1's KVCacheManager, trimmed):

- Every block has a ref count: the number of live sequences whose table holds it.
- A FULL block whose tokens were computed gets a chained hash
  BLAKE2b digest of (parent digest, block tokens) and is entered in ``_cached``,
  so a later sequence with the same prefix can share it.
- A block whose ref count drops to 0 goes to the free queue. If it has a hash
  it still answers prefix lookups until it is taken for new data (LRU: the
  least recently freed is evicted first); a free block without a hash holds
  nothing useful and is handed out before any cached one.
"""
from __future__ import annotations

import hashlib

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Block:
    """One block of ``block_size`` KV slots."""

    block_id: int  # index into the KV tensors' block dimension
    ref_count: int = 0  # live sequences holding it in their table
    block_hash: bytes | None = None  # chained prefix digest once full and computed; None = not shareable
    parent_hash: bytes | None = None  # the previous block's digest when hashed (None for a first block)
    tokens: tuple[int, ...] = ()  # the block's tokens when hashed, compared on every cache hit


@dataclass(slots=True)
class SequenceBlocks:
    """One admitted sequence's view of the cache."""

    block_ids: list[int] = field(default_factory=list)  # block table: position p lives in block_ids[p // block_size]
    token_ids: list[int] = field(default_factory=list)  # tokens known so far (admitted prompt, then what forward saw)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    chain: list[bytes] = field(default_factory=list)  # chain digest of each leading full computed block, in order
    cached_at_admission: int | None = None  # prefix-cache hit of the admission, until counted in the stats


def chain_hash(parent_hash: bytes | None, block_tokens: Sequence[int]) -> bytes:
    """Digest of a full block, chained on its predecessor so equal blocks at different prefixes differ.

    BLAKE2b, not Python's 64-bit hash(): a client must not be able to craft a prompt whose blocks
    collide with another user's and be served their KV (vLLM's CVE-2025-25183). Hits also compare
    tokens (``_match_prefix``), so even a collision cannot serve wrong KV.
    """
    digest = hashlib.blake2b(parent_hash or b"root", digest_size=16)
    digest.update(np.asarray(block_tokens, dtype=np.int64).tobytes())
    return digest.digest()


class BlockManager:
    """Allocates KV blocks to sequences, with ref counts and a chained-hash prefix cache."""

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks (ref_count 0) in eviction order: the first is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block digest -> block id, for full computed blocks
        self._seqs: dict[str, SequenceBlocks] = {}
        self.queried_tokens = 0  # prompt tokens looked up at admission, since start
        self.hit_tokens = 0  # of those, served from the prefix cache

    # ----- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that answer prefix lookups (held by live sequences or not)."""
        return len(self._cached)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, seq_id: str) -> SequenceBlocks | None:
        """The admitted sequence's blocks, or None."""
        return self._seqs.get(seq_id)

    def sequence(self, seq_id: str) -> SequenceBlocks:
        """The admitted sequence's blocks; KeyError naming it if it was never admitted."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not admitted in the KV cache") from None

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> bytes | None:
        return self._blocks[block_id].block_hash

    # ----- admission -------------------------------------------------------------------------

    def admit(self, seq_id: str, token_ids: Sequence[int], *, reuse_prefix: bool = True) -> int:
        """Start a sequence; share its longest cached prefix (unless ``reuse_prefix`` is False).
        Returns the cached token count.

        Only blocks lying entirely within the first ``len - 1`` tokens are
        matched: the last token is always recomputed (its logits are needed),
        and recomputing it must never write into a block other sequences share,
        so the block holding it is never taken from the cache.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted; release it first")
        seq = SequenceBlocks(token_ids=list(token_ids))
        for block_id in self._match_prefix(seq.token_ids) if reuse_prefix else []:
            self._take(block_id)
            seq.block_ids.append(block_id)
        seq.chain = [self._blocks[b].block_hash for b in seq.block_ids]
        seq.num_computed = len(seq.block_ids) * self.block_size
        self._seqs[seq_id] = seq
        seq.cached_at_admission = seq.num_computed  # counted once the sequence really runs
        return seq.num_computed

    def _match_prefix(self, token_ids: list[int]) -> list[int]:
        bs = self.block_size
        matched: list[int] = []
        parent: bytes | None = None
        for start in range(0, max(len(token_ids) - 1, 0) // bs * bs, bs):
            block_tokens = tuple(token_ids[start : start + bs])
            digest = chain_hash(parent, block_tokens)
            block_id = self._cached.get(digest)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.tokens != block_tokens or block.parent_hash != parent:
                break  # a digest collision: never serve KV computed for other tokens
            matched.append(block_id)
            parent = digest
        return matched

    def _take(self, block_id: int) -> None:
        """Add one reference to an existing (cached) block."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    # ----- growth -------------------------------------------------------------------------

    def reserve(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens`` tokens; False (nothing allocated) if out of blocks."""
        seq = self.sequence(seq_id)
        needed = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            seq.block_ids.append(self._allocate())
        return True

    def _allocate(self) -> int:
        """Pop the first free block, evicting its cached prefix entry if it had one."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._cached.pop(block.block_hash, None)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    # ----- after a forward pass ------------------------------------------------------------

    def record_computed(self, seq_id: str, start: int, token_ids: Sequence[int]) -> None:
        """Note that ``token_ids`` at positions ``start..`` now have K/V; hash blocks that became full."""
        self.record_computed_of(self.sequence(seq_id), start, token_ids)

    def record_computed_of(self, seq: SequenceBlocks, start: int, token_ids: Sequence[int]) -> None:
        """record_computed for a sequence's entry already in hand (a step has every one: no lookups)."""
        if seq.cached_at_admission is not None:
            # Stats count admissions that ran, not ones the scheduler rolled back (no room to reserve).
            self.queried_tokens += len(seq.token_ids)
            self.hit_tokens += seq.cached_at_admission
            seq.cached_at_admission = None
        end = start + len(token_ids)
        seq.token_ids[start:end] = token_ids
        seq.num_computed = max(seq.num_computed, end)
        if (len(seq.chain) + 1) * self.block_size <= seq.num_computed:  # a block became full
            self._register_full_blocks(seq)

    def _register_full_blocks(self, seq: SequenceBlocks) -> None:
        bs = self.block_size
        while (len(seq.chain) + 1) * bs <= seq.num_computed:
            index = len(seq.chain)
            parent = seq.chain[-1] if seq.chain else None
            block_tokens = tuple(seq.token_ids[index * bs : (index + 1) * bs])
            block_hash = chain_hash(parent, block_tokens)
            seq.chain.append(block_hash)
            block = self._blocks[seq.block_ids[index]]
            # A block whose twin is already cached (the same prefix computed by two
            # sequences at once) stays unhashed; the chain goes on by value.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash, block.parent_hash, block.tokens = block_hash, parent, block_tokens
                self._cached[block_hash] = block.block_id

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Forget K/V past the first ``num_tokens``: blocks no longer fully inside them are let go.

        Keeps the table's length by putting fresh blocks in their place when
        there is room (a shared block must never be rewritten), so what the
        scheduler reserved stays reserved; otherwise the table just shrinks.
        """
        seq = self.sequence(seq_id)
        if num_tokens >= seq.num_computed:
            return
        keep = num_tokens // self.block_size
        dropped = seq.block_ids[keep:]
        seq.block_ids = seq.block_ids[:keep]
        seq.chain = seq.chain[:keep]
        seq.num_computed = keep * self.block_size
        self._drop_refs(dropped, keep_cache=True)
        self.reserve(seq_id, (keep + len(dropped)) * self.block_size)

    def roll_back(self, seq_id: str, num_tokens: int) -> None:
        """Forget the tokens past the first ``num_tokens`` (rejected draft tokens), keeping every block:
        their slots are written again by the next tokens. A block that a forgotten token completed was
        hashed when it filled: it is withdrawn from the prefix cache, so rejected tokens never serve a
        hit (the sequence owns it alone: it was allocated for this sequence's newest tokens)."""
        seq = self.sequence(seq_id)
        if num_tokens >= seq.num_computed:
            return
        keep = num_tokens // self.block_size
        for index in range(keep, len(seq.chain)):
            block = self._blocks[seq.block_ids[index]]
            if block.block_hash == seq.chain[index]:
                self._cached.pop(block.block_hash, None)
                block.block_hash, block.parent_hash, block.tokens = None, None, ()
        del seq.chain[keep:]
        del seq.token_ids[num_tokens:]
        seq.num_computed = num_tokens

    # ----- release -------------------------------------------------------------------------

    def release(self, seq_id: str, *, keep_cache: bool = True) -> None:
        """Drop the sequence's references. Idempotent.

        ``keep_cache=False`` also withdraws its blocks from the prefix cache (their
        K/V may be garbage after a failed forward), even blocks others still hold.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._drop_refs(seq.block_ids, keep_cache=keep_cache)

    def _drop_refs(self, block_ids: list[int], *, keep_cache: bool) -> None:
        # Reversed: a sequence's tail blocks are the least likely to be shared,
        # so they should be evicted before its head blocks.
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            if not keep_cache and block.block_hash is not None:
                self._cached.pop(block.block_hash, None)
                block.block_hash = None
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
