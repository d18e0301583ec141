"""Stalled readers holding connections (issue 46 item 3): clients that send a streamed request and then
read nothing, against a server with a small connection cap (``max_connections``). stream_stall_timeout_s
aborted their engine requests, but each response stayed blocked in its socket send (uvicorn has no
write timeout), so the connections, their tasks and their places under the cap stayed for as long as
the clients kept the sockets open: with a cap of 4 and two stalled clients, others got 503.

What must hold: while they stall they hold their places (the scenario is real: one more connection
gets 503), after the stall timeout the server resets their connections, and then clients up to the
cap are served (200, not 503) and the engine is idle (their requests aborted, slots freed).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass

import httpx

from cllm.stress.engine_state import wait_idle
from cllm.stress.server_process import ServerProcess
from cllm.stress.stalled import RCVBUF_BYTES

TCP_ESTABLISHED = 1  # tcp_info's first byte: the connection's state (linux/tcp_states.h)


@dataclass(slots=True)
class HeldConnectionsResult:
    """What the scenario measured."""

    cap: int  # the server's max_connections
    stalled: int  # stalled readers opened (cap - 1: one more connection reaches the cap)
    refused_while_stalled: int | None  # status of one more request while they stalled (503 expected)
    reset_after_s: float | None  # seconds from their opening until the server had reset all of them (None: never)
    statuses_after: list[int]  # statuses of the last ``cap - 1`` requests sent at once after the reset
    freed_after_s: float | None  # seconds from the reset until ``cap - 1`` requests at once all got 200 (None: never)
    idle_after_s: float | None  # seconds until the engine was idle after the reset (None: never)


def _established(sock: socket.socket) -> bool:
    """Whether the kernel still holds ``sock`` open, read without taking any of its received bytes (Linux)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == TCP_ESTABLISHED


def _open_stalled(port: int, body: bytes) -> socket.socket:
    """Send one streamed request, read its status line, then read nothing (the socket stays open)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)  # writes block soon, as on a slow link
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status = sock.recv(12)
    if not status.startswith(b"HTTP/1.1 200"):
        sock.close()
        raise RuntimeError(f"stalled request refused: {status!r}")
    return sock


async def run_held_connections(server: ServerProcess, *, cap: int, max_tokens: int = 20000,
                               timeout_s: float = 60.0, free_within_s: float = 5.0) -> HeldConnectionsResult:
    """Open ``cap - 1`` stalled readers on a server started with ``max_connections=cap``, probe the cap,
    wait for the server to reset them, then send ``cap - 1`` requests at once until all are served
    (at most ``free_within_s`` after the reset)."""
    body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    started = time.monotonic()
    stalled = [_open_stalled(server.port, body) for _ in range(cap - 1)]
    try:
        refused = None
        async with server.async_http(timeout=30, max_connections=1) as client:
            try:  # the cap's last place: refused while the stalled readers hold the others
                refused = (await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})).status_code
            except httpx.HTTPError:
                refused = None
        reset_after = None
        while time.monotonic() - started < timeout_s:
            if not any(_established(sock) for sock in stalled):
                reset_after = time.monotonic() - started
                break
            await asyncio.sleep(0.05)
        # The client sees its reset before the server's loop has run the reset connection's ending: its
        # task (the place under the cap) ends an instant later. What must hold is that the places come
        # back promptly, so the batch is retried until all of it is served or ``free_within_s`` passed.
        reset_at = time.monotonic()
        freed = None
        async with server.async_http(timeout=60, max_connections=cap - 1) as client:
            while True:
                replies = await asyncio.gather(
                    *(client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})
                      for _ in range(cap - 1)))
                statuses = [r.status_code for r in replies]
                if all(status == 200 for status in statuses):
                    freed = time.monotonic() - reset_at
                    break
                if time.monotonic() - reset_at > free_within_s:
                    break
                await asyncio.sleep(0.05)
            try:
                idle = await wait_idle(client, timeout_s)
            except ValueError:  # not JSON: /v1/engine refused too (503) while the connections were held
                idle = None
        return HeldConnectionsResult(cap, len(stalled), refused, reset_after, statuses, freed, idle)
    finally:
        for sock in stalled:
            sock.close()


def held_connections_failures(r: HeldConnectionsResult) -> list[str]:
    failures = []
    if r.refused_while_stalled != 503:
        failures.append(f"one more request while {r.stalled} readers stalled got {r.refused_while_stalled}, not 503: "
                        "they did not hold their connections (the scenario tests nothing)")
    if r.reset_after_s is None:
        failures.append("the server kept the stalled readers' connections open")
    if r.freed_after_s is None:
        failures.append(f"requests within the cap after the stall got {r.statuses_after}, not all 200, "
                        "for as long as the scenario waited: the reset connections kept their places")
    if r.idle_after_s is None:
        failures.append("the stalled requests never ended (slots still held)")
    return failures
