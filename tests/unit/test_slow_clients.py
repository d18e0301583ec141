"""Issue 9 defect 14, the transport half: slowloris headers, slow bodies and a connection cap, on a
real uvicorn server with cllm's settings (over the fake backend: no model needed)."""
from __future__ import annotations

import socket
import time

import httpx

from tests.unit.fakes import FakeBackend, fake_config
from tests.unit.live_server import live_server

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


def test_connections_beyond_the_cap_get_503_and_the_cap_frees_up():
    config = fake_config(max_connections=3, header_read_timeout_s=30)
    with live_server(config, FakeBackend(slots=1)) as url:
        idle = [connect(url), connect(url)]
        time.sleep(0.2)
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{url}/v1/completions", content=BODY,
                               headers={"Content-Type": "application/json"}).status_code == 503
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.post(f"{url}/v1/completions", content=BODY, headers={"Content-Type": "application/json"},
                          timeout=10).status_code == 200
