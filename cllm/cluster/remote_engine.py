"""RemoteEngine: the ingress side of a Ray Serve deployment, with the AsyncLLM surface the server uses.

The FastAPI app of cllm.server runs unchanged on top of it: requests are
tokenised and validated here (so bad input fails before anything is routed),
routed to an engine replica through a DeploymentHandle (the PrefixAffinityRouter
picks the replica from the prompt's prefix keys), and streamed back. When a
replica hands a request off (PD after prefill, or a draining replica), the
stream ends with a ticket and the request continues on a decode/other replica.
Stats come from the StatsBoard the replicas post to, summed over live replicas.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import ray

from cllm.backends.base import Tokenizer
from cllm.cluster.calls import GenerateCall
from cllm.cluster.errors import ReplicaDiedError, ReplicaDrainingError
from cllm.cluster.prefix import prefix_keys
from cllm.cluster.stats_board import ReplicaReport, aggregate
from cllm.cluster.transport import HandoffTicket, HolderClient
from cllm.config import CllmConfig
from cllm.engine.llm_engine import LLMEngine, Prompt
from cllm.multimodal.prompt import ids_without_images
from cllm.engine.stats import EngineStats, RunningRequestInfo
from cllm.errors import EngineDeadError, QueueFullError
from cllm.outputs import EmbeddingOutput, RequestOutput
from cllm.sampling.params import SamplingParams

log = logging.getLogger("cllm.cluster")
STATS_POLL_S = 0.5
MAX_HOPS = 8  # a request sent on more often than this is failed (replicas draining in a loop)
DRAINING_RETRY_S = 0.2  # pause before sending a request on after it reached a draining replica


def load_tokenizer(config: CllmConfig) -> Tokenizer:
    """The model's tokenizer without its weights where the backend allows (llama.cpp: vocab only)."""
    if config.model.backend == "llama_cpp":
        from cllm.backends.llama_cpp.native import LlamaModelHandle
        from cllm.backends.llama_cpp.tokenizer import LlamaCppTokenizer
        from cllm.model_path import resolve_model_path

        return LlamaCppTokenizer(model=LlamaModelHandle(path=resolve_model_path(config.model.model), vocab_only=True),
                                 chat_template=config.model.chat_template)
    from cllm.backends.registry import create_backend

    return create_backend(config).tokenizer  # other backends: the whole backend, for its tokenizer


