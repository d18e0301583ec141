"""Slow- and greedy-client defences for uvicorn's httptools protocol: a deadline and a size bound
for the request line and headers.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and concurrency
(``limit_concurrency``), but not how long a client may take to send its headers: a slowloris client
sending one header byte every few seconds holds a socket forever, and enough of them exhaust the
process's descriptors. Nor, with httptools (the C parser; h11 had ``h11_max_incomplete_event_size``),
how many header bytes it may send: the parser buffers a header line until it ends, so one endless
line grows the process's memory without bound. The body's deadline and size are
BodyLimitMiddleware's, which reads every body anyway.
"""
from __future__ import annotations

import asyncio
import json
import logging

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
    """

    header_timeout_s: float = 10.0  # set by header_limits_protocol()
    max_header_bytes: int = 16384  # set by header_limits_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._awaiting_headers = True  # the parser is between requests or inside a request's head
        self._header_bytes = 0  # bytes received while awaiting this request's headers
        self._headers_too_large = False  # set when complete headers turn out over the bound
        self._header_timer: asyncio.TimerHandle | None = None
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
        super().connection_lost(exc)

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


def header_limits_protocol(*, header_timeout_s: float, max_header_bytes: int) -> type[HeaderLimitsProtocol]:
    """The protocol class to pass as uvicorn's ``http=``, with this deadline and size bound."""
    return type("HeaderLimitsProtocol", (HeaderLimitsProtocol,),
                {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes})
