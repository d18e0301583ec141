"""Releases the model leases a request took (ServerState.model_for) as its response ends, so a model is
never unloaded under a response still streaming, its keep_alive starts when the last ends, and a client
that has read a whole response finds the model idle (free to be evicted for the next model it asks for)."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cllm.server.state import LEASES_KEY


class ModelLeaseMiddleware:
    """Pure ASGI: the leases end the moment the response's last bytes are handed to the server (no other
    request can run in between: the server's send does not suspend after its write), and in any case when
    the request ends (failed, client gone, cancelled). Released at the request's end only, they waited for
    what runs after the last send (a stream's generator closing, the task that streamed it being joined),
    and a request for another model that arrived meanwhile was refused for capacity."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_then_release(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                _release(scope)

        try:
            await self.app(scope, receive, send_then_release)
        finally:
            _release(scope)


def _release(scope: Scope) -> None:
    for lease in scope.get("state", {}).pop(LEASES_KEY, ()):
        lease.release()
