"""EngineReplica: one AsyncLLM behind Ray Serve (the deployment class of `cllm serve --replicas N`).

A request arrives as a GenerateCall and streams RequestOutputs back. It may
leave this replica before it finishes, as a HandoffTicket (its last item):
after its first token when the call is ``prefill_only`` (PD disaggregation),
or when the replica drains. ``resume`` takes a ticket, fetches the KV chunks
from the object store (resumable) and continues the request here.

Every hand-off ends one way or another (issue 27): a request whose KV cannot
be published (holder gone, object store full) continues on this replica; one
whose chunks were lost (holder died) is resumed without them and recomputes
its KV; receivers and the holder's chunks are released on every path, and
abandoned ones expire.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import ray

from cllm.cluster.calls import GenerateCall
from cllm.cluster.errors import ReplicaDrainingError
from cllm.cluster.stats_board import ReplicaReport, stats_board
from cllm.cluster.transport import HandoffTicket, HolderClient, chunks_lost, publish, receive
from cllm.config import CllmConfig
from cllm.engine.async_llm import AsyncLLM
from cllm.errors import EngineDeadError, RequestHandedOffError
from cllm.handoff.snapshot import RequestSnapshot
from cllm.handoff.transfer import KVReceiver, TransferStatus
from cllm.outputs import EmbeddingOutput, RequestOutput

log = logging.getLogger("cllm.cluster")
STATS_PERIOD_S = 0.5
DRAIN_WAIT_S = 30.0  # at exit, how long a draining replica waits for its tickets to be taken
HOLDER_SWEEP_PERIODS = 20  # every this many stats periods, ask the holder to drop expired chunks


@dataclass(slots=True)
class ContinueHere:
    """An export whose KV could not be published: the request continues on this replica."""

    snapshot: RequestSnapshot  # the exported request
    segments: list[bytes]  # its KV, imported back
    reason: str  # why the hand-off failed (logged)


@dataclass(slots=True)
class _Receiving:
    """A transfer this replica is fetching; kept after a failed fetch so a retried resume goes on
    from its last chunk, and dropped when it has not been touched for the hand-off TTL."""

    receiver: KVReceiver
    touched: float  # time.monotonic() of the latest resume call on it


def serve_replica_id() -> str | None:
    """This replica's Serve id (what the router sees as ``replica_id.unique_id``); None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


