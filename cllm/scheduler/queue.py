"""The waiting queue, ordered by the configured policy."""
from __future__ import annotations

import heapq
from collections.abc import Iterator

from cllm.request import Request


class WaitingQueue:
    """Requests not running: new ones and preempted ones.

    FCFS orders by arrival; "priority" by (priority, arrival), lower first. A
    preempted request keeps its arrival number, so it goes back ahead of the
    requests that arrived after it.
    """

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={policy!r}: must be 'fcfs' or 'priority'")
        self._policy = policy
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_seq) if self._policy == "priority" else (0, req.arrival_seq)

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (self._key(req), req))

    def peek(self) -> Request | None:
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> bool:
        for i, (_, r) in enumerate(self._heap):
            if r is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def sort_key(self, req: Request) -> tuple[int, int]:
        """The policy's order, also used to pick preemption victims (largest first)."""
        return self._key(req)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])
