"""Issue 27 item 11 through `cllm serve` on the embedded model: the openai client's
``chat.completions.parse`` with a plain pydantic model (an unbounded int, unbounded strings) returns
a parsed object within 120 tokens. Before the default number bounds the reply was
``{"name": "Paris", "country": "FRANCE", "population": 1111111111…`` until max_tokens, and the
client raised LengthFinishReasonError, where llama-server (16-digit integral part) stops."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from cllm.stress.server_process import ServerProcess, finish_server, start_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("--n-seq-max", "2", "--n-ctx", "4096", "--log-level", "info")
    yield srv
    finish_server(srv)


@pytest.mark.parametrize("max_tokens", [120, 300])
def test_parse_with_an_unbounded_int_returns_a_parsed_object(server: ServerProcess, max_tokens: int):
    completion = server.openai().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe the city of Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=max_tokens)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City), choice.message.content
    assert len(str(abs(choice.message.parsed.population))) <= 16