class EngineReplica:
    """One engine replica. ``role``: "both", "prefill" or "decode"."""

    async def __init__(self, config: dict[str, Any], role: str = "both", model: str = "") -> None:
        cfg = CllmConfig.model_validate(config)
        self.model = model  # the declared model this replica serves (its reports say so)
        engine = AsyncLLM(config=cfg)
        engine.start()
        name = ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
        self._attach(cfg, role, engine, HolderClient(ttl_s=cfg.cluster.handoff_ttl_s), stats_board(), name,
                     serve_replica_id())
        self._poster = asyncio.ensure_future(self._post_stats())  # so /metrics counts idle replicas too
        atexit.register(self._drain_at_exit)  # SIGTERM ends a Ray worker through sys.exit: atexit runs

    def _attach(self, config: CllmConfig, role: str, engine: AsyncLLM, holder: HolderClient, board: Any,
                name: str, serve_id: str | None) -> None:
        """Everything but the Ray and Serve wiring (the unit tests build replicas through this)."""
        self.config = config
        self.role = role
        self.engine = engine
        self._tickets: dict[str, asyncio.Future[HandoffTicket | ContinueHere]] = {}
        self._receivers: dict[str, _Receiving] = {}  # transfer id -> its receiver
        self._holder = holder
        self._board = board
        self._replica = name
        self._serve_id = serve_id
        self._loop = asyncio.get_running_loop()
        self._background: set[asyncio.Task[Any]] = set()  # exports in flight (the loop keeps weak references only)
        self._draining = False

    # ---------------------------------------------------------------- info
    async def info(self) -> dict[str, Any]:
        """What the ingress needs to know at startup."""
        return {"max_model_len": self.engine.max_model_len, "model_name": self.engine.model_name,
                "vocab_size": self.engine.tokenizer.vocab_size, "role": self.role, "pid": os.getpid()}

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop fails it, and Serve replaces the replica."""
        if not self.engine.is_running:
            raise RuntimeError("the engine loop is not running")

    # ------------------------------------------------------------ requests
    async def generate(self, call: GenerateCall) -> AsyncIterator[RequestOutput | HandoffTicket]:
        """Stream a request's outputs; the last item is a HandoffTicket if it moves elsewhere."""
        self._refuse_if_draining()
        gen = self.engine.generate(call.prompt, call.params, request_id=call.request_id, priority=call.priority,
                                   timeout_s=call.timeout_s)
        async for item in self._relay(call.request_id, gen, call.prefill_only):
            yield item

    async def embed(self, inputs: list[list[int]]) -> list[EmbeddingOutput]:
        """Embeddings of token-id inputs (the ingress tokenised and checked them), batched with this
        replica's other embed calls (AsyncLLM.embed)."""
        return await self.engine.embed(inputs)

    async def resume(self, ticket: HandoffTicket) -> AsyncIterator[RequestOutput | HandoffTicket]:
        """Continue a request another replica handed off; streams from where it stopped there."""
        self._refuse_if_draining()
        segments = await self._fetch(ticket)
        gen = self.engine.resume(ticket.snapshot, segments)
        async for item in self._relay(ticket.snapshot.request_id, gen, prefill_only=False):
            yield item

    async def _fetch(self, ticket: HandoffTicket) -> list[bytes]:
        """The ticket's KV segments. A fetch that fails on the way keeps its receiver (the ingress asks
        again and this resumes from the last chunk; untouched, it expires); every other end releases
        the receiver and the holder's chunks. Chunks lost for good (the holder died) give [] : the
        request is resumed without KV and recomputes it."""
        self._expire_receivers()
        tid = ticket.header.transfer_id
        entry = self._receivers.get(tid)
        if entry is None or entry.receiver.header != ticket.header:
            entry = self._receivers[tid] = _Receiving(KVReceiver(ticket.header), time.monotonic())
        entry.touched = time.monotonic()
        keep = False
        try:
            return await receive(ticket, entry.receiver)
        except Exception as err:
            if chunks_lost(err):
                log.warning("hand-off %s lost its KV chunks (%s); the request recomputes it", tid, type(err).__name__)
                return []
            keep = entry.receiver.status is not TransferStatus.FAILED  # a failed transfer cannot resume
            raise
        finally:
            if not keep:
                self._receivers.pop(tid, None)
                self._holder.release(tid)

    def _expire_receivers(self) -> None:
        deadline = time.monotonic() - self.config.cluster.handoff_ttl_s
        for tid in [t for t, e in self._receivers.items() if e.touched < deadline]:
            del self._receivers[tid]
            self._holder.release(tid)

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise ReplicaDrainingError(f"replica {self._replica} is draining", replica=self._serve_id)

    async def _relay(self, rid: str, gen: AsyncIterator[RequestOutput],
                     prefill_only: bool) -> AsyncIterator[RequestOutput | HandoffTicket]:
        """Relay the engine's stream; when the engine lets the request go, end with its ticket, or
        (the ticket could not be made) go on with the request here."""
        unsent: HandoffTicket | None = None  # a ticket not yet handed out: released if we never do
        try:
            while True:
                outcome = None
                ticket: asyncio.Future[HandoffTicket | ContinueHere] = self._loop.create_future()
                self._tickets[rid] = ticket
                try:
                    async with contextlib.aclosing(gen):
                        try:
                            async for out in gen:
                                yield out
                                if prefill_only and not out.finished:
                                    prefill_only = False
                                    self._spawn(self._export(rid))
                        except RequestHandedOffError:
                            outcome = await ticket
                            if isinstance(outcome, HandoffTicket):
                                unsent = outcome
                finally:
                    if self._tickets.get(rid) is ticket:
                        del self._tickets[rid]
                    if not ticket.done():
                        ticket.cancel()  # an export still publishing sees it and releases what it put
                if isinstance(outcome, HandoffTicket):
                    unsent = None
                    yield outcome
                    return
                if not isinstance(outcome, ContinueHere):
                    return  # the stream ended here
                log.warning("hand-off of %s failed (%s); it continues on this replica", rid, outcome.reason)
                gen = self.engine.resume(outcome.snapshot, outcome.segments)
        finally:
            if unsent is not None:
                self._holder.release(unsent.header.transfer_id)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _export(self, rid: str) -> bool:
        """Take a request out of the engine and publish its KV; its stream ends with the ticket, or
        continues here if the KV cannot be published. The ticket ``_relay`` awaits always resolves."""
        future = self._tickets.get(rid)
        if future is None or future.done():
            return False  # its stream is gone (the client left): nothing to hand off
        try:
            snapshot, segments = await self.engine.export_request(rid)
        except (KeyError, ValueError):
            return False  # it finished meanwhile, or has n > 1 choices: it stays and ends here
        except Exception as err:  # engine dead: the request's stream gets the engine's own error
            log.warning("export of %s failed: %s", rid, err)
            return False
        outcome: HandoffTicket | ContinueHere | None = None
        delivered = False
        try:
            ticket = await publish(snapshot, segments, self.config.cluster.handoff_chunk_bytes, self._holder)
            if self._serve_id is not None:
                ticket.avoid_replicas = frozenset({self._serve_id})  # it left here: never route it back
            outcome = ticket
        except Exception as err:  # holder gone for good, object store full, oversized chunks, ...
            outcome = ContinueHere(snapshot, segments, f"{type(err).__name__}: {err}")
        finally:
            if future.done():  # the stream ended meanwhile: nobody takes the ticket
                if isinstance(outcome, HandoffTicket):
                    self._holder.release(outcome.header.transfer_id)
            elif outcome is None:  # we were cancelled (the replica is going away)
                future.set_exception(EngineDeadError(f"the hand-off of {rid!r} was interrupted"))
            else:
                future.set_result(outcome)
                delivered = True
        return delivered and isinstance(outcome, HandoffTicket)

    # ------------------------------------------------------------ draining
    async def drain(self) -> int:
        """Hand every live request to the other replicas (through the ingress); how many moved."""
        self._draining = True
        self.engine._accepting = False  # new requests get 503 here; Serve routes them to the others
        moved = await asyncio.gather(*(self._export(rid) for rid in self.engine.live_request_ids()))
        return sum(moved)

    def _drain_at_exit(self) -> None:
        """On SIGTERM: hand running requests over, then wait until the ingress has taken every ticket."""
        loop = self._loop
        if loop.is_closed() or self._draining:
            return
        try:
            moved = asyncio.run_coroutine_threadsafe(self.drain(), loop).result(timeout=DRAIN_WAIT_S)
            log.warning("draining: handed %d running request(s) to other replicas", moved)
            # Each moved request's stream ends once its ticket went out; requests that cannot move
            # (n > 1) get the server's grace period to finish here.
            deadline = time.monotonic() + max(DRAIN_WAIT_S, self.config.server.shutdown_grace_s)
            while (self._tickets or self.engine.live_request_ids()) and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception as err:  # exiting anyway: the requests fail as they would have without a drain
            log.error("draining failed: %s", err)

    # --------------------------------------------------------------- stats
    async def _post_stats(self) -> None:
        for period in itertools.count():
            report = ReplicaReport(self._replica, self.role, os.getpid(), self.engine.stats(),
                                   self.engine.running_requests(), model=getattr(self, "model", ""))
            with contextlib.suppress(Exception):
                await self._board.post.remote(report)
            self._expire_receivers()
            if period % HOLDER_SWEEP_PERIODS == 0:
                with contextlib.suppress(Exception):
                    await self._holder.held()  # the holder drops expired chunks on every call
            await asyncio.sleep(STATS_PERIOD_S)

    async def __del__(self) -> None:
        self._poster.cancel()
        with contextlib.suppress(Exception):
            await self._board.remove.remote(self._replica)
        await self.engine.shutdown(grace_s=0.0)
