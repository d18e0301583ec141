"""Issue 27 item 1 as a scenario: the KV chunk holder is killed while requests run under PD.

Requests stream from a prefill/decode deployment; after ``kill_after_s`` the holder actor is killed
(for good: Ray does not restart it), then a second wave is sent. Tickets published before the kill
lose their chunks (the decode replica recomputes the KV), exports after it find the holder gone (the
prefill replica resolves it again by name, or continues the request itself). Before issue 27 the
second wave hung after its first token, the client getting keep-alives forever. The verdict
(cllm.stress.verdicts.holder_kill_failures): no request hangs, every one ends with its tokens or an
error event, and every request sent after the kill completes.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from cllm.stress.sse import Outcome, run_request

PROMPTS = ("Tell me about lighthouses.", "Describe a busy harbour.", "What do owls eat?",
           "Explain how bread rises.", "Why is the sky blue?", "Name three rivers in Europe.")


@dataclass(slots=True)
class HolderKillResult:
    """How each request of the two waves ended (``hung``: none within the timeout)."""

    before: list[Outcome] = field(default_factory=list)  # sent before the kill (some mid-hand-off at it)
    after: list[Outcome] = field(default_factory=list)  # sent after the kill
    seconds: float = 0.0  # the whole scenario


async def _one(client: httpx.AsyncClient, prompt: str, max_tokens: int, timeout_s: float) -> Outcome:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        return await asyncio.wait_for(run_request(client, body, stream=True), timeout_s)
    except asyncio.TimeoutError:
        return Outcome(None, False, False, False, detail=f"hung: no end within {timeout_s:.0f} s")
    except httpx.HTTPError as err:
        return Outcome(None, False, False, False, detail=f"{type(err).__name__}: {err}")


async def run_holder_kill(base_url: str, kill: Callable[[], None], *, per_wave: int = 4, max_tokens: int = 24,
                          kill_after_s: float = 0.5, timeout_s: float = 60.0) -> HolderKillResult:
    """Two waves of ``per_wave`` streamed requests around ``kill()`` (called in a thread)."""
    start = time.monotonic()
    timeout = httpx.Timeout(timeout_s + 10)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        first = [asyncio.ensure_future(_one(client, PROMPTS[i % len(PROMPTS)], max_tokens, timeout_s))
                 for i in range(per_wave)]
        await asyncio.sleep(kill_after_s)
        await asyncio.to_thread(kill)
        second = [asyncio.ensure_future(_one(client, PROMPTS[(i + 3) % len(PROMPTS)] + " Briefly.", max_tokens,
                                             timeout_s)) for i in range(per_wave)]
        before, after = await asyncio.gather(asyncio.gather(*first), asyncio.gather(*second))
    return HolderKillResult(list(before), list(after), time.monotonic() - start)
