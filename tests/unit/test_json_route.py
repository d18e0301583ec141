"""JSONBodyRoute answers every body exactly as FastAPI's own route does: the same endpoint on both kinds of
route, the same bytes in, the same status and body out (cllm's error handlers installed, as in the app)."""
from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.responses import Response

from cllm.server.errors import install_error_handlers
from cllm.server.json_route import JSONBodyRoute
from cllm.server.protocol import CompletionRequest


async def echo(body: CompletionRequest, request: Request) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.router.add_api_route("/fastapi", echo, methods=["POST"], response_model=None)
    app.router.add_api_route("/json_route", echo, methods=["POST"], response_model=None, route_class_override=JSONBodyRoute)
    return TestClient(app, raise_server_exceptions=False)


CLIENT = _client()
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "application/vnd.api+json",
                 "text/plain", "application/x-www-form-urlencoded", "application/xml", "multipart/form-data"]
BODIES = [
    b"", b"null", b"[]", b"{}", b"12", b'"text"', b"{", b"{}garbage", b'{"prompt": "hi"}',
    b'{"prompt": "hi", "max_tokens": 8, "temperature": 0.5}', b'{"prompt": "hi", "max_tokens": "many"}',
    b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
    b'{"prompt": [1, 2, 3], "n": 2}', b'{"prompt": "a", "prompt": "b"}', b'{"prompt": "\\ud800"}',
    b'\xef\xbb\xbf{"prompt": "bom"}', '{"prompt": "utf-16"}'.encode("utf-16"), b'{"prompt": "\xff\xfe"}',
    b"[" * 5000 + b"]" * 5000, b'{"prompt": "hi", "unknown_field": 1}', b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi", "max_tokens": 100000000000000000000000000000}', b"prompt=hi&max_tokens=3",
]


def _both(body: bytes, content_type: str | None) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
    headers = {"content-type": content_type} if content_type else {}
    a = CLIENT.post("/fastapi", content=body, headers=headers)
    b = CLIENT.post("/json_route", content=body, headers=headers)
    return (a.status_code, a.content), (b.status_code, b.content)


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
def test_the_same_answer_as_fastapis_route(body: bytes, content_type: str | None) -> None:
    fastapi, ours = _both(body, content_type)
    assert ours == fastapi


def test_a_valid_body_reaches_the_endpoint_validated() -> None:
    status, content = _both(b'{"prompt": "hi", "max_tokens": 8}', "application/json")[1]
    assert status == 200 and json.loads(content)["max_tokens"] == 8


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(st.binary(max_size=64),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                                   lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                                       st.sampled_from(["prompt", "max_tokens", "n", "stop", "temperature", "x"]) | st.text(max_size=4),
                                       inner, max_size=4), max_leaves=8).map(lambda v: json.dumps(v).encode())),
       content_type=st.sampled_from(CONTENT_TYPES))
def test_any_body_gets_the_same_answer(body: bytes, content_type: str | None) -> None:
    fastapi, ours = _both(body, content_type)
    assert ours == fastapi


def test_an_endpoint_of_another_form_is_refused_when_the_route_is_built() -> None:
    async def query_param(body: CompletionRequest, request: Request, limit: int = 3) -> Response:
        return Response()

    app = FastAPI()
    with pytest.raises(TypeError, match="f\\(body: Model, request: Request\\)"):
        app.router.add_api_route("/bad", query_param, methods=["POST"], route_class_override=JSONBodyRoute)
