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
    saved: bool = False  # what it holds was copied to the host prompt cache (reset when a prompt takes it)
    spans: tuple = ()  # ImageSpans of its owner's prompt (tokens holds their cache keys: multimodal.span.cache_keys)


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

        A match counts only when it is at least ``min_match`` tokens long. The candidates are the
        idle slots; with ``pack`` only those next to a running one (any when none runs), so that
        running seq_ids stay consecutive: llama.cpp's split KV cache batches only consecutive seq_ids
        into one micro-batch, and a gap costs another pass over the weights. Among the candidates:

        - the match's own slot, reused in place, unless cutting its KV after the match loses more
          than it keeps (a short shared header must not destroy a long cached conversation);
        - else the empty candidate with the lowest seq_id (the caller copies the prefix over);
        - else, with a match, whichever of its slot and the least recently used other candidate
          loses fewer tokens (a prompt seen before would otherwise evict another's cache, and that
          one the next);
        - without a match: the empty candidate with the lowest seq_id, else the least recently used.

        When the returned match lives in another slot, the caller may copy the prefix from it (and,
        with a host prompt cache, saves what the chosen slot held). None when no slot is idle.
        """
        with self.lock:
            idle = self.idle()  # least recently used first
            if not idle:
                return None
            match = self.best_prefix(tokens) if min_match > 0 else None
            if match is not None and match.length < min_match:
                match = None
            if pack:
                owned = {s.seq_id for s in self._slots if s.owner is not None}
                idle = [s for s in idle if not owned or s.seq_id - 1 in owned or s.seq_id + 1 in owned]
            empty = min((s for s in idle if not s.tokens), key=lambda s: s.seq_id, default=None)
            if match is None or match.slot.owner is not None or match.slot not in idle:
                return (empty or idle[0]), match
            tail = len(match.slot.tokens) - match.length
            if tail <= match.length:
                return match.slot, match
            if empty is not None:
                return empty, match
            victim = next((s for s in idle if s is not match.slot), None)
            if victim is None or tail <= len(victim.tokens):
                return match.slot, match
            return victim, match

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
