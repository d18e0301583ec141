"""Every limit on a request's settings holds on every generation route and in both engine modes (issue 46
§2): the server passes prompt ids, and the engine used to skip ``validate_request`` then, so a 5,000-character
stop string passed a cap of 8; in process mode a schema nested 300 deep was a 500 that leaked its place."""
from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cllm.bench.null_backend import NullBackend
from cllm.config import load_config
from cllm.engine.async_llm import AsyncLLM
from cllm.engine.process_engine import ProcessEngine, RestartPolicy
from cllm.server.app import create_app


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


LONG_STOP = "x" * 5000
DEEP = _deep_schema(300)
MESSAGES = [{"role": "user", "content": "hi"}]
# (route, body, the field the 400 must name)
CASES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": [LONG_STOP]}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stop": LONG_STOP}, "stop"),
    ("/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": 4, "stop_sequences": [LONG_STOP]}, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP}}}, "json_schema"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "deep", "schema": DEEP}}}, "json_schema"),
]


@pytest.fixture(scope="module", params=["in-process", "process"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    config = load_config(None, environ={}, n_seq_max=4, max_waiting=4, log_level="warning",
                         max_stop_string_chars=8, accept_any_model=True, engine_process="on" if request.param == "process" else "off")
    backend = functools.partial(NullBackend, slots=4)
    if request.param == "process":
        engine = ProcessEngine(config, backend, restart=RestartPolicy(max_restarts=0))
    else:
        engine = AsyncLLM(config=config, backend=backend())
    with TestClient(create_app(config, engine=engine), base_url="http://localhost") as test_client:
        yield test_client


@pytest.mark.parametrize(("route", "body", "field"), CASES, ids=[f"{r}:{f}" for r, _, f in CASES])
def test_a_limit_is_a_400_naming_the_field_and_holds_nothing(client: TestClient, route: str, body: dict,
                                                             field: str) -> None:
    for _ in range(6):  # more than max_waiting (4): a leaked place would turn the next ones into 429s
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        assert field in response.text and "max_stop_string_chars" in response.text if field == "stop" else True
    stats = client.get("/v1/engine").json()["stats"]
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
