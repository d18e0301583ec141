"""Which replica holds which prompt prefix, and where a request should go (no Ray needed).

The table maps prefix keys (cllm.cluster.prefix) to the replica that last
received them. ``rank`` is the routing decision: the replica holding the
request's longest known prefix first, unless it carries more than
``max_imbalance`` requests beyond the least-loaded candidate; then (and for
prompts nobody holds) the least-loaded replicas.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

ReplicaKey = Hashable


class AffinityTable:
    """Prefix key -> replica, bounded, least recently used keys dropped first."""

    def __init__(self, max_keys: int = 200_000) -> None:
        self._owner: OrderedDict[bytes, ReplicaKey] = OrderedDict()
        self._max_keys = max_keys

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, keys: Sequence[bytes], candidates: set[ReplicaKey]) -> tuple[ReplicaKey | None, int]:
        """(replica holding the longest prefix of ``keys`` among ``candidates``, blocks matched)."""
        best: ReplicaKey | None = None
        depth = 0
        for i, key in enumerate(keys):
            owner = self._owner.get(key)
            if owner is None:
                break  # keys are chained: no later block can be held without this one
            if owner in candidates:
                best, depth = owner, i + 1
        return best, depth

    def record(self, keys: Sequence[bytes], replica: ReplicaKey) -> None:
        """``replica`` now holds these prefixes (it was sent the prompt)."""
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)

    def forget(self, replica: ReplicaKey) -> None:
        """A replica is gone: its cache went with it."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]


def rank(keys: Sequence[bytes], loads: Mapping[ReplicaKey, int], table: AffinityTable,
         max_imbalance: int) -> list[list[ReplicaKey]]:
    """Replica ranks to try in order: the prefix holder alone first (if not overloaded), then all
    candidates by load, least-loaded first. ``loads`` maps each candidate to its in-flight requests."""
    by_load = sorted(loads, key=lambda r: loads[r])
    if not by_load:
        return []
    holder, _ = table.longest_match(keys, set(loads))
    if holder is not None and loads[holder] - loads[by_load[0]] <= max_imbalance:
        rest = [r for r in by_load if r != holder]
        return [[holder], rest] if rest else [[holder]]
    return [by_load]
