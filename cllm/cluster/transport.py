"""KV hand-off between replicas through Ray's object store.

The exporting replica cuts the KV into chunks (cllm.handoff.transfer); a
long-lived holder actor puts each chunk in the object store, so the holder, not
the replica, owns them: a draining replica may exit before the receiver has
fetched everything, and objects die with their owner (Ray 2.56 removed
``ray.put(_owner=...)``). The receiver releases them when it has them all. The ticket (snapshot, header,
chunk refs) travels through the ingress to the receiving replica, which fetches
chunks in order into a KVReceiver; if a fetch fails mid-way, a later
``receive`` with the same receiver resumes from the last acknowledged chunk.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray

from cllm.handoff.snapshot import RequestSnapshot
from cllm.handoff.transfer import KVChunk, KVReceiver, KVSender, TransferHeader, TransferStatus

HOLDER_NAME = "cllm-kv-holder"


@ray.remote(num_cpus=0)
class ChunkHolder:
    """Puts hand-off chunks in the object store itself, so it owns them: they outlive the replica that
    made them (objects die with their owner) until the receiver releases them."""

    def __init__(self) -> None:
        self._refs: dict[str, list[Any]] = {}

    def adopt(self, transfer_id: str, chunks: list[KVChunk]) -> list[Any]:
        self._refs[transfer_id] = [ray.put(chunk) for chunk in chunks]
        return self._refs[transfer_id]

    def release(self, transfer_id: str) -> None:
        self._refs.pop(transfer_id, None)


def chunk_holder(namespace: str | None = "cllm") -> Any:
    """The holder actor, created on first use (one per Ray namespace, detached from any replica)."""
    return ChunkHolder.options(name=HOLDER_NAME, namespace=namespace, get_if_exists=True, lifetime="detached").remote()


@dataclass(slots=True)
class HandoffTicket:
    """What a receiving replica needs to continue a request another replica let go."""

    snapshot: RequestSnapshot  # request state besides the KV
    header: TransferHeader  # chunk geometry
    chunk_refs: list[Any]  # ObjectRef of each KVChunk, in order
    prefix_keys: tuple[bytes, ...] = ()  # the request's prefix keys: a retried resume is routed where the first went


async def publish(snapshot: RequestSnapshot, segments: list[bytes], chunk_bytes: int, holder: Any) -> HandoffTicket:
    """Put a request's KV chunks in the object store (owned by ``holder``); the ticket names them."""
    sender = KVSender(snapshot.request_id, segments, chunk_bytes)
    refs = await holder.adopt.remote(sender.header.transfer_id, list(sender.chunks()))
    return HandoffTicket(snapshot, sender.header, refs)


async def receive(ticket: HandoffTicket, receiver: KVReceiver,
                  fetch: Callable[[Any], Awaitable[KVChunk]] | None = None) -> list[bytes]:
    """Fetch the ticket's chunks from where ``receiver`` asks to resume; the reassembled segments.

    A failed fetch propagates and leaves the receiver where it was (TRANSFERRING): call again to resume.
    """
    get = fetch or _await_ref
    for index in range(receiver.next_index, ticket.header.num_chunks):
        receiver.accept(await get(ticket.chunk_refs[index]))
    if receiver.status is not TransferStatus.DONE:
        raise RuntimeError(f"transfer {ticket.header.transfer_id!r} ended without its final chunk")
    return receiver.segments()


async def _await_ref(ref: Any) -> KVChunk:
    return await ref
