"""PrefixAffinityRouter: Ray Serve's custom request router API, routing by cached prompt prefix.

Ray Serve calls ``choose_replicas`` for each request with the replicas that can
take it; we return ranks (cllm.cluster.affinity.rank): the replica that last
received the request's longest prefix, unless it runs more than
``max_imbalance`` requests beyond the least-loaded one, then the rest by load.
Serve tries ranks in order and, inside a rank, the replica with the shortest
queue, so an overloaded or full holder falls through to the least-loaded
replica. Load is this router's own count of requests it routed and that have
not completed (exact when one ingress routes everything).

The replica chosen for a request goes to that request: Serve's default
matching by internal request id (as Ray's own prefix-aware router does). With
``FIFOMixin`` a replica chosen for request X went to the oldest pending
request instead, so under concurrency prefixes were answered by the wrong
replicas (issue 27 item 5).

A request or hand-off names replicas it must not go to (``avoid_replicas``: the
draining replica that let it go, or ones that refused it as draining); they are
never candidates for it, whatever its prefix keys say (issue 27 item 4).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cllm.cluster.affinity import AffinityTable, rank


def _call_of(pending: PendingRequest | None) -> Any:
    """The GenerateCall or HandoffTicket the ingress sent (the request's first argument)."""
    if pending is None or not pending.args:
        return None
    return pending.args[0]


def prefix_keys_of(pending: PendingRequest | None) -> tuple[bytes, ...]:
    """The prefix keys the ingress attached to a request (its first argument's ``prefix_keys``)."""
    return tuple(getattr(_call_of(pending), "prefix_keys", ()) or ())


def avoided_by(pending: PendingRequest | None) -> frozenset[str]:
    """Serve replica ids (``ReplicaID.unique_id``) the request must not be routed to."""
    return frozenset(getattr(_call_of(pending), "avoid_replicas", ()) or ())


class PrefixAffinityRouter(RequestRouter):
    """Prefix-aware routing for cllm engine replicas (Ray Serve RequestRouter)."""

    def initialize_state(self, max_imbalance: int = 4, max_keys: int = 200_000, **_: Any) -> None:
        self._table = AffinityTable(max_keys=max_keys)
        self._max_imbalance = max_imbalance
        self._in_flight: Counter[ReplicaID] = Counter()
        self._routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until it completes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        avoid = avoided_by(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas if r.replica_id.unique_id not in avoid}
        loads = {rid: self._in_flight[rid] for rid in by_id}
        ranks = rank(prefix_keys_of(pending_request), loads, self._table, self._max_imbalance)
        return [[by_id[rid] for rid in tier] for tier in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._table.record(prefix_keys_of(pending_request), replica_id)
        internal_id = pending_request.metadata.internal_request_id
        previous = self._routed.get(internal_id)
        if previous is not None and self._in_flight[previous] > 0:  # routed again before it completed
            self._in_flight[previous] -= 1
        self._in_flight[replica_id] += 1
        self._routed[internal_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Serve calls this for every request it sent, also ones the replica rejected (never routed):
        # only the completion of the routed one counts it out.
        if self._routed.get(internal_request_id) != replica_id:
            return
        del self._routed[internal_request_id]
        if self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1

    def in_flight(self) -> dict[ReplicaID, int]:
        """Requests routed and not yet completed, per replica."""
        return {r: n for r, n in self._in_flight.items() if n}

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
