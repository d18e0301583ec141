"""`cllm serve --backend torch` with its engine core in a process of its own (server.engine_process=on, what
`auto` picks on CUDA), on the real embedded model: the same greedy text as the in-process engine, streamed
and not; a client that leaves mid-stream has its request aborted in the core; a clean SIGTERM exit. It runs
with --deterministic, which the core reports to the ready lines and /v1/engine."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

import cllm
from tests.integration.conftest_server import ServerProcess, finish_server, start_server

PROMPT = "The capital of France is"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("--backend", "torch", "--n-seq-max", "4", "--n-ctx", "2048", "--log-level", "info",
                       "--set", "dtype=float32", "--set", "engine_process=on", "--deterministic")
    yield srv
    log = finish_server(srv)
    assert "torch on cpu" in log  # the ready lines name the core's backend
    assert "determinism: bitwise, whatever the batch" in log  # ... and what model.deterministic promises there


def _engine_state(server: ServerProcess) -> dict:
    with server.http() as client:
        return client.get("/v1/engine").json()


def test_greedy_text_matches_the_in_process_engine(server: ServerProcess) -> None:
    with cllm.LLM(backend="torch", dtype="float32", n_threads=1, n_ctx=2048, deterministic=True) as llm:
        expected = llm.generate([PROMPT], cllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    with server.http() as client:
        plain = client.post("/v1/completions", json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == expected
        streamed = ""
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        assert streamed == expected
    state = _engine_state(server)
    assert state["stats"]["requests_finished"].get("length", 0) >= 2
    assert state["determinism"]["on"] and state["determinism"]["promised"], state["determinism"]


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(server: ServerProcess) -> None:
    before = _engine_state(server)["stats"]["requests_finished"].get("abort", 0)
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # one token, then the client hangs up
    deadline = time.monotonic() + 20
    while True:
        state = _engine_state(server)
        if state["stats"]["requests_finished"].get("abort", 0) > before and not state["running"]:
            break
        assert time.monotonic() < deadline, f"the request was not aborted: {state}"
        time.sleep(0.2)
