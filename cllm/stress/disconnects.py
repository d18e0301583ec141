"""Disconnects: streams closed after their first chunk and non-streamed requests cut by a client
timeout; the engine must be idle (every slot free) right after the last close."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from cllm.stress.engine_state import wait_idle
from cllm.stress.server_process import ServerProcess


@dataclass(slots=True)
class DisconnectResult:
    """Figures of one disconnect storm."""

    streams_closed: int  # streams that got a first chunk and were then closed
    requests_cut: int  # non-streamed requests whose client gave up
    # Seconds from the last close until /v1/engine showed the engine idle (includes the polling
    # request's own latency); None = not within 10 s.
    idle_after_s: float | None


def _body(i: int) -> dict:
    # Long enough that no request finishes before its client leaves.
    return {"prompt": f"Story {i}: once upon a time", "max_tokens": 400, "temperature": 0.8, "ignore_eos": True}


async def _stream_and_close(client: httpx.AsyncClient, i: int) -> float:
    async with client.stream("POST", "/v1/completions", json={**_body(i), "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                break  # the first chunk came: leave
    return time.monotonic()


async def _cut(client: httpx.AsyncClient, i: int, cut_after_s: float) -> float:
    try:
        await client.post("/v1/completions", json=_body(i), timeout=cut_after_s)
    except httpx.TimeoutException:
        pass
    return time.monotonic()


async def _bounded(limit: asyncio.Semaphore, work) -> float:
    async with limit:
        return await work


async def run_disconnects(server: ServerProcess, *, streams: int = 100, cut: int = 50, concurrency: int = 16,
                          cut_after_s: float = 0.5) -> DisconnectResult:
    limit = asyncio.Semaphore(concurrency)
    async with server.async_http(timeout=120.0, max_connections=concurrency + 4) as client:
        jobs = [_bounded(limit, _stream_and_close(client, i)) for i in range(streams)]
        jobs += [_bounded(limit, _cut(client, streams + i, cut_after_s)) for i in range(cut)]
        closes = await asyncio.gather(*jobs)
        idle = await wait_idle(client, timeout_s=10.0)
        idle_after = None if idle is None else time.monotonic() - max(closes)
    return DisconnectResult(streams, cut, idle_after)
