"""Stalled readers (issue 27 item 2): clients that send long-prompt streamed requests and then read
nothing, against a server whose backend is faster than any socket (``cllm.bench.null_server``: the
real server over a forward pass that costs nothing), so the output outruns the kernel's socket
buffers at once, as it would at GPU speed. The server's send buffers are made small (``sndbuf``) and
the clients' receive buffers too: on loopback the kernel otherwise takes in megabytes per socket
before a write blocks, which at CPU speed hides what a GPU-fast stream does to an unread socket.

What must hold: the server's memory stays bounded (an unread stream keeps one merged pending chunk
per prompt, never one output per step with copies of the prompt), the requests end (finished, or
aborted after ``stream_stall_timeout_s``) and give their slots back, and the server serves others
meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from cllm.bench.server_process import free_port
from cllm.stress.engine_state import engine_state, wait_idle
from cllm.stress.server_process import ServerProcess, launch


RCVBUF_BYTES = 4096


def start_null_server(*settings: str, slots: int = 32, word_bytes: int = 0, sndbuf: int = 0) -> ServerProcess:
    """``python -m cllm.bench.null_server`` on a free port; ``settings``: KEY=VALUE config overrides."""
    port = free_port()
    log_fd, log_name = tempfile.mkstemp(prefix=f"cllm-null-{port}-", suffix=".log")
    os.close(log_fd)
    log_file = open(log_name, "wb")  # noqa: SIM115 - closed by finish_server
    cmd = [sys.executable, "-m", "cllm.bench.null_server", "--port", str(port), "--slots", str(slots),
           "--word-bytes", str(word_bytes), "--sndbuf", str(sndbuf)]
    for item in settings:
        cmd += ["--set", item]
    return launch(cmd, port, log_name, log_file)


@dataclass(slots=True)
class StalledResult:
    """What the scenario measured."""

    streams: int  # stalled streams opened
    prompt_tokens: int  # each one's prompt
    max_tokens: int  # each one's output cap
    rss_start: int  # server RSS before, bytes
    rss_peak: int  # highest RSS seen while they were stalled
    idle_after_s: float | None  # seconds until every request had ended and freed its slot (None: never)
    others_ok: bool  # a normal request sent meanwhile was answered
    bytes_read: int  # what the stalled clients read before they stopped (the response heads)


async def _stall(port: int, body: bytes) -> tuple[asyncio.StreamWriter, int]:
    """Send one streamed request, read its head, then stop reading (the socket stays open)."""
    # A small receive buffer: the server's writes block after a few hundred kilobytes, not the
    # megabytes loopback sockets otherwise take in (a real stalled client on a slow link looks the same).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"stalled request refused: {head[:200]!r}")
    return writer, len(head)


async def run_stalled_readers(server: ServerProcess, *, streams: int = 4, prompt_tokens: int = 4000,
                              max_tokens: int = 20000, timeout_s: float = 60.0) -> StalledResult:
    """Open ``streams`` stalled streams, watch RSS until the engine is idle again, check the server
    still answers, then close them."""
    body = json.dumps({"prompt": [300 + i % 500 for i in range(prompt_tokens)], "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    rss_start = server.rss_bytes()
    writers = []
    try:
        opened = await asyncio.gather(*(_stall(server.port, body) for _ in range(streams)))
        writers = [w for w, _ in opened]
        started = time.monotonic()
        peak = rss_start
        async with server.async_http(timeout=30) as client:
            others = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})
            while time.monotonic() - started < timeout_s:
                peak = max(peak, server.rss_bytes())
                if (await engine_state(client)).idle:
                    break
                await asyncio.sleep(0.1)
            idle = await wait_idle(client, 0.5)
            idle_after = None if idle is None else time.monotonic() - started
            peak = max(peak, server.rss_bytes())
        return StalledResult(streams, prompt_tokens, max_tokens, rss_start, peak, idle_after,
                             others.status_code == 200, sum(n for _, n in opened))
    finally:
        for w in writers:
            w.close()
