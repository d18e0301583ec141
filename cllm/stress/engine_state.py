"""The server's engine state as the battery checks it: idle means no request running or waiting and
every slot free (idle slots may still hold prefix cache; that is not "in use")."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx


@dataclass(slots=True, frozen=True)
class EngineState:
    """The counters of GET /v1/engine the battery looks at."""

    running: int  # requests running
    waiting: int  # requests waiting
    slots_in_use: int  # slots owned by a request

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.slots_in_use == 0


async def engine_state(client: httpx.AsyncClient) -> EngineState:
    stats = (await client.get("/v1/engine")).json()["stats"]
    return EngineState(stats["num_running"], stats["num_waiting"], stats["slots_in_use"])


async def wait_idle(client: httpx.AsyncClient, timeout_s: float, poll_s: float = 0.005) -> float | None:
    """Seconds until the engine was idle (polled), or None if it was not within ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if (await engine_state(client)).idle:
            return time.monotonic() - start
        await asyncio.sleep(poll_s)
    return None
