"""PrefixAffinityRouter: Ray Serve's custom request router API, routing by cached prompt prefix.

Ray Serve calls ``choose_replicas`` for each request with the replicas that can
take it; we return ranks (cllm.cluster.affinity.rank): the replica that last
received the request's longest prefix, unless it runs more than
``max_imbalance`` requests beyond the least-loaded one, then the rest by load.
Serve tries ranks in order and, inside a rank, the replica with the shortest
queue, so an overloaded or full holder falls through to the least-loaded
replica. Load is this router's own count of requests it routed and that have
not completed (exact when one ingress routes everything).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cllm.cluster.affinity import AffinityTable, rank


def prefix_keys_of(pending: PendingRequest | None) -> tuple[bytes, ...]:
    """The prefix keys the ingress attached to a request (its first argument's ``prefix_keys``)."""
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "prefix_keys", ()) or ())


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prefix-aware routing for cllm engine replicas (Ray Serve RequestRouter)."""

    def initialize_state(self, max_imbalance: int = 4, max_keys: int = 200_000, **_: Any) -> None:
        self._table = AffinityTable(max_keys=max_keys)
        self._max_imbalance = max_imbalance
        self._in_flight: Counter[ReplicaID] = Counter()
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until it completes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self._in_flight[rid] for rid in by_id}
        ranks = rank(prefix_keys_of(pending_request), loads, self._table, self._max_imbalance)
        return [[by_id[rid] for rid in tier] for tier in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._table.record(prefix_keys_of(pending_request), replica_id)
        self._in_flight[replica_id] += 1
        self._routed[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, replica_id)
        if self._in_flight[routed] > 0:
            self._in_flight[routed] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._in_flight) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        """A replica's cache and in-flight requests died with it."""
        self._table.forget(replica_id)
        self._in_flight.pop(replica_id, None)
        for key in [k for k, r in self._routed.items() if r == replica_id]:
            del self._routed[key]
