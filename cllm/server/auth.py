"""Optional API key, checked as a Bearer token on every route but /health and the chat page.

Per-route decision (as llama-server with --api-key): only the liveness probe is public. /v1/*,
/tokenize, /detokenize, /metrics (it reveals traffic), /docs and /openapi.json all need the key when
one is configured. The chat page's static files (``/``, cllm/server/chat_page.py) are public: they hold
no data, and the page asks the person for the key and sends it on its API calls. CORS preflights
(OPTIONS) pass so browsers can then send the key.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from cllm.server.chat_page import PAGE_PATHS
from cllm.server.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/v1/health"}) | PAGE_PATHS  # /v1/health: llama-server serves both


class ApiKeyMiddleware:
    """Pure ASGI middleware refusing requests without ``Authorization: Bearer <api_key>`` or
    ``x-api-key: <api_key>`` (401)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        # Anthropic's SDKs (and Claude Code) send the key as `x-api-key`; either header will do.
        x_api_key = headers.get(b"x-api-key")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.expected)) or (
                x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.expected)):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
