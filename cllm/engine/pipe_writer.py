"""LoopPipeWriter: the API process's commands to the engine core, written by the event loop itself.

A command goes out in the call that sends it while the pipe has room; what does not fit waits in a
buffer that the loop writes as the pipe drains (``add_writer``), so the loop never blocks on a core that
is behind. It replaced a sender thread: at 256 streams on the asynchronous-device proxy a command waited
for that thread to get the GIL from the busy event loop 14 ms on average (p90 40 ms) before it was
written, and every such wait was a slot left empty (benchmarks/engine_overhead.py --device-ms 5).

The frames are ``Connection.send_bytes``'s, so the core reads them with ``Connection.recv_bytes``.
What is buffered is bounded by what the API process admits (``max_waiting`` requests, each one
AddRequest; aborts and settles are one per request and per output message).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from cllm.engine.core_protocol import encode, frame

log = logging.getLogger("cllm.engine")
_GONE = (errno.EPIPE, errno.EBADF, errno.ECONNRESET)


class LoopPipeWriter:
    """``LoopPipeWriter(conn)``: writes to ``conn`` from the event loop it is first used on. Sends from
    another thread are handed to that loop; sends before any loop runs are written blocking (start-up)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._fd = conn.fileno()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None  # the loop's thread
        self._pending: deque[memoryview] = deque()  # frames (or their unwritten rest) waiting for room
        self._writing = False  # add_writer is registered
        self.broken = False  # the core's end is gone: nothing more is written
        self._closed = False

    def send(self, message: object) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        if self._closed or self.broken:
            return
        if self._loop is None:
            self._bind()
        if self._loop is None:  # no loop yet (start-up, a worker thread): a plain blocking write
            self._write_blocking(data)
        elif threading.get_ident() == self._thread:
            self._write(memoryview(frame(data)))
        else:
            self._loop.call_soon_threadsafe(self._write, memoryview(frame(data)))

    def backlog(self) -> int:
        """Frames waiting for room in the pipe."""
        return len(self._pending)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is buffered (for at most ``timeout_s``: a core that reads nothing must not hold the
        exit), then close the pipe. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_writing()
        deadline = time.monotonic() + timeout_s
        while self._pending and not self.broken and time.monotonic() < deadline:
            if not self._write_some():
                time.sleep(0.001)
        self._pending.clear()
        self._conn.close()

    def _bind(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._thread = threading.get_ident()
        os.set_blocking(self._fd, False)

    def _write(self, data: memoryview) -> None:
        if self._closed or self.broken:
            return
        self._pending.append(data)
        if not self._writing:
            self._drain()

    def _drain(self) -> None:
        while self._pending and not self.broken:
            if not self._write_some():
                self._start_writing()
                return
        self._stop_writing()

    def _write_some(self) -> bool:
        """Write from the oldest frame; False when the pipe is full."""
        data = self._pending[0]
        try:
            n = os.write(self._fd, data)
        except BlockingIOError:
            return False
        except OSError as err:
            if err.errno not in _GONE:
                raise
            self._gone()
            return True
        if n == len(data):
            self._pending.popleft()
        else:
            self._pending[0] = data[n:]
        return True

    def _write_blocking(self, data: bytes) -> None:
        try:
            self._conn.send_bytes(data)
        except OSError:
            self._gone()

    def _gone(self) -> None:
        self.broken = True
        self._pending.clear()
        self._stop_writing()

    def _start_writing(self) -> None:
        if not self._writing and self._loop is not None:
            self._loop.add_writer(self._fd, self._drain)
            self._writing = True

    def _stop_writing(self) -> None:
        if self._writing and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_writer(self._fd)
        self._writing = False
