"""Load: N requests from many concurrent clients through the server's slots; nothing lost or hung,
every slot free at the end, memory back where it started."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from cllm.stress.engine_state import EngineState, engine_state, wait_idle
from cllm.stress.server_process import ServerProcess
from cllm.stress.sse import Outcome, run_request

TOPICS = ("the sea", "bread", "a dragon", "winter", "trains", "music", "a cat", "the moon")


@dataclass(slots=True)
class LoadResult:
    """Figures of one load run."""

    requests: int  # requests sent
    completed: int  # finished normally
    lost: int  # ended any other way (error status, error event, broken stream)
    hung: int  # no answer within the client timeout
    seconds: float  # wall time of the run
    idle_after: EngineState  # engine state once the run ended
    rss_start: int  # server RSS after warm-up, bytes
    rss_end: int  # server RSS after the run, bytes
    details: list[str]  # what the first lost requests got

    @property
    def rss_growth(self) -> float:
        return self.rss_end / self.rss_start - 1.0


def request_body(i: int, max_tokens: int) -> dict:
    return {"prompt": f"Request {i}. Write one sentence about {TOPICS[i % len(TOPICS)]}.",
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i}


async def _client(client: httpx.AsyncClient, next_id: list[int], total: int, max_tokens: int, timeout_s: float,
                  outcomes: list[Outcome | None]) -> None:
    while next_id[0] < total:
        i = next_id[0]
        next_id[0] += 1
        try:
            outcomes[i] = await asyncio.wait_for(
                run_request(client, request_body(i, max_tokens), stream=i % 2 == 0), timeout_s)
        except asyncio.TimeoutError:
            outcomes[i] = None
        except httpx.HTTPError as exc:
            outcomes[i] = Outcome(None, False, False, False, detail=f"{type(exc).__name__}: {exc}")


async def run_load(server: ServerProcess, *, requests: int, clients: int = 64, max_tokens: int = 8,
                   timeout_s: float = 300.0, warmup: int = 16) -> LoadResult:
    """``requests`` requests (every other one streamed) from ``clients`` concurrent clients."""
    async with server.async_http(timeout=timeout_s, max_connections=clients) as client:
        await asyncio.gather(*(run_request(client, request_body(-1 - i, max_tokens), stream=i % 2 == 0)
                               for i in range(warmup)))
        rss_start = server.rss_bytes()
        outcomes: list[Outcome | None] = [None] * requests
        start = time.monotonic()
        next_id = [0]
        await asyncio.gather(*(_client(client, next_id, requests, max_tokens, timeout_s, outcomes)
                               for _ in range(clients)))
        seconds = time.monotonic() - start
        await wait_idle(client, timeout_s=10)
        idle_after = await engine_state(client)
    hung = sum(1 for o in outcomes if o is None)
    completed = sum(1 for o in outcomes if o is not None and o.completed)
    details = [f"{o.status} {o.detail}" for o in outcomes if o is not None and not o.completed][:5]
    return LoadResult(requests, completed, requests - completed - hung, hung, seconds, idle_after,
                      rss_start, server.rss_bytes(), details)
