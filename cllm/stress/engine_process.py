"""Scenarios for the engine core in its own process (``engine_process=on``, issue 46 §1):

- Requests the core cannot take (a JSON schema nested 300 deep failed to pickle after its stream and
  place in max_waiting were registered: HTTP 500, and after max_waiting of them every request got 429):
  each must be a 400 naming the field, and the server must serve on with nothing held.
- SIGTERM to the whole process group (systemd, a container's init, ``kill -- -PGID``) while streams run:
  the core leaves shutdown to the API process, which drains them; every stream completes.
- The core killed mid-stream: its streams end with a clean error, the stats drop its requests at once,
  the supervisor restarts it and the server serves again.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cllm.stress.server_process import ServerProcess
from cllm.stress.sse import Outcome, stream_outcome


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@dataclass(slots=True)
class UnsendableResult:
    """What the unsendable-request scenario saw."""

    statuses: list[int]  # of the unsendable requests
    params: list[str | None]  # the field each 400 named
    after_status: int  # a normal request sent afterwards
    idle: bool  # /v1/engine: nothing running or waiting afterwards


async def run_unsendable(server: ServerProcess, *, count: int) -> UnsendableResult:
    """``count`` chat requests whose response_format schema is nested 300 deep, then a normal one."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(300)}}}
    statuses, params = [], []
    async with server.async_http(timeout=60) as client:
        for _ in range(count):
            resp = await client.post("/v1/chat/completions", json=body)
            statuses.append(resp.status_code)
            params.append(resp.json().get("error", {}).get("param"))
        after = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        stats = (await client.get("/v1/engine")).json()["stats"]
    return UnsendableResult(statuses, params, after.status_code, stats["num_running"] == 0 and stats["num_waiting"] == 0)


def unsendable_failures(r: UnsendableResult) -> list[str]:
    failures = []
    if any(s != 400 for s in r.statuses):
        failures.append(f"unsendable requests answered {sorted(set(r.statuses))}, not 400")
    if any(p != "response_format" and p != "json_schema" for p in r.params):
        failures.append(f"the 400s named {sorted(set(map(str, r.params)))}, not the schema")
    if r.after_status != 200:
        failures.append(f"a normal request afterwards got {r.after_status} (places leaked?)")
    if not r.idle:
        failures.append("the engine still shows requests running or waiting")
    return failures


@dataclass(slots=True)
class GroupSigtermResult:
    """What SIGTERM to the server's process group did to the streams running."""

    outcomes: list[Outcome | str] = field(default_factory=list)  # each stream's end (str: transport error)
    exit_code: int | None = None  # the server's


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int, started: asyncio.Event, counter: list[int],
                  want: int) -> Outcome | str:
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    first = True

    def on_data() -> None:
        nonlocal first
        if first:
            first = False
            counter[0] += 1
            if counter[0] == want:
                started.set()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            return await stream_outcome(resp, on_data=on_data)
    except httpx.HTTPError as exc:
        return f"{i}: {type(exc).__name__}: {exc}"


async def run_group_sigterm(server: ServerProcess, *, streams: int, max_tokens: int) -> GroupSigtermResult:
    """Start ``streams`` streams; once every one has its first token, SIGTERM the server's whole process
    group (the server must lead it: ``start_server(new_session=True)``); read every stream to its end."""
    started, counter = asyncio.Event(), [0]
    async with server.async_http(timeout=300, max_connections=streams + 4) as client:
        tasks = [asyncio.ensure_future(_stream(client, i, max_tokens, started, counter, streams)) for i in range(streams)]
        await asyncio.wait_for(started.wait(), 120)
        os.killpg(os.getpgid(server.proc.pid), signal.SIGTERM)
        outcomes = await asyncio.gather(*tasks)
    exit_code = await asyncio.to_thread(server.proc.wait, 120)
    return GroupSigtermResult(list(outcomes), exit_code)


def group_sigterm_failures(r: GroupSigtermResult) -> list[str]:
    failures = [f"stream {i}: {o if isinstance(o, str) else (o.status, o.detail, o.done)}"
                for i, o in enumerate(r.outcomes) if isinstance(o, str) or not o.completed]
    if r.exit_code != 0:
        failures.append(f"the server exited with {r.exit_code}")
    return failures


def core_pid(server: ServerProcess) -> int:
    """The engine core's process: the server's child started by multiprocessing's spawn."""
    children = [pid for task in Path(f"/proc/{server.proc.pid}/task").iterdir()  # per thread: the loader thread spawned it
                for pid in (task / "children").read_text().split()]
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise RuntimeError(f"no engine core process under pid {server.proc.pid}")


@dataclass(slots=True)
class CoreKillResult:
    """What a SIGKILL of the core did, as clients and /v1/engine saw it."""

    outcomes: list[Outcome | str]  # the streams running at the kill
    running_after_kill: int  # /v1/engine num_running once the streams had ended
    health_during: int  # /health right after the kill
    health_body: dict  # what it said (status engine_restarting / engine_dead, and the reason)
    back_after_s: float | None  # seconds until /health said ok again (None: never within the wait)
    after_status: int  # a normal request once it was back
    new_core: bool  # the core's pid changed
    restarts: int | None  # /v1/engine engine_core.restarts once it was back


async def run_core_kill(server: ServerProcess, *, streams: int, wait_s: float = 120.0) -> CoreKillResult:
    started, counter = asyncio.Event(), [0]
    first_pid = core_pid(server)
    async with server.async_http(timeout=120, max_connections=streams + 4) as client:
        tasks = [asyncio.ensure_future(_stream(client, i, 800, started, counter, streams)) for i in range(streams)]
        await asyncio.wait_for(started.wait(), 120)
        os.kill(first_pid, signal.SIGKILL)
        outcomes = list(await asyncio.gather(*tasks))
        running = (await client.get("/v1/engine")).json()["stats"]["num_running"]
        health = await client.get("/health")
        killed_at = time.monotonic()
        back = None
        while time.monotonic() - killed_at < wait_s:
            if (await client.get("/health")).status_code == 200:
                back = time.monotonic() - killed_at
                break
            await asyncio.sleep(0.2)
        after = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        core = (await client.get("/v1/engine")).json().get("engine_core") or {}
    return CoreKillResult(outcomes, running, health.status_code, health.json(), back, after.status_code,
                          core_pid(server) != first_pid, core.get("restarts"))


def core_kill_failures(r: CoreKillResult) -> list[str]:
    failures = [f"stream {i} did not end with a clean error: {o if isinstance(o, str) else (o.status, o.detail, o.done)}"
                for i, o in enumerate(r.outcomes) if isinstance(o, str) or not (o.error_event and o.done)]
    if r.running_after_kill:
        failures.append(f"/v1/engine still showed {r.running_after_kill} running requests of the dead core")
    if r.health_during != 503:
        failures.append(f"/health answered {r.health_during} while the core was dead or restarting")
    elif r.health_body.get("status") != "engine_restarting" or "SIGKILL" not in r.health_body.get("error", ""):
        failures.append(f"/health did not say the core is restarting and why: {r.health_body}")
    if r.restarts != 1:
        failures.append(f"/v1/engine engine_core.restarts is {r.restarts}, not 1")
    if r.back_after_s is None or not r.new_core:
        failures.append("the core was not restarted")
    if r.after_status != 200:
        failures.append(f"a request after the restart got {r.after_status}")
    return failures
