"""The server's event loop (cllm/server/accept_loop.py): every pending connection is accepted at one
wake-up, over uvloop's transports; a full descriptor table pauses accepting instead of spinning."""
from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from cllm.server import accept_loop
from cllm.server.accept_loop import BatchAcceptServer, new_event_loop

BURST = 60


class _Recorder(asyncio.Protocol):
    """Notes the loop iteration each connection was made in, and echoes what it reads."""

    def __init__(self, made: list[int], ticks: list[int]) -> None:
        self._made = made
        self._ticks = ticks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made.append(self._ticks[0])
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


async def _ticker(ticks: list[int]) -> None:
    while True:
        ticks[0] += 1
        await asyncio.sleep(0)


async def _burst(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Connect BURST clients while the loop cannot run (their handshakes complete in the kernel's accept
    queue), then let it run: the loop iteration each connection_made came in."""
    made: list[int] = []
    ticks = [0]
    server = await loop.create_server(lambda: _Recorder(made, ticks), "127.0.0.1", 0, backlog=256)
    port = server.sockets[0].getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(BURST)]  # blocking: no loop turn
    ticker = asyncio.ensure_future(_ticker(ticks))
    try:
        for _ in range(2000):
            if len(made) == BURST:
                break
            await asyncio.sleep(0.001)
        clients[0].setblocking(False)
        await loop.sock_sendall(clients[0], b"ping")
        echoed = await asyncio.wait_for(loop.sock_recv(clients[0], 4), 5)
        assert echoed == b"ping"  # the connection is the loop's working transport
    finally:
        ticker.cancel()
        for c in clients:
            c.close()
        server.close()
        await server.wait_closed()
    return made


def test_a_burst_of_connections_is_accepted_in_one_wake_up() -> None:
    loop = new_event_loop()
    try:
        made = loop.run_until_complete(_burst(loop))
    finally:
        loop.close()
    assert len(made) == BURST
    # One accept per listening-socket wake-up (stock uvloop) spreads BURST connections over BURST iterations.
    assert max(made) - min(made) <= 1, made


def test_the_server_is_uvloops_when_uvloop_is_installed() -> None:
    pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        server = loop.run_until_complete(loop.create_server(asyncio.Protocol, "127.0.0.1", 0))
        assert isinstance(server, BatchAcceptServer) and server.is_serving()
        server.close()
        loop.run_until_complete(server.wait_closed())
        assert not server.is_serving() and all(s.fileno() == -1 for s in server.sockets)
    finally:
        loop.close()


class _FullTable:
    """A listener whose accept() fails as a process out of descriptors does."""

    def __init__(self) -> None:
        self.calls = 0

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def fileno(self) -> int:
        return -1


def test_out_of_descriptors_pauses_accepting_then_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accept_loop, "ACCEPT_RETRY_S", 0.01)

    async def run() -> tuple[int, bool, bool]:
        loop = asyncio.get_running_loop()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        server = BatchAcceptServer(loop, [listener], asyncio.Protocol, 16)
        await server.start_serving()
        full = _FullTable()
        server._accept(full)  # type: ignore[arg-type]
        paused = server._retry is not None
        await asyncio.sleep(0.05)
        resumed = server._retry is None and server.is_serving()
        server.close()
        return full.calls, paused, resumed

    calls, paused, resumed = asyncio.run(run())
    assert calls == 1  # no busy retry loop on a full descriptor table
    assert paused and resumed


def test_run_eagerly_runs_at_once_then_on_as_what_it_awaits_completes() -> None:
    from cllm.server.accept_loop import run_eagerly

    async def run() -> tuple[list, list]:
        loop = asyncio.get_running_loop()
        gate = loop.create_future()
        log: list = []
        ended: list = []

        async def work() -> None:
            log.append("started")
            log.append(await gate)
            await asyncio.sleep(0)  # a bare yield: on at the next iteration
            raise ValueError("its own failure")

        run_eagerly(loop, work(), ended.append)
        assert log == ["started"]  # in the call itself, not an iteration later as a Task
        gate.set_result("woken")
        for _ in range(5):
            await asyncio.sleep(0)
        return log, ended

    log, ended = asyncio.run(run())
    assert log == ["started", "woken"]
    assert len(ended) == 1 and isinstance(ended[0], ValueError)


def test_run_eagerly_lets_keyboard_interrupt_through_as_a_task_does() -> None:
    from cllm.server.accept_loop import run_eagerly

    async def interrupted() -> None:
        raise KeyboardInterrupt

    ended: list = []
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_eagerly(loop, interrupted(), ended.append)
    finally:
        loop.close()
    assert ended == []  # not reported as the coroutine's own failure
