"""Releases the model leases a request took (ServerState.model_for) once its response has been sent, so a
model is never unloaded under a response still streaming, and its keep_alive starts when the last ends."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from cllm.server.state import LEASES_KEY


class ModelLeaseMiddleware:
    """Pure ASGI: whatever way the request ends (sent, failed, client gone, cancelled), its leases end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in scope.get("state", {}).pop(LEASES_KEY, ()):
                lease.release()
