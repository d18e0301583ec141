"""Slow- and greedy-client defences for uvicorn's httptools protocol: a deadline and a size bound
for the request line and headers, and a deadline for a response's blocked writes.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and concurrency
(``limit_concurrency``), but not how long a client may take to send its headers: a slowloris client
sending one header byte every few seconds holds a socket forever, and enough of them exhaust the
process's descriptors. Nor, with httptools (the C parser; h11 had ``h11_max_incomplete_event_size``),
how many header bytes it may send: the parser buffers a header line until it ends, so one endless
line grows the process's memory without bound. The body's deadline and size are
BodyLimitMiddleware's, which reads every body anyway.

Nor has uvicorn a write timeout: a client that stops reading leaves its response blocked in the
socket send for as long as it keeps the socket open. stream_stall_timeout_s aborted the engine
request, but the connection, its task and its place under ``max_connections`` stayed (issue 46
item 3: two stalled clients and a cap of 4, and others got 503 until the stalled ones closed).
A connection whose writes stay blocked that long is reset (nginx's ``send_timeout``): closing it
politely would wait to flush a buffer that its client never reads.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from cllm.server.errors import APIError

log = logging.getLogger("cllm.server")


class _HeadersTooLarge(Exception):
    """Raised from a parser callback to stop the request before the app sees it."""


class HeaderLimitsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that closes a connection whose request headers are late or too large.

    Headers are awaited from the moment the connection opens, and again once the previous request's
    body has ended (keep-alive, pipelining). The clock starts with the connection, and for a later
    request with the first bytes after the previous one; it never cuts a request whose headers are
    complete, nor a response in progress. Over ``max_header_bytes`` of headers: 431, then close.
    A response whose writes stay blocked (the transport's buffer over its high-water mark) for
    ``write_timeout_s`` with nothing read by the client meanwhile: the connection is reset.
    """

    header_timeout_s: float = 10.0  # set by header_limits_protocol()
    max_header_bytes: int = 16384  # set by header_limits_protocol()
    write_timeout_s: float | None = None  # set by header_limits_protocol(); None: writes may block for ever

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_headers = True  # the parser is between requests or inside a request's head
        self._header_bytes = 0  # bytes received while awaiting this request's headers
        self._headers_too_large = False  # set when complete headers turn out over the bound
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None  # runs while the transport's buffer is full
        self._write_buffered = 0  # bytes the transport held when the write timer was last armed
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        # Counted before parsing: when one read holds the end of a pipelined request and the start of
        # the next, the next one's share is not counted, so the bound is loose by at most one read.
        if self._awaiting_headers:
            self._header_bytes += len(data)
            self._start_clock()  # also for bytes that start no request (llhttp skips CRLFs between requests)
        super().data_received(data)
        if self._awaiting_headers and self._header_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse_oversized_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_clock()  # a pipelined request that began in the read that ended the previous one

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm()
        # headers that arrived whole in one read were never incomplete at the end of a read: measured here
        if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > self.max_header_bytes:
            self._headers_too_large = True
            raise _HeadersTooLarge  # httptools stops parsing; uvicorn answers through send_400_response
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._headers_too_large:
            self._refuse_oversized_headers()
        else:
            super().send_400_response(msg)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True
        self._header_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the response's sends block from now on."""
        super().pause_writing()
        if self.write_timeout_s is not None and self._write_timer is None:
            self._arm_write_timer(self.write_timeout_s)

    def _arm_write_timer(self, timeout_s: float) -> None:
        self._write_buffered = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(timeout_s, self._on_write_timeout, timeout_s)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_write_timer()

    def _disarm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _on_write_timeout(self, timeout_s: float) -> None:
        self._write_timer = None
        if self.transport.get_write_buffer_size() < self._write_buffered:
            # The client read something (a slow link, not a stalled reader; while paused, nothing is
            # added to the buffer): time it again from now, as nginx's send_timeout does.
            self._arm_write_timer(timeout_s)
            return
        log.warning("%sresetting a connection whose client read nothing for %g s (stream_stall_timeout_s) "
                    "while a response waited", self._client_prefix(), timeout_s)
        # A reset: abort(), not close(), which would flush the buffer first, and no lingering: a socket
        # closed with unsent data stays with the kernel (and open for its client) until the data is
        # read. connection_lost then marks the request disconnected and wakes its blocked send: the
        # response ends (aborting its engine requests), its task ends, its place under max_connections is free.
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _start_clock(self) -> None:
        if self._header_timer is None:
            self._arm()

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._responding():
            self._arm()  # the late headers are pipelined behind a response in progress: never cut it
            return
        log.info("%sclosing a connection that sent no complete request headers in %.0f s",
                 self._client_prefix(), self.header_timeout_s)
        self.transport.close()

    def _refuse_oversized_headers(self) -> None:
        log.info("%sclosing a connection whose request headers passed %d bytes",
                 self._client_prefix(), self.max_header_bytes)
        if not self._responding():  # a 431 in the middle of another response would garble it
            self.transport.write(self._error_response(
                APIError(431, f"request line and headers exceed {self.max_header_bytes} bytes",
                         code="headers_too_large")))
        self.transport.close()

    def _error_response(self, error: APIError) -> bytes:
        """``error`` as a complete HTTP response that closes the connection (written past the app)."""
        body = json.dumps(error.body()).encode()
        head = [STATUS_LINE[error.status]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n", b"\r\n"]
        return b"".join(head) + body

    def _client_prefix(self) -> str:
        return "%s:%d - " % self.client if self.client else ""


def header_limits_protocol(*, header_timeout_s: float, max_header_bytes: int,
                           write_timeout_s: float | None = None) -> type[HeaderLimitsProtocol]:
    """The protocol class to pass as uvicorn's ``http=``, with these deadlines and size bound."""
    return type("HeaderLimitsProtocol", (HeaderLimitsProtocol,),
                {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes,
                 "write_timeout_s": write_timeout_s})
