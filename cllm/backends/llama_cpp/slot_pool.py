"""A bounded, thread-safe pool of llama.cpp seq_ids with request-id ownership.

Each slot remembers which tokens its KV holds, so that an idle slot (its
request finished) serves as prefix cache until the slot or its KV room is
needed. Allocation never blocks: ``acquire`` returns None when every slot is
owned, and the scheduler keeps the request waiting.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Slot:
    """One llama.cpp seq_id."""

    seq_id: int  # the llama.cpp sequence id
    owner: str | None = None  # request id holding it; None = idle
    tokens: list[int] = field(default_factory=list)  # tokens whose KV the seq holds, in position order
    reserved: int = 0  # KV cells counted for the owner (>= len(tokens))
    last_used: int = 0  # LRU clock value of the last acquire/release


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    """The slot whose KV shares the longest prefix with a prompt."""

    slot: Slot  # where the prefix lives
    length: int  # tokens shared


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SeqSlotPool:
    """Maps request ids onto ``size`` seq_ids. All methods are thread-safe."""

    def __init__(self, *, size: int) -> None:
        if size < 1:
            raise ValueError(f"n_seq_max={size}: the slot pool needs at least one slot")
        self.lock = threading.RLock()
        self._slots = [Slot(seq_id=i) for i in range(size)]
        self._by_owner: dict[str, Slot] = {}
        self._clock = itertools.count(1)

    @property
    def size(self) -> int:
        return len(self._slots)

    def slot_of(self, request_id: str) -> Slot | None:
        with self.lock:
            return self._by_owner.get(request_id)

    def num_in_use(self) -> int:
        with self.lock:
            return len(self._by_owner)

    def owned(self) -> list[Slot]:
        with self.lock:
            return list(self._by_owner.values())

    def idle(self) -> list[Slot]:
        """Idle slots, least recently used first."""
        with self.lock:
            return sorted((s for s in self._slots if s.owner is None), key=lambda s: s.last_used)

    def best_prefix(self, tokens: list[int]) -> PrefixMatch | None:
        """The slot (idle or owned) whose KV shares the longest prefix with ``tokens``."""
        with self.lock:
            best: PrefixMatch | None = None
            for slot in self._slots:
                n = common_prefix_len(slot.tokens, tokens)
                if n and (best is None or n > best.length or (n == best.length and slot.owner is None)):
                    best = PrefixMatch(slot, n)
            return best

    def choose(self, tokens: list[int], *, min_match: int, pack: bool = False) -> tuple[Slot, PrefixMatch | None] | None:
        """The idle slot a prompt should take, and the prefix match worth reusing (None if none).

        A match counts only when it is at least ``min_match`` tokens long. With ``pack`` the prompt
        takes an idle slot next to a running one, so that running seq_ids stay consecutive (the caller
        moves the prefix there and saves what the slot held; see _packed_choice). Otherwise: without a match
        the empty slot with the lowest seq_id, else the least recently used idle slot; with one, see
        below. When the returned match lives in another slot, the caller may copy the prefix from
        it. None when no slot is idle.
        """
        with self.lock:
            idle = self.idle()
            if not idle:
                return None
            match = self.best_prefix(tokens) if min_match > 0 else None
            if match is not None and match.length < min_match:
                match = None
            if pack:
                return self._packed_choice(idle, match), match
            # Empty slots lowest seq_id first: running seq_ids stay packed, and llama.cpp's split KV cache
            # batches only consecutive seq_ids into one micro-batch (a gap costs another weight pass).
            empty = sorted((s for s in idle if not s.tokens), key=lambda s: s.seq_id)
            if match is not None and match.slot.owner is None:
                # Reusing the slot in place cuts its KV after the match. When that would lose more
                # than it keeps, take an empty slot (the caller copies the prefix over), so a short
                # shared header never destroys a long cached conversation; with none empty, copying
                # evicts the least recently used other slot whole, so cut whichever loses fewer tokens
                # (a prompt seen before would otherwise evict another's cache, and that one the next).
                tail = len(match.slot.tokens) - match.length
                if tail <= match.length:
                    return match.slot, match
                if empty:
                    return empty[0], match
                victim = next((s for s in idle if s is not match.slot), None)
                if victim is None or tail <= len(victim.tokens):
                    return match.slot, match
                return victim, match
            return (empty[0] if empty else idle[0]), match

    def _packed_choice(self, idle: list[Slot], match: PrefixMatch | None) -> Slot:
        """The idle slot that keeps running seq_ids consecutive: next to an owned one (any slot when
        none is owned). Among those: the match's own slot, unless cutting it in place loses more than
        it keeps and an empty one is free; else an empty one; else the least recently used."""
        owned = {s.seq_id for s in self._slots if s.owner is not None}
        fits = [s for s in idle if not owned or s.seq_id - 1 in owned or s.seq_id + 1 in owned]
        empty = [s for s in fits if not s.tokens]
        if match is not None and match.slot in fits:
            if not empty or len(match.slot.tokens) - match.length <= match.length:
                return match.slot
        if empty:
            return min(empty, key=lambda s: s.seq_id)
        return min(fits, key=lambda s: s.last_used)

    def acquire(self, request_id: str, slot: Slot) -> Slot:
        """Give the idle ``slot`` to ``request_id``."""
        with self.lock:
            if request_id in self._by_owner:
                raise ValueError(f"request {request_id!r} already holds seq_id {self._by_owner[request_id].seq_id}")
            if slot.owner is not None:
                raise ValueError(f"seq_id {slot.seq_id} is owned by {slot.owner!r}")
            slot.owner = request_id
            slot.last_used = next(self._clock)
            self._by_owner[request_id] = slot
            return slot

    def release(self, request_id: str) -> Slot | None:
        """Make the owner's slot idle (KV kept as it is); None if it held none."""
        with self.lock:
            slot = self._by_owner.pop(request_id, None)
            if slot is not None:
                slot.owner = None
                slot.reserved = 0
                slot.last_used = next(self._clock)
            return slot

    def kv_cells_counted(self) -> int:
        """Cells counted as used: owners' reservations plus idle slots' cached tokens.

        An over-estimate: cells shared through seq_cp are counted once per sequence.
        """
        with self.lock:
            return sum(max(s.reserved, len(s.tokens)) if s.owner else len(s.tokens) for s in self._slots)
