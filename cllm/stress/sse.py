"""Client-side reading of one request, streamed or not, into a plain verdict the scenarios count."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass(slots=True)
class Outcome:
    """How one request ended, seen from the client."""

    status: int | None  # HTTP status; None if no response arrived
    completed: bool  # a normal finish ("stop"/"length"; streams: then [DONE])
    error_event: bool  # a stream ended with an OpenAI error event, then [DONE] (a clean failure)
    done: bool  # a stream's [DONE] arrived
    keepalives: int = 0  # SSE comment lines seen
    detail: str = ""  # what went wrong, for reports


def _finish_reasons(payload: dict) -> list[str]:
    return [c.get("finish_reason") for c in payload.get("choices", []) if c.get("finish_reason")]


async def stream_outcome(resp: httpx.Response, on_data: Callable[[], None] | None = None) -> Outcome:
    """Read an SSE response to its end; ``on_data`` is called at each ``data:`` event."""
    outcome = Outcome(resp.status_code, False, False, False)
    if resp.status_code != 200:
        outcome.detail = (await resp.aread()).decode(errors="replace")[:200]
        return outcome
    async for line in resp.aiter_lines():
        if line.startswith(":"):
            outcome.keepalives += 1
        elif line == "data: [DONE]":
            outcome.done = True
        elif line.startswith("data: "):
            if on_data is not None:
                on_data()
            payload = json.loads(line[6:])
            if "error" in payload:
                outcome.error_event = True
                outcome.detail = str(payload["error"].get("code"))
            elif _finish_reasons(payload):
                outcome.completed = True
    outcome.completed = outcome.completed and outcome.done and not outcome.error_event
    return outcome


def json_outcome(resp: httpx.Response) -> Outcome:
    """A non-streamed response: completed if 200 with a normal finish reason on every choice."""
    outcome = Outcome(resp.status_code, False, False, False)
    try:
        payload = resp.json()
    except ValueError:
        outcome.detail = resp.text[:200]
        return outcome
    if resp.status_code == 200:
        reasons = _finish_reasons(payload)
        outcome.completed = bool(reasons) and all(r in ("stop", "length") for r in reasons)
    else:
        outcome.detail = str(payload.get("error", {}).get("code"))
    return outcome


async def run_request(client: httpx.AsyncClient, body: dict, *, stream: bool) -> Outcome:
    """POST /v1/completions and read the whole answer."""
    if stream:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            return await stream_outcome(resp)
    return json_outcome(await client.post("/v1/completions", json=body))
