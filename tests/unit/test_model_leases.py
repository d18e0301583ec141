"""ModelLeaseMiddleware: a request's leases end as its response's last bytes are sent, before anything
that runs after them in the request (a stream's generator closing), and in any case when it ends."""
from __future__ import annotations

import asyncio

import pytest

from cllm.server.model_leases import ModelLeaseMiddleware
from cllm.server.state import LEASES_KEY


class Lease:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "state": {}}


async def _receive() -> dict:
    return {"type": "http.disconnect"}


def test_leases_end_when_the_last_bytes_are_sent_not_when_the_request_returns() -> None:
    lease, seen = Lease(), []

    async def app(scope, receive, send) -> None:
        scope["state"].setdefault(LEASES_KEY, []).append(lease)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append(lease.released)  # still streaming: held
        await send({"type": "http.response.body", "body": b"b", "more_body": False})
        seen.append(lease.released)  # the end was sent: released, though the request has not returned
        await asyncio.sleep(0)

    async def send(message) -> None:
        pass

    asyncio.run(ModelLeaseMiddleware(app)(_scope(), _receive, send))
    assert seen == [0, 1] and lease.released == 1  # once, not again at the request's end


def test_leases_end_when_the_request_fails_before_its_response_ends() -> None:
    lease = Lease()

    async def app(scope, receive, send) -> None:
        scope["state"].setdefault(LEASES_KEY, []).append(lease)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the stream broke")

    async def send(message) -> None:
        pass

    with pytest.raises(RuntimeError, match="the stream broke"):
        asyncio.run(ModelLeaseMiddleware(app)(_scope(), _receive, send))
    assert lease.released == 1


def test_a_send_that_fails_still_releases_the_leases() -> None:
    lease = Lease()

    async def app(scope, receive, send) -> None:
        scope["state"].setdefault(LEASES_KEY, []).append(lease)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message) -> None:
        raise OSError("the socket is gone")

    with pytest.raises(OSError):
        asyncio.run(ModelLeaseMiddleware(app)(_scope(), _receive, send))
    assert lease.released == 1
