"""Slow-client defences for uvicorn's h11 protocol: a deadline for the request line and headers.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``), header size
(``h11_max_incomplete_event_size``) and concurrency (``limit_concurrency``), but
not how long a client may take to send its headers: a slowloris client sending
one header byte every few seconds holds a socket forever, and enough of them
exhaust the process's descriptors. The body's deadline is BodyLimitMiddleware's,
which reads every body anyway.
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("cllm.server")


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers are not complete in time.

    The clock starts when the connection opens and again when data arrives after a finished
    response (the next request on a keep-alive connection); a request whose headers are complete
    is never cut by it.
    """

    header_timeout_s: float = 10.0  # set by header_deadline_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_cycle: object = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._armed_cycle = self.cycle  # a new cycle object means a request's headers completed
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_deadline)

    def _on_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._between_requests():
            return  # closed already, or a request is being served (its body has its own deadline)
        if self.cycle is self._armed_cycle:
            prefix = "%s:%d - " % self.client if self.client else ""
            log.info("%sclosing a connection that sent no complete request headers in %.0f s",
                     prefix, self.header_timeout_s)
            self.transport.close()
        else:
            self._arm()  # a request finished since; the next one may be trickling in


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to pass as uvicorn's ``http=``, with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
