"""OpenAI-style error bodies and the exception handlers that produce them.

Every failure leaves the server as ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status for anything the client got wrong, so OpenAI
clients raise their usual typed exceptions (BadRequestError, RateLimitError …).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cllm.errors import ContextLengthError, EngineDeadError, QueueFullError

log = logging.getLogger("cllm.server")

# How long a client refused for a full queue should wait before retrying.
RETRY_AFTER_S = 1

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
    504: "timeout_error",
}

# SamplingParams and config errors read "invalid <name>=<value>: must be …".
_PARAM_IN_MESSAGE = re.compile(r"invalid (\w+)=")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (the default would call APIError(message)): a 429 raised in the engine core's
        # process (its per-client compile quota) reaches the API process as the same response.
        return _api_error, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(status: int, message: str, type: str, param: str | None, code: str | None,
               headers: dict[str, str]) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, param: str) -> APIError:
    """A 400 unsupported_parameter naming the field."""
    return bad_request(message, param=param, code="unsupported_parameter")


def reject_unsupported(body: Any) -> None:
    """400 unsupported_parameter for the first field the request sets that this server cannot honour."""
    found = body.unsupported()
    if found:
        raise unsupported(found[1], found[0])


def param_from_message(message: str) -> str | None:
    """The parameter a ValueError from SamplingParams names, if it names one."""
    match = _PARAM_IN_MESSAGE.search(message)
    return match.group(1) if match else None


def engine_error(exc: BaseException, *, prompt_param: str = "prompt") -> APIError:
    """Map what engine.generate raises before its first output onto an HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(
            429, f"server busy: {exc}", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"engine unavailable: {exc}", code="engine_unavailable")
    if isinstance(exc, (ValueError, TypeError)):
        message = str(exc)
        return APIError(400, message, param=param_from_message(message))
    log.error("unexpected engine error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def finish_error(finish_reason: str, detail: str | None) -> APIError | None:
    """The error a request ends with when the engine did not finish it normally."""
    if finish_reason == "timeout":
        # The same request would time out again: tell OpenAI clients not to retry it.
        return APIError(504, detail or "request timed out before finishing", code="timeout",
                        headers={"x-should-retry": "false"})
    if finish_reason == "abort":
        return APIError(503, detail or "request aborted by the server", code="aborted")
    if finish_reason == "error":
        return APIError(500, detail or "the engine failed while running this request", code="internal_error")
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if param is None:
        if first.get("type") == "missing":
            return "request body is missing: send a JSON object", None
        # Also what a non-JSON Content-Type (curl's form default) ends up as.
        return f"request body must be a JSON object sent as application/json ({first.get('msg', 'invalid')})", None
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"invalid {param}: {first.get('msg', 'invalid')}{more}", param


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return APIError(400, message, param=param).response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    error = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error.response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error (ours, FastAPI's validation, routing's 404/405, bugs) OpenAI-shaped."""
    app.add_exception_handler(APIError, _on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)
