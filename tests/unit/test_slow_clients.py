"""Issue 9 defect 14, the transport half: slowloris and oversized headers, slow bodies and a connection
cap, on a real uvicorn server with cllm's settings (over the fake backend: no model needed)."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cllm.server.app import uvicorn_config
from tests.unit.fakes import FakeBackend, fake_config
from tests.unit.live_server import SlowFakeBackend, live_server

BODY = b'{"prompt": "ab", "max_tokens": 2}'


def connect(base_url: str) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(65536)  # socket.timeout (a test failure) if the server keeps it open
        if not chunk:
            return data
        data += chunk


def test_a_client_trickling_its_headers_is_disconnected():
    config = fake_config(header_read_timeout_s=0.5)
    with live_server(config, FakeBackend(slots=1)) as url:
        sock = connect(url)
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        time.sleep(0.2)
        sock.sendall(b"X-Slow: 1\r\n")  # still no end of headers
        assert read_until_closed(sock, timeout_s=5) == b""
        assert time.monotonic() - start < 3
        sock.close()
        # a normal request is unaffected, also one that is not in a hurry after its headers
        assert httpx.post(f"{url}/v1/completions", content=BODY, headers={"Content-Type": "application/json"},
                          timeout=10).status_code == 200


@pytest.mark.parametrize("pieces", [
    (b"GET /health HTTP/1.1\r\n", b"Host: localhost\r\n", b"X-Slow: 1\r\n"),
    (b"\r\n", b"\r\n", b"\r\n"),  # blank lines start no request (the parser skips them) but are no headers either
], ids=["next-request", "blank-lines"])
def test_a_keep_alive_connection_trickling_its_next_request_is_disconnected(pieces):
    config = fake_config(header_read_timeout_s=0.5, keep_alive_timeout_s=30)
    with live_server(config, FakeBackend(slots=1)) as url:
        sock = connect(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(1)  # idle between requests: the keep-alive timeout's business, not the header clock's
        start = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.1)
        assert read_until_closed(sock, timeout_s=5) == b""
        assert 0.4 < time.monotonic() - start < 3
        sock.close()


def test_headers_trickled_behind_a_stream_do_not_cut_it_but_close_the_connection_after():
    config = fake_config(header_read_timeout_s=0.3, keep_alive_timeout_s=30)
    with live_server(config, SlowFakeBackend(slots=1, step_s=0.1)) as url:
        body = json.dumps({"prompt": "ab", "max_tokens": 10, "ignore_eos": True, "stream": True}).encode()
        sock = connect(url)
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                     + b"GET /health HTTP/1.1\r\n")  # pipelined, in the same read, and never finished
        response = read_until_closed(sock, timeout_s=10)
        sock.close()
        # ten tokens, the finish in a chunk of its own (as OpenAI sends it) and [DONE]
        assert response.count(b"data: ") == 12 and response.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        # ten 0.1 s steps, then the pipelined request's 0.3 s deadline; nothing else closes it this soon
        # (keep-alive 30 s, and read_until_closed would have raised at 10 s)
        assert 1.0 < time.monotonic() - start < 8


def test_oversized_headers_are_refused_and_the_server_carries_on():
    config = fake_config(header_read_timeout_s=30)  # only the size bound can close these connections in time
    limit = config.server.max_header_bytes
    with live_server(config, FakeBackend(slots=1)) as url:
        sock = connect(url)  # just over the bound, one header line that never ends
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * limit)
        response = read_until_closed(sock, timeout_s=5)
        sock.close()
        assert response.startswith(b"HTTP/1.1 431"), response[:200]
        assert b"headers_too_large" in response

        sock = connect(url)  # over it in one complete request, which one read delivers whole
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * limit + b"\r\n\r\n")
        response = read_until_closed(sock, timeout_s=5)
        sock.close()
        assert response.startswith(b"HTTP/1.1 431"), response[:200]

        sock = connect(url)  # far over it: 200 KB of header lines, which a server without the bound answers
        filler = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 100) for i in range(2000))
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" + filler + b"\r\n")
            response = read_until_closed(sock, timeout_s=5)
        except (ConnectionResetError, BrokenPipeError):
            response = b""  # closed with our bytes unread: the kernel's reset drops the 431
        sock.close()
        assert response == b"" or response.startswith(b"HTTP/1.1 431"), response[:200]

        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_the_server_parses_http_with_httptools():
    """The C parser (not uvicorn's pure-Python h11) frames every streamed chunk."""
    uv_config = uvicorn_config(FastAPI(), fake_config())
    uv_config.load()  # resolves ``http=`` to the class uvicorn.Server builds each connection's protocol from
    assert issubclass(uv_config.http_protocol_class, HttpToolsProtocol)


def test_an_idle_connection_that_never_sends_a_request_is_closed():
    config = fake_config(header_read_timeout_s=0.5)
    with live_server(config, FakeBackend(slots=1)) as url:
        sock = connect(url)
        assert read_until_closed(sock, timeout_s=5) == b""
        sock.close()


def test_a_body_that_does_not_arrive_in_time_gets_408():
    config = fake_config(body_read_timeout_s=0.5)
    with live_server(config, FakeBackend(slots=1)) as url:
        sock = connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + BODY[:10])
        response = read_until_closed(sock, timeout_s=5)
        sock.close()
        assert response.startswith(b"HTTP/1.1 408"), response[:200]
        assert b"body_timeout" in response


