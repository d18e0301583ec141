"""Flood and slow readers: more requests than the queue holds get 429 with Retry-After, and neither a
flood nor clients that read their streams slowly make the server's memory grow without bound."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

import httpx

from cllm.stress.engine_state import wait_idle
from cllm.stress.server_process import ServerProcess


@dataclass(slots=True)
class MemoryTrace:
    """Server RSS around a scenario, bytes."""

    before: int  # just before it
    peak: int  # highest sample during it
    after: int  # once the engine was idle again

    @property
    def peak_growth(self) -> int:
        return self.peak - self.before


@dataclass(slots=True)
class FloodResult:
    """Figures of one flood."""

    statuses: dict[int, int]  # HTTP status -> count
    refused_without_retry_after: int  # 429s missing Retry-After
    memory: MemoryTrace


@dataclass(slots=True)
class SlowReaderResult:
    """Figures of one slow-reader run."""

    readers: int  # concurrent streams read slowly
    seconds: float  # how long they were read
    chunks_read: int  # SSE lines read in all
    memory: MemoryTrace


async def _sample_rss(server: ServerProcess, stop: asyncio.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], server.rss_bytes())
        await asyncio.sleep(0.05)


async def _traced(server: ServerProcess, client: httpx.AsyncClient, work) -> tuple[object, MemoryTrace]:
    before = server.rss_bytes()
    peak = [before]
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample_rss(server, stop, peak))
    try:
        result = await work
    finally:
        stop.set()
        await sampler
    await wait_idle(client, timeout_s=30.0)
    return result, MemoryTrace(before, peak[0], server.rss_bytes())


async def _one(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": f"Flood {i}: say hi", "max_tokens": 8})


async def run_flood(server: ServerProcess, *, requests: int = 300) -> FloodResult:
    """``requests`` requests at once (the server should hold far fewer in its queue)."""
    async with server.async_http(timeout=300.0, max_connections=requests) as client:
        responses, memory = await _traced(server, client, asyncio.gather(*(_one(client, i) for i in range(requests))))
    statuses = collections.Counter(r.status_code for r in responses)  # type: ignore[union-attr]
    missing = sum(1 for r in responses if r.status_code == 429 and "retry-after" not in r.headers)  # type: ignore[union-attr]
    return FloodResult(dict(statuses), missing, memory)


async def _slow_reader(client: httpx.AsyncClient, i: int, until: float, pause_s: float) -> int:
    body = {"prompt": f"Reader {i}: tell a very long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    lines = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for _ in resp.aiter_lines():
            lines += 1
            if time.monotonic() >= until:
                break
            await asyncio.sleep(pause_s)
    return lines


async def run_slow_readers(server: ServerProcess, *, readers: int = 20, seconds: float = 60.0,
                           pause_s: float = 0.5) -> SlowReaderResult:
    """``readers`` streams each read one line every ``pause_s`` for ``seconds``, then closed."""
    async with server.async_http(timeout=seconds + 60, max_connections=readers + 4) as client:
        until = time.monotonic() + seconds
        counts, memory = await _traced(server, client, asyncio.gather(
            *(_slow_reader(client, i, until, pause_s) for i in range(readers))))
    return SlowReaderResult(readers, seconds, sum(counts), memory)  # type: ignore[arg-type]