class RemoteEngine:
    """Engine replicas behind DeploymentHandles, seen as one engine."""

    # The prompt checks of the in-process engine, reused as they are: they only need ``tokenizer``,
    # ``config``, ``max_model_len`` and a ``_chat`` slot, which this class has.
    tokenize_prompt = LLMEngine.tokenize_prompt
    tokenize_chat = LLMEngine.tokenize_chat
    check_images = LLMEngine.check_images
    expanded_ids = staticmethod(ids_without_images)
    supports_images = False  # replicas take text prompts only: an image is refused with a 400 here
    apply_chat_template = LLMEngine.apply_chat_template
    resolve_max_tokens = LLMEngine.resolve_max_tokens

    def __init__(self, config: CllmConfig, info: dict[str, Any], engines: Any, decoders: Any | None,
                 board: Any, tokenizer: Tokenizer, holder: HolderClient | None = None, model: str = "") -> None:
        self.config = config
        self._model = model  # the declared model whose replicas' reports are this engine's
        self.tokenizer = tokenizer
        self.max_model_len: int = info["max_model_len"]
        self.model_name: str = info["model_name"]
        self._chat = None
        self._engines = engines  # colocated replicas, or the prefill replicas under PD
        self._decoders = decoders  # PD decode replicas; None = colocated
        self._board = board
        self._holder = holder  # releases the chunks of a ticket no replica took (the client left)
        self._reports: list[ReplicaReport] = []
        self._poller: asyncio.Task[None] | None = None
        self._accepting = True

    # ------------------------------------------------------------------ info
    @property
    def is_running(self) -> bool:
        return self._accepting

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.ensure_future(self._poll_stats())

    def stats(self) -> EngineStats | None:
        return aggregate([r.stats for r in self._reports])

    def running_requests(self) -> list[RunningRequestInfo]:
        return [info for r in self._reports for info in r.running]

    def replica_reports(self) -> list[ReplicaReport]:
        """The latest report of each live replica (role, pid, stats)."""
        return list(self._reports)

    async def refresh_stats(self) -> None:
        self._reports = [r for r in await self._board.reports.remote() if r.model == self._model]

    async def _poll_stats(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh_stats()
            await asyncio.sleep(STATS_POLL_S)

    # ------------------------------------------------------------- requests
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, timeout_s: float | None = None,
                       on_queued: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs from whichever replicas run it. ``on_queued`` is called with
        the first item a replica sends: only then is the request known to be queued over there."""
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        params = params or SamplingParams()
        ids = await asyncio.to_thread(self.tokenize_prompt, prompt)
        self.resolve_max_tokens(len(ids), params)
        params.check_vocab(self.tokenizer.vocab_size)
        call = GenerateCall(request_id or f"req-{uuid.uuid4().hex[:16]}", prompt, params, priority, timeout_s,
                            prefix_keys(ids, self.config.cluster.route_block_tokens),
                            prefill_only=self._decoders is not None and params.n == 1)
        send = functools.partial(self._engines.options(stream=True).generate.remote, call)
        target: GenerateCall | HandoffTicket = call  # what is being sent: the call, then each hand-off
        resuming: HandoffTicket | None = None  # the hand-off being resumed, until a replica took it
        try:
            for _ in range(MAX_HOPS):
                ticket: HandoffTicket | None = None
                started = False
                try:
                    async for item in _relay(send()):
                        started = True
                        resuming = None  # a replica resumed it (and released its chunks)
                        if on_queued is not None:
                            on_queued()
                            on_queued = None
                        if isinstance(item, HandoffTicket):
                            ticket = item
                        else:
                            yield item
                except ReplicaDrainingError as err:
                    if started:
                        raise
                    if err.replica is not None:  # the router never picks that replica for it again
                        target.avoid_replicas = target.avoid_replicas | {err.replica}
                    await asyncio.sleep(DRAINING_RETRY_S)  # Serve has not yet taken the replica out of routing
                    continue
                except ray.exceptions.RayTaskError:
                    # A hand-off whose KV transfer broke off (a chunk fetch failed) is asked for again: the
                    # router sends it back to the same replica (its prefix keys), whose receiver resumes from
                    # the last acknowledged chunk.
                    if started or resuming is None:
                        raise
                    log.warning("hand-off of %s failed before its first output; resuming it", call.request_id)
                    continue
                if ticket is None:
                    return
                ticket.prefix_keys = call.prefix_keys
                target = resuming = ticket
                send = functools.partial(self._resume, ticket)
            raise EngineDeadError(f"request {call.request_id!r} was sent on more than {MAX_HOPS} times")
        finally:
            if resuming is not None and self._holder is not None:  # no replica took it: nobody else releases it
                self._holder.release(resuming.header.transfer_id)

    def _resume(self, ticket: HandoffTicket) -> Any:
        return (self._decoders or self._engines).options(stream=True).resume.remote(ticket)

    async def embed(self, inputs: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """Embeddings (see AsyncLLM.embed): tokenised and checked here (bad input: ValueError, a 400),
        embedded on one replica, which batches concurrent calls; a replica's own errors come out as
        raised there and a dead replica as ReplicaDiedError (503), as for generate."""
        if not self._accepting:
            raise EngineDeadError("server is shutting down")
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        if items and all(isinstance(t, int) for t in items):
            items = [items]  # one token-id input
        token_ids = await asyncio.to_thread(self._embedding_ids, items)
        with _ray_errors():
            return await self._engines.embed.remote(token_ids)

    def _embedding_ids(self, items: list[Prompt]) -> list[list[int]]:
        if not items:
            raise ValueError("embedding inputs must be a non-empty list of texts or token-id lists")
        token_ids = []
        for i, item in enumerate(items):
            try:
                token_ids.append(self.tokenize_prompt(item))
            except (ValueError, TypeError) as err:
                raise ValueError(f"input {i}: {err}") from None
        return token_ids

    async def shutdown(self, grace_s: float = 0.0) -> None:
        self._accepting = False
        if self._poller is not None:
            self._poller.cancel()


async def _relay(response: Any) -> AsyncIterator[Any]:
    """A replica's stream; Ray's errors become ours; closing it early cancels the replica's request."""
    done = False
    try:
        with _ray_errors():
            async for item in response:
                yield item
        done = True
    finally:
        if not done:
            response.cancel()


@contextlib.contextmanager
def _ray_errors() -> Iterator[None]:
    """A replica's own errors (bad input, full queue, dead engine) come out as raised there; a dead
    replica becomes ReplicaDiedError."""
    try:
        yield
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else None
        if isinstance(cause, (ValueError, TypeError, EngineDeadError, QueueFullError)):
            raise cause from None
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
        raise ReplicaDiedError(f"the replica serving this request died ({type(err).__name__}); retry it") from None
