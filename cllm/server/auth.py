"""Optional API key, checked as a Bearer token on /v1/*."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.requests import Request

from cllm.server.errors import APIError


def api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that refuses requests without ``Authorization: Bearer <api_key>`` (401).

    With no key configured it lets everything through.
    """
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(
                401,
                "invalid or missing API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
