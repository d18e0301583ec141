"""Host-header allow-list for a server without an API key (DNS-rebinding defence).

A web page on evil.example can make a browser resolve its own name to 127.0.0.1 and then call the
keyless local server with `Host: evil.example` (Ollama's CVE-2024-28224). Refusing Host headers that
are not a loopback name (or a configured `allowed_hosts` entry) stops that. With an API key the key
is the defence and any Host is accepted.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from cllm.server.errors import APIError

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def host_name(header: str) -> str:
    """The host part of a Host header ("example.com:8000" -> "example.com", "[::1]:80" -> "[::1]")."""
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostGuardMiddleware:
    """Pure ASGI middleware answering 403 to a Host header outside the allow-list."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.allowed = LOOPBACK_HOSTS | {h.lower() for h in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/v1/health"):  # probes may use any name
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
        if "*" in self.allowed or host_name(host) in self.allowed:
            await self.app(scope, receive, send)
            return
        error = APIError(403, f"Host {host!r} is not allowed: without an API key only loopback names and "
                              "`allowed_hosts` are served (DNS-rebinding protection)", code="host_not_allowed")
        await error.response()(scope, receive, send)
