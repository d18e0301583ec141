"""The chat page at ``/``: three static files shipped in the package (cllm/server/static/), no build step.

The page is served without the API key (it holds no data: it asks the person for the key and sends it
with its API calls, which the key still guards). It is sent with a Content-Security-Policy that allows
only this server's own script, style and API (no inline script, nothing from elsewhere), so even a
rendering mistake could not run injected markup; the renderer itself only ever creates text nodes.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

# path -> (file under cllm/server/static, content type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/static/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(_FILES)  # served without the API key (cllm/server/auth.py)

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new cllm version's page is picked up at once
}


def _static_file(name: str) -> bytes:
    return (resources.files("cllm.server") / "static" / name).read_bytes()


def _endpoint(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=_HEADERS)
    return serve


def page_router() -> APIRouter:
    """GET routes for the page's files, read once when the app is built."""
    router = APIRouter()
    for path, (name, media_type) in _FILES.items():
        router.add_api_route(path, _endpoint(_static_file(name), media_type), methods=["GET"],
                             include_in_schema=False, response_model=None)
    return router
