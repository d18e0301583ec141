"""Cancel work whose HTTP client has gone away.

A non-streaming request produces no bytes until it is done, so nothing would notice a vanished
client; the work would hold a sequence slot to the end. And uvicorn's httptools protocol speaks ASGI
2.3, whose ``send`` to a closed socket returns quietly, so a stream would not notice either. Here the
work runs in the caller's own task beside one listener task that waits for ``http.disconnect`` and
cancels it — which closes the engine stream, which aborts the request.

One listener per request, no task for the work and no ``asyncio.wait``: Starlette's streaming response
runs an anyio task group for the same (three task group and cancel scope set-ups per request, ~4 % of
the API process's event loop at 256 streams; py-spy, benchmarks/engine_overhead.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read by now, so the next ASGI message is the disconnect
    # (uvicorn sends it as soon as the socket closes).
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def cancelled_if_client_leaves(receive: Receive) -> AsyncIterator[None]:
    """Run the block in the current task; if the client disconnects meanwhile, the block is cancelled
    and ClientDisconnected raised. A disconnect after the block cancels nothing; a cancellation from
    elsewhere (shutdown) passes through as it came."""
    task = asyncio.current_task()
    inside = True

    def client_left(listener: asyncio.Task[None]) -> None:
        if inside and task is not None and not listener.cancelled() and listener.exception() is None:
            task.cancel()

    listener = asyncio.ensure_future(_wait_for_disconnect(receive))
    listener.add_done_callback(client_left)
    try:
        yield
    except asyncio.CancelledError:
        if not listener.done() or listener.cancelled() or listener.exception() is not None:
            raise  # not the client's doing
        if hasattr(task, "uncancel"):  # Python 3.11+ counts cancellations: this one is handled here
            task.uncancel()
        raise ClientDisconnected() from None
    finally:
        inside = False  # set before any await: the listener's callback cannot cancel us past here
        listener.cancel()


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    async with cancelled_if_client_leaves(request.receive):
        return await work
