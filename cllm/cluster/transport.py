"""KV hand-off between replicas through Ray's object store.

The exporting replica cuts the KV into chunks (cllm.handoff.transfer); a
long-lived holder actor puts each chunk in the object store, so the holder, not
the replica, owns them: a draining replica may exit before the receiver has
fetched everything, and objects die with their owner (Ray 2.56 removed
``ray.put(_owner=...)``). The receiver releases them when it has them all. The ticket (snapshot, header,
chunk refs) travels through the ingress to the receiving replica, which fetches
chunks in order into a KVReceiver; if a fetch fails mid-way, a later
``receive`` with the same receiver resumes from the last acknowledged chunk.

Failure paths (issue 27): the holder is restarted by Ray when its process dies
(``max_restarts``) and re-resolved by name when it is gone for good
(:class:`HolderClient`); a transfer nobody releases (its client left, its
receiver died) expires after ``ttl_s``; every transfer has its own id, so a
request that comes back to a replica never meets an older transfer of itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from cllm.handoff.snapshot import RequestSnapshot
from cllm.handoff.transfer import KVChunk, KVReceiver, KVSender, TransferHeader, TransferStatus

log = logging.getLogger("cllm.cluster")
HOLDER_NAME = "cllm-kv-holder"
DEFAULT_TTL_S = 300.0  # a published transfer nobody released is dropped after this long
PUBLISH_TIMEOUT_S = 30.0  # one attempt to hand chunks to the holder (a restarting holder answers late)
# Ray errors that mean "the holder actor is not there": the call is retried once on a re-resolved handle.
_HOLDER_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@ray.remote(num_cpus=0)
class ChunkHolder:
    """Puts hand-off chunks in the object store itself, so it owns them: they outlive the replica that
    made them (objects die with their owner) until the receiver releases them or they expire."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._refs: dict[str, tuple[float, list[Any]]] = {}  # transfer id -> (expiry, chunk refs)
        self._ttl_s = ttl_s

    def adopt(self, transfer_id: str, chunks: list[KVChunk], ttl_s: float | None = None) -> list[Any]:
        self._expire()
        refs = [ray.put(chunk) for chunk in chunks]
        self._refs[transfer_id] = (time.monotonic() + (ttl_s or self._ttl_s), refs)
        return refs

    def release(self, transfer_id: str) -> None:
        self._refs.pop(transfer_id, None)
        self._expire()

    def held(self) -> list[str]:
        """Transfers still held (after dropping expired ones)."""
        self._expire()
        return list(self._refs)

    def _expire(self) -> None:
        # Expiry runs on every call: hand-offs keep coming while there is anything to expire, and the
        # replicas call ``held`` from their stats loop, so an idle cluster lets go of them too.
        now = time.monotonic()
        for tid in [t for t, (expiry, _) in self._refs.items() if expiry < now]:
            del self._refs[tid]


def chunk_holder(namespace: str | None = "cllm") -> Any:
    """The holder actor, created on first use (one per Ray namespace, detached from any replica).
    Ray restarts it when its process dies; its chunks are lost then (receivers recompute)."""
    return ChunkHolder.options(name=HOLDER_NAME, namespace=namespace, get_if_exists=True, lifetime="detached",
                               max_restarts=-1, max_task_retries=2).remote()


class HolderClient:
    """A replica's (or the ingress's) handle on the holder. A handle to a holder killed for good stays
    dead; this one looks the holder up by name again (creating it if needed) and retries once."""

    def __init__(self, resolve: Callable[[], Any] = chunk_holder, ttl_s: float = DEFAULT_TTL_S,
                 timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
        self._resolve = resolve
        self._handle: Any = None
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s

    @property
    def handle(self) -> Any:
        if self._handle is None:
            self._handle = self._resolve()
        return self._handle

    async def adopt(self, transfer_id: str, chunks: list[KVChunk]) -> list[Any]:
        """Hand ``chunks`` to the holder; their ObjectRefs. Raises if the holder cannot take them."""
        for attempt in range(2):
            try:
                return await asyncio.wait_for(_as_future(self.handle.adopt.remote(transfer_id, chunks, self.ttl_s)),
                                              self.timeout_s)
            except (*_HOLDER_GONE, asyncio.TimeoutError) as err:
                if attempt:
                    raise
                log.warning("chunk holder unavailable (%s); resolving it again", type(err).__name__)
                self._handle = None
        raise AssertionError("unreachable")

    def release(self, transfer_id: str) -> None:
        """Let the holder drop a transfer's chunks (fire and forget; they expire anyway)."""
        with contextlib.suppress(Exception):
            self.handle.release.remote(transfer_id)

    async def held(self) -> list[str]:
        return await _as_future(self.handle.held.remote())


async def _as_future(ref: Any) -> Any:
    return await ref


@dataclass(slots=True)
class HandoffTicket:
    """What a receiving replica needs to continue a request another replica let go."""

    snapshot: RequestSnapshot  # request state besides the KV
    header: TransferHeader  # chunk geometry; header.transfer_id is unique per hand-off
    chunk_refs: list[Any]  # ObjectRef of each KVChunk, in order
    prefix_keys: tuple[bytes, ...] = ()  # the request's prefix keys: a retried resume is routed where the first went
    avoid_replicas: frozenset[str] = field(default_factory=frozenset)  # Serve replica ids that must not get it (draining)


def new_transfer_id(request_id: str) -> str:
    """A transfer id of its own for each hand-off: a request that comes back to a replica that still
    holds a receiver of an earlier hand-off of it must not resume into that one."""
    return f"{request_id}/{uuid.uuid4().hex[:12]}"


async def publish(snapshot: RequestSnapshot, segments: list[bytes], chunk_bytes: int,
                  holder: HolderClient) -> HandoffTicket:
    """Put a request's KV chunks in the object store (owned by the holder); the ticket names them."""
    sender = KVSender(new_transfer_id(snapshot.request_id), segments, chunk_bytes)
    refs = await holder.adopt(sender.header.transfer_id, list(sender.chunks()))
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


def chunks_lost(err: BaseException) -> bool:
    """The chunks are gone for good (their owner, the holder, died): resuming the fetch cannot help."""
    return isinstance(err, ray.exceptions.ObjectLostError)


async def _await_ref(ref: Any) -> KVChunk:
    return await ref
