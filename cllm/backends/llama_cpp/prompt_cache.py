"""Host-memory prompt cache: the KV of sequences evicted from their slots, kept as llama.cpp state.

A slot's KV is the prefix cache only while the slot is idle and untouched; when a new
prompt takes the slot (least recently used, or a short match cut in place), what the slot
held would be lost. llama-server saves it to host memory first (``--cache-ram``, 8 GiB by
default) and loads it back when a later prompt starts with it; without that, 64 clients
returning with prompts seen before, after a few other prompts had passed through the 64
slots, found 8 to 61 of them evicted and prefilled them again (TTFT p50 0.98 s vs
llama-server's 0.32 s). Saving a 95-token sequence of the embedded model takes ~1 ms
(2.2 MB), loading it ~0.2 ms; prefilling it again ~200 ms. Fresh memory can make a save far dearer
(~7 ms per 2.2 MB on a VM), so the server's engine saves idle slots while it has nothing else to do
(``LlamaCppBackend.idle_work``) and an eviction finds the copy made.

Not thread-safe on its own: the backend calls it under its slot pool's lock.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cllm.backends.llama_cpp.slot_pool import common_prefix_len


@dataclass(slots=True, frozen=True)
class SavedPrompt:
    """One evicted sequence: its tokens and llama_state_seq_get_data's bytes of their KV."""

    tokens: tuple[int, ...]
    state: bytes | bytearray


class PromptCache:
    """An LRU of saved sequences bounded by their total bytes.

    The keys are also kept sorted: the key sharing the longest prefix with a prompt is
    next to where the prompt would sort, so a lookup is a bisection, not a scan.
    """

    def __init__(self, *, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[int, ...], SavedPrompt] = OrderedDict()  # least recently saved first
        self._sorted: list[tuple[int, ...]] = []
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        """Whether exactly these tokens are saved."""
        return tuple(tokens) in self._entries

    def put(self, tokens: list[int], state: bytes | bytearray) -> None:
        """Keep a sequence's state, evicting the oldest entries beyond the byte bound."""
        key = tuple(tokens)
        if key in self._entries:
            self._drop(key)
        if not key or len(state) > self.capacity_bytes:
            return
        self._entries[key] = SavedPrompt(key, state)
        bisect.insort(self._sorted, key)
        self.num_bytes += len(state)
        while self.num_bytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))

    def take(self, tokens: list[int], *, min_match: int) -> tuple[SavedPrompt, int] | None:
        """Remove and return the entry sharing the longest prefix with ``tokens`` (at least
        ``min_match`` tokens, and at least one), with that length; None if none does."""
        query = tuple(tokens)
        i = bisect.bisect_left(self._sorted, query)
        best: tuple[SavedPrompt, int] | None = None
        for key in self._sorted[max(0, i - 1): i + 1]:
            n = common_prefix_len(key, query)
            if n >= max(min_match, 1) and (best is None or n > best[1]):
                best = (self._entries[key], n)
        if best is not None:
            self._drop(best[0].tokens)
        return best

    def _drop(self, key: tuple[int, ...]) -> None:
        self.num_bytes -= len(self._entries.pop(key).state)
        del self._sorted[bisect.bisect_left(self._sorted, key)]
