"""The server's event loop: uvloop, accepting every pending connection at each wake-up.

libuv (under uvloop) accepts one connection per readiness of the listening socket: strace of the API process
at 256 closed-loop streams showed one ``accept4`` per ``epoll_pwait``, never one that returned EAGAIN. With
the loop busy streaming, each iteration takes milliseconds, so a burst of new connections waits in the kernel's
accept queue one iteration each (``ss -ltn``: 30-150 queued; a request's connect -> ``connection_made`` p50
19-44 ms, p90 126-239 ms; benchmarks/engine_overhead.py --device-ms 5). The slot of the request it replaces
stays empty all that time. asyncio's own selector loop accepts up to ``backlog`` connections per wake-up;
this loop does the same over uvloop's transports: the listening socket is read with ``add_reader``, each
accepted socket becomes a uvloop transport (``connect_accepted_socket``), and TLS or anything but a TCP
listener is left to uvloop as it was.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

log = logging.getLogger("cllm.server")

ACCEPT_BATCH = 256  # connections accepted per wake-up at most; the rest at the next one (the loop's other work runs between)
ACCEPT_RETRY_S = 1.0  # out of descriptors or memory: accepting resumes this much later (asyncio's ACCEPT_RETRY_DELAY)
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BatchAcceptServer(asyncio.AbstractServer):
    """Listening sockets whose connections are accepted ACCEPT_BATCH at a time (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: Iterable[socket.socket],
                 protocol_factory: Callable[[], asyncio.BaseProtocol], backlog: int) -> None:
        self._loop = loop
        self._sockets = tuple(sockets)
        self._factory = protocol_factory
        self._backlog = backlog
        self._serving = False
        self._closed: asyncio.Future[None] = loop.create_future()
        self._retry: asyncio.TimerHandle | None = None

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return self._sockets

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        if self._serving or self._closed.done():
            return
        self._serving = True
        for sock in self._sockets:
            sock.listen(self._backlog)
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def serve_forever(self) -> None:
        await self.start_serving()
        await self.wait_closed()

    def close(self) -> None:
        if self._closed.done():
            return
        self._pause()
        for sock in self._sockets:
            sock.close()
        self._serving = False
        self._closed.set_result(None)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def _pause(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self._sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())

    def _resume(self) -> None:
        self._retry = None
        if not self._closed.done():
            for sock in self._sockets:
                self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # none left (or one that was reset before it was taken)
            except OSError as err:
                if err.errno not in _RESOURCE_ERRORS:
                    raise
                log.error("accepting connections paused for %g s: %s", ACCEPT_RETRY_S, err)
                self._pause()
                self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            conn.setblocking(False)
            self._open(conn)

    def _open(self, conn: socket.socket) -> None:
        try:
            opening = self._loop.connect_accepted_socket(self._factory, conn)
        except Exception:
            conn.close()
            raise
        run_eagerly(self._loop, opening, self._opened)

    @staticmethod
    def _opened(error: BaseException | None) -> None:
        if error is not None and not isinstance(error, asyncio.CancelledError):
            log.error("a connection could not be opened", exc_info=error)


def run_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                done: Callable[[BaseException | None], None]) -> None:
    """Run ``coro`` now up to its first wait, then on as each future it waits for completes; ``done``
    gets its exception (None once it returned). An asyncio Task starts its coroutine an event-loop
    iteration later (Python 3.12's eager tasks do not): uvloop's ``connect_accepted_socket`` sets the
    transport up and schedules ``connection_made`` in its first step, so a task put one more loop
    iteration (~5-10 ms at 256 streams) between every accept and its request."""
    def step(_: object = None) -> None:
        try:
            waited = coro.send(None)
        except StopIteration:
            done(None)
        except (KeyboardInterrupt, SystemExit):
            raise  # (as a Task does)
        except BaseException as err:  # the coroutine's own failure: reported, not raised into the loop
            done(err)
        else:
            if isinstance(waited, asyncio.Future):
                waited.add_done_callback(step)
            else:  # a bare yield (asyncio.sleep(0)): go on at the next iteration
                loop.call_soon(step)
    step()


def _listening_sockets(host: str | list[str] | None, port: int | None, *, family: int, flags: int,
                       reuse_address: bool | None, reuse_port: bool | None) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address ``host``/``port`` resolves to, as asyncio's
    create_server makes them: SO_REUSEADDR on POSIX, IPv6 sockets IPv6-only."""
    hosts = [None] if host in (None, "") else ([host] if isinstance(host, str) else list(host))
    infos = {info for h in hosts for info in socket.getaddrinfo(h, port, family, socket.SOCK_STREAM, 0,
                                                                 flags or socket.AI_PASSIVE)}
    sockets: list[socket.socket] = []
    try:
        for af, kind, proto, _, address in sorted(infos, key=lambda info: info[0]):
            sock = socket.socket(af, kind, proto)
            sockets.append(sock)
            if reuse_address is not False:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if af == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, True)
            sock.bind(address)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def _create_server(loop: asyncio.AbstractEventLoop, protocol_factory: Callable[[], asyncio.BaseProtocol],
                         host: Any, port: int | None, *, family: int, flags: int, sock: socket.socket | None,
                         backlog: int, reuse_address: bool | None, reuse_port: bool | None,
                         start_serving: bool) -> BatchAcceptServer:
    if sock is not None:
        sock.setblocking(False)
        sockets = [sock]
    else:
        sockets = _listening_sockets(host, port, family=family, flags=flags, reuse_address=reuse_address,
                                     reuse_port=reuse_port)
    server = BatchAcceptServer(loop, sockets, protocol_factory, backlog)
    if start_serving:
        await server.start_serving()
    return server


try:
    import uvloop
except ImportError:  # asyncio's own loop accepts in batches already
    uvloop = None

if uvloop is not None:
    class BatchAcceptLoop(uvloop.Loop):  # type: ignore[misc,name-defined]
        """uvloop, except that a plain TCP server accepts its connections in batches (BatchAcceptServer)."""

        async def create_server(self, protocol_factory: Callable[[], asyncio.BaseProtocol], host: Any = None,
                                port: int | None = None, *, family: int = socket.AF_UNSPEC,
                                flags: int = socket.AI_PASSIVE, sock: socket.socket | None = None, backlog: int = 100,
                                ssl: Any = None, reuse_address: bool | None = None, reuse_port: bool | None = None,
                                start_serving: bool = True, **kwargs: Any) -> asyncio.AbstractServer:
            tcp = sock is None or (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM)
            if ssl is not None or kwargs or not tcp:  # TLS (its handshake), options of uvloop's own: uvloop's server
                return await super().create_server(protocol_factory, host, port, family=family, flags=flags, sock=sock,
                                                   backlog=backlog, ssl=ssl, reuse_address=reuse_address,
                                                   reuse_port=reuse_port, start_serving=start_serving, **kwargs)
            return await _create_server(self, protocol_factory, host, port, family=family, flags=flags, sock=sock,
                                        backlog=backlog, reuse_address=reuse_address, reuse_port=reuse_port,
                                        start_serving=start_serving)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The server's loop: BatchAcceptLoop where uvloop is installed, else asyncio's (uvicorn takes it as
    ``loop="cllm.server.accept_loop:new_event_loop"``)."""
    return BatchAcceptLoop() if uvloop is not None else asyncio.new_event_loop()
