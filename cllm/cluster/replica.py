"""EngineReplica: one AsyncLLM behind Ray Serve (the deployment class of `cllm serve --replicas N`).

A request arrives as a GenerateCall and streams RequestOutputs back. It may
leave this replica before it finishes, as a HandoffTicket (its last item):
after its first token when the call is ``prefill_only`` (PD disaggregation),
or when the replica drains. ``resume`` takes a ticket, fetches the KV chunks
from the object store (resumable) and continues the request here.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray

from cllm.cluster.calls import GenerateCall
from cllm.cluster.errors import ReplicaDrainingError
from cllm.cluster.stats_board import ReplicaReport, stats_board
from cllm.cluster.transport import HandoffTicket, chunk_holder, publish, receive
from cllm.config import CllmConfig
from cllm.engine.async_llm import AsyncLLM
from cllm.errors import RequestHandedOffError
from cllm.handoff.transfer import KVReceiver
from cllm.outputs import EmbeddingOutput, RequestOutput

log = logging.getLogger("cllm.cluster")
STATS_PERIOD_S = 0.5
DRAIN_WAIT_S = 30.0  # at exit, how long a draining replica waits for its tickets to be taken


class EngineReplica:
    """One engine replica. ``role``: "both", "prefill" or "decode"."""

    async def __init__(self, config: dict[str, Any], role: str = "both") -> None:
        self.config = CllmConfig.model_validate(config)
        self.role = role
        self.engine = AsyncLLM(config=self.config)
        self.engine.start()
        self._tickets: dict[str, asyncio.Future[HandoffTicket]] = {}
        self._receivers: dict[str, KVReceiver] = {}
        self._holder = chunk_holder()
        self._board = stats_board()
        self._replica = ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
        self._loop = asyncio.get_running_loop()
        self._poster = asyncio.ensure_future(self._post_stats())  # so /metrics counts idle replicas too
        self._draining = False
        atexit.register(self._drain_at_exit)  # SIGTERM ends a Ray worker through sys.exit: atexit runs

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
        """Embeddings of token-id inputs (the ingress tokenised them), batched with this replica's other
        embed calls (AsyncLLM.embed)."""
        return await self.engine.embed(inputs)

    async def resume(self, ticket: HandoffTicket) -> AsyncIterator[RequestOutput]:
        """Continue a request another replica handed off; streams from where it stopped there."""
        self._refuse_if_draining()
        rid = ticket.snapshot.request_id
        receiver = self._receivers.setdefault(rid, KVReceiver(ticket.header))  # a retried call resumes it
        segments = await receive(ticket, receiver)
        self._receivers.pop(rid, None)
        self._holder.release.remote(ticket.header.transfer_id)
        gen = self.engine.resume(ticket.snapshot, segments)
        async for item in self._relay(rid, gen, prefill_only=False):
            yield item

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise ReplicaDrainingError(f"replica {self._replica} is draining")

    async def embed(self, inputs: Any) -> list[EmbeddingOutput]:
        """Embeddings (AsyncLLM.embed)."""
        return await self.engine.embed(inputs)

    async def _relay(self, rid: str, gen: AsyncIterator[RequestOutput],
                     prefill_only: bool) -> AsyncIterator[RequestOutput | HandoffTicket]:
        ticket = asyncio.get_running_loop().create_future()
        self._tickets[rid] = ticket
        try:
            async with contextlib.aclosing(gen):
                try:
                    async for out in gen:
                        yield out
                        if prefill_only and not out.finished:
                            prefill_only = False
                            asyncio.ensure_future(self._export(rid))
                except RequestHandedOffError:
                    yield await ticket
        finally:
            self._tickets.pop(rid, None)

    async def _export(self, rid: str) -> bool:
        """Take a request out of the engine and publish its KV; its stream ends with the ticket."""
        future = self._tickets.get(rid)
        try:
            snapshot, segments = await self.engine.export_request(rid)
        except (KeyError, ValueError):
            return False  # it finished meanwhile, or has n > 1 choices: it stays and ends here
        chunk_bytes = self.config.cluster.handoff_chunk_bytes
        ticket = await publish(snapshot, segments, chunk_bytes, self._holder)
        if future is not None and not future.done():
            future.set_result(ticket)
        return True

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
        while True:
            report = ReplicaReport(self._replica, self.role, os.getpid(), self.engine.stats(),
                                   self.engine.running_requests())
            with contextlib.suppress(Exception):
                await self._board.post.remote(report)
            await asyncio.sleep(STATS_PERIOD_S)

    async def __del__(self) -> None:
        self._poster.cancel()
        with contextlib.suppress(Exception):
            await self._board.remove.remote(self._replica)
        await self.engine.shutdown(grace_s=0.0)
