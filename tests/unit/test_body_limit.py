"""BodyLimitMiddleware: a body's own limit (asked per request) and the bytes all requests hold at once."""
from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from cllm.server.body_limit import BodyLimitMiddleware


def make_app(limit: list[int], in_flight: int, release: asyncio.Event) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        if request.query_params.get("hold"):
            await release.wait()  # a request being served still holds its body
        return JSONResponse({"bytes": len(body)})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    app.add_middleware(BodyLimitMiddleware, limit=lambda: limit[0], in_flight_bytes=in_flight, timeout_s=5.0)
    return app


def test_limit_is_asked_per_request_and_bodies_in_flight_are_bounded():
    async def scenario() -> None:
        limit, release = [3000], asyncio.Event()
        app = make_app(limit, in_flight=5000, release=release)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.post("/echo", content=b"x" * 3000)).json() == {"bytes": 3000}
            big = await client.post("/echo", content=b"x" * 3001)
            assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
            assert "3000 bytes (max_body_bytes)" in big.json()["error"]["message"]
            limit[0] = 4000  # auto: a model that takes images was loaded
            assert (await client.post("/echo", content=b"x" * 3001)).status_code == 200

            held = asyncio.create_task(client.post("/echo?hold=1", content=b"x" * 3000))
            await asyncio.sleep(0.1)  # its 3000 bytes are held while it is served
            busy = await client.post("/echo", content=b"x" * 2001)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "server_busy"
            assert (await client.post("/echo", content=b"x" * 2000)).status_code == 200  # what is left fits
            release.set()
            assert (await held).json() == {"bytes": 3000}
            # every byte was given back: a body of the whole budget's size minus nothing held passes again
            limit[0] = 5000
            assert (await client.post("/echo", content=b"x" * 5000)).status_code == 200

    asyncio.run(scenario())
