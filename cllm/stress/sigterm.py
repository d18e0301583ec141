"""SIGTERM under load: every accepted request either completes or ends with a clean error (an error
event then [DONE] for streams, an OpenAI error body for the rest), and the process exits 0."""
from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import httpx

from cllm.stress.server_process import ServerProcess
from cllm.stress.sse import Outcome, json_outcome, stream_outcome


@dataclass(slots=True)
class SigtermResult:
    """Figures of one SIGTERM-under-load run."""

    accepted: int  # requests the server answered with a status
    completed: int  # finished normally
    clean_errors: int  # ended with an error event / error body (aborted at the grace deadline, 503 draining)
    broken: list[str]  # anything else: cut streams, transport errors on accepted requests
    exit_code: int  # the server's exit status


async def _request(client: httpx.AsyncClient, i: int, stream: bool, first_chunk: asyncio.Event) -> Outcome | str:
    # Streams are long (cut at the grace deadline: error event); plain requests short (they finish).
    body = {"prompt": f"Essay {i}: the history of", "max_tokens": 300 if stream else 8, "ignore_eos": True,
            "stream": stream}
    try:
        if not stream:
            return json_outcome(await client.post("/v1/completions", json=body))
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            return await stream_outcome(resp, on_data=first_chunk.set)
    except httpx.HTTPError as exc:
        return f"{i}: {type(exc).__name__}: {exc}"


async def run_sigterm(server: ServerProcess, *, streams: int = 16, plain: int = 8) -> SigtermResult:
    """Start ``plain`` short requests, then ``streams`` long ones; SIGTERM the server once a stream has
    tokens; read every answer."""
    first_chunk = asyncio.Event()
    async with server.async_http(timeout=120.0, max_connections=streams + plain + 4) as client:
        tasks = [asyncio.ensure_future(_request(client, i, i >= plain, first_chunk)) for i in range(streams + plain)]
        await asyncio.wait_for(first_chunk.wait(), 60)
        await asyncio.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
    exit_code = await asyncio.to_thread(server.proc.wait, 60)
    result = SigtermResult(0, 0, 0, [], exit_code)
    for o in outcomes:
        if isinstance(o, str):
            result.broken.append(o)
            continue
        result.accepted += 1
        if o.completed:
            result.completed += 1
        elif o.error_event and o.done or (o.status is not None and o.status >= 400 and o.detail):
            result.clean_errors += 1
        else:
            result.broken.append(f"status {o.status} done={o.done} error_event={o.error_event} {o.detail}")
    return result
