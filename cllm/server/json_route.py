"""JSONBodyRoute: a FastAPI route for ``async def endpoint(body: Model, request: Request) -> Response`` that
skips FastAPI's per-request dependency machinery.

FastAPI's handler solves the endpoint's dependency graph on every request (``solve_dependencies``, the body
through a TypeAdapter, its exit stacks and telemetry hooks): with our middlewares and an endpoint that
returns at once that was 200 µs of CPU per request against 52 for the same body parsed and validated in a
bare Starlette route (this 2-core VM; the generation routes' requests each cost the API process's event
loop ~0.8 ms in all). This route reads the body, parses and validates it as FastAPI does, with the same
errors (``RequestValidationError`` with ``("body", ...)`` locations, the same ``json_invalid``, a 400 for a
body that cannot be read), and calls the endpoint. Everything else FastAPI does with the route (the OpenAPI
schema, the error handlers, routing) is its own, unchanged. Only for endpoints that take exactly the body
model and the request and return a Response: anything else is refused when the route is built.
"""
from __future__ import annotations

import email.message
import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_NO_BODY = object()


class JSONBodyRoute(APIRoute):
    """See the module docstring. Used as ``add_api_route(..., route_class_override=JSONBodyRoute)``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        _check_endpoint(self)
        field = self.body_field  # FastAPI's own: the same TypeAdapter, so the same values and errors
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            value = await _body_value(request)
            if value is _NO_BODY:
                raise RequestValidationError([_missing_body()])
            body, errors = field.validate(value, {}, loc=("body",))
            if errors:
                raise RequestValidationError(errors, body=value)
            response = await endpoint(body, request)
            if not isinstance(response, Response):
                raise TypeError(f"{endpoint.__qualname__} returned {type(response).__name__}, not a Response")
            return response
        return handler


def _check_endpoint(route: APIRoute) -> None:
    params = list(inspect.signature(route.endpoint).parameters)
    d = route.dependant
    model = d.body_params[0].field_info.annotation if len(d.body_params) == 1 else None
    if (params != ["body", "request"] or d.body_params[0].name != "body" or d.dependencies or d.query_params
            or d.header_params or d.path_params or d.cookie_params or not isinstance(model, type)
            or not issubclass(model, BaseModel) or route.body_field is None):
        raise TypeError(f"JSONBodyRoute serves endpoints of the form f(body: Model, request: Request) -> Response "
                        f"with Model a pydantic model; {route.endpoint.__qualname__} is not one")


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test: only an application/json or application/*+json body is parsed as JSON (and with no
    Content-Type at all it is not: FastAPI's strict_content_type default)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def _body_value(request: Request) -> Any:
    """The body as FastAPI's handler reads it: parsed JSON, the raw bytes (another Content-Type), or
    _NO_BODY; its errors are FastAPI's (json_invalid, or a 400 for a body that cannot be read)."""
    try:
        raw = await request.body()
        if not raw:
            return _NO_BODY
        return json.loads(raw) if _is_json(request.headers.get("content-type")) else raw
    except json.JSONDecodeError as err:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", err.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": err.msg}}], body=err.doc) from err
    except HTTPException:
        raise
    except Exception as err:  # undecodable bytes, nesting past the interpreter's stack, a broken read
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from err


def _missing_body() -> dict[str, Any]:
    return {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