def open_idle_connection(base_url: str) -> socket.socket:
    """A keep-alive connection that the server has certainly accepted (it answered a request on it),
    now idle: events, not a pause that a busy machine may outlast."""
    sock = connect(base_url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    return sock


def close_and_wait_for_the_server(sock: socket.socket) -> None:
    """Our end of the connection, then the server's: asyncio calls the protocol's connection_lost
    (which gives the connection's place back) before it closes the socket, so the server's FIN
    means the place is free."""
    sock.shutdown(socket.SHUT_WR)
    assert read_until_closed(sock, timeout_s=10) == b""
    sock.close()


def test_connections_beyond_the_cap_get_503_and_the_cap_frees_up():
    config = fake_config(max_connections=3, header_read_timeout_s=30, keep_alive_timeout_s=30)
    with live_server(config, FakeBackend(slots=1)) as url:
        idle = [open_idle_connection(url), open_idle_connection(url)]
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{url}/v1/completions", content=BODY,
                               headers={"Content-Type": "application/json"}).status_code == 503
        for sock in idle:
            close_and_wait_for_the_server(sock)
        assert httpx.post(f"{url}/v1/completions", content=BODY, headers={"Content-Type": "application/json"},
                          timeout=10).status_code == 200


TCP_ESTABLISHED = 1  # tcp_info's first byte: the connection's state (linux/tcp_states.h)


def tcp_state(sock: socket.socket) -> int:
    """The kernel's state of ``sock`` (Linux), read without taking any of its received bytes."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def open_stalled_stream(base_url: str, body: bytes) -> socket.socket:
    """A streamed request whose client reads the response head and then nothing: a small receive
    buffer, so that the server's writes block soon (as behind a slow link)."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="reads the connection's state through Linux's TCP_INFO")
def test_a_stalled_reader_is_disconnected_and_its_place_under_the_cap_freed():
    """Issue 46 item 3: stream_stall_timeout_s aborted a stalled reader's engine request, but its
    response stayed blocked in the socket send (uvicorn has no write timeout), holding the connection,
    its task and its place under max_connections until the client closed: others got 503. Two
    stalled readers under a cap of 3: the third connection is refused until the server resets them."""
    config = fake_config(max_connections=3, stream_stall_timeout_s=2.0, header_read_timeout_s=30,
                         keep_alive_timeout_s=30, max_tokens_limit=1 << 18)
    backend = FakeBackend(slots=4, max_model_len=1 << 18, kv_tokens=1 << 20)  # streams far longer than the buffers
    body = json.dumps({"prompt": "ab", "max_tokens": 200_000, "ignore_eos": True, "stream": True}).encode()
    with live_server(config, backend, sndbuf=16384) as url:
        stalled = [open_stalled_stream(url, body) for _ in range(2)]
        try:
            with httpx.Client(timeout=10) as client:  # while they are stalled, the cap is theirs
                assert client.post(f"{url}/v1/completions", content=BODY,
                                   headers={"Content-Type": "application/json"}).status_code == 503
            deadline = time.monotonic() + 30  # a bound for the failure only: the reset comes ~2 s after the stall
            while any(tcp_state(sock) == TCP_ESTABLISHED for sock in stalled):
                assert time.monotonic() < deadline, "the server kept the stalled connections open"
                time.sleep(0.05)
            assert httpx.post(f"{url}/v1/completions", content=BODY, headers={"Content-Type": "application/json"},
                              timeout=10).status_code == 200
            while backend.held:  # the stalled requests were aborted and gave their slots back
                assert time.monotonic() < deadline, f"slots still held: {backend.held}"
                time.sleep(0.05)
        finally:
            for sock in stalled:
                sock.close()


class _Timer:
    def __init__(self, delay: float, callback, args: tuple) -> None:
        self.delay, self.callback, self.args, self.cancelled = delay, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled
        self.cancelled = True  # done: a timer fires once
        self.callback(*self.args)


class _Loop:
    """Records call_later: the protocol's clocks, fired by the test."""

    def __init__(self) -> None:
        self.timers: list[_Timer] = []

    def call_later(self, delay: float, callback, *args) -> _Timer:
        self.timers.append(_Timer(delay, callback, args))
        return self.timers[-1]

    def write_timers(self) -> list[_Timer]:
        return [t for t in self.timers if t.callback.__name__ == "_on_write_timeout" and not t.cancelled]


class _Transport:
    """A transport whose write buffer the test sets; ``abort()`` recorded."""

    def __init__(self) -> None:
        self.buffered = 0
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default=None):
        return default

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


def _protocol(write_timeout_s: float) -> tuple[HttpToolsProtocol, _Loop, _Transport]:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from cllm.server.slow_clients import header_limits_protocol

    cls = header_limits_protocol(header_timeout_s=30, max_header_bytes=16384, write_timeout_s=write_timeout_s)
    loop, transport = _Loop(), _Transport()
    protocol = cls(config=Config(FastAPI()), server_state=ServerState(), app_state={}, _loop=loop)
    protocol.connection_made(transport)
    return protocol, loop, transport


def test_a_client_that_reads_slowly_is_not_reset_and_one_that_stops_is():
    """The write timeout times a client that reads nothing: one whose reads drain the buffer, however
    slowly (a slow link), is timed again from its last read; one that read nothing since is reset."""
    protocol, loop, transport = _protocol(write_timeout_s=5.0)
    transport.buffered = 100_000
    protocol.pause_writing()  # the buffer is full: the response's sends block
    [timer] = loop.write_timers()
    assert timer.delay == 5.0
    transport.buffered = 90_000  # the client read 10 kB in those 5 s: still below the low-water mark
    timer.fire()
    assert not transport.aborted
    [timer] = loop.write_timers()  # armed again, from now
    timer.fire()  # and nothing read since
    assert transport.aborted


def test_writes_that_resume_stop_the_write_clock():
    protocol, loop, transport = _protocol(write_timeout_s=5.0)
    transport.buffered = 100_000
    protocol.pause_writing()
    transport.buffered = 10_000
    protocol.resume_writing()
    assert loop.write_timers() == [] and not transport.aborted
