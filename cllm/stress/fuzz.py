"""Fuzzing: schemathesis cases from the server's own /openapi.json for every POST route (chat,
completions, embeddings, Responses, Messages, count_tokens, tokenize …), plus the hand-written hostile
requests (hostile.py, hostile_protocols.py) and GET / DELETE of unknown response ids; no request may
get a 5xx, and the server must still serve after.

Cases are generated first (hypothesis, sequentially) and sent afterwards from a thread pool, so the
server's slots work in parallel and the run stays short.
"""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from cllm.stress.hostile import HostileCase, hostile_cases
from cllm.stress.hostile_protocols import RouteCase, protocol_hostile_cases, response_id_cases
from cllm.stress.server_process import ServerProcess


@dataclass(slots=True)
class FuzzResult:
    """Figures of one fuzzing run."""

    requests: int = 0  # requests sent
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    server_errors: list[str] = field(default_factory=list)  # "<case>: <status> <body>" of every 5xx or dropped connection
    operations: list[str] = field(default_factory=list)  # the POST routes fuzzed
    still_serves: bool = False  # a normal request succeeded afterwards


# Routes whose positive cases name the served model: Messages requires `model`, so a generated name
# would end every case at the 404 before the conversion, the template and the engine see it.
_SERVED_MODEL_ROUTES = ("/v1/messages", "/v1/responses")


def _served_model(server: ServerProcess) -> str:
    with server.http(timeout=30.0) as client:
        return str(client.get("/v1/models").json()["data"][0]["id"])


def _generated_cases(server: ServerProcess, examples: int, derandomize: bool) -> tuple[list[HostileCase], list[str]]:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    served = _served_model(server)
    cases: list[HostileCase] = []
    operations: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST":
            continue
        operations.append(operation.path)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def collect(case: schemathesis.Case) -> None:
                kwargs = case.as_transport_kwargs(base_url=server.base_url)
                body = kwargs.get("json")
                if (mode is GenerationMode.POSITIVE and isinstance(body, dict) and isinstance(body.get("model"), str)
                        and operation.path.startswith(_SERVED_MODEL_ROUTES)):
                    body = {**body, "model": served}
                raw = kwargs.get("data") or kwargs.get("content") or b""
                payload = httpx.Request("POST", "http://x", json=body).content if body is not None else raw
                headers = {k: str(v) for k, v in (kwargs.get("headers") or {}).items()
                           if k.lower() in ("content-type", "accept")}
                headers.setdefault("Content-Type", "application/json")
                cases.append(HostileCase(f"{mode.value} {operation.path}", operation.path,
                                         payload if isinstance(payload, bytes) else str(payload).encode(), headers))
            try:
                collect()
            except Unsatisfiable:
                # nothing of it can be made invalid (a path parameter that is any string, and no body:
                # POST /v1/models/{name}/load): its positive cases are the test
                if mode is not GenerationMode.NEGATIVE:
                    raise
    return cases, operations


def _send(server: ServerProcess, case: HostileCase | RouteCase) -> tuple[str, int | None, str]:
    method = case.method if isinstance(case, RouteCase) else "POST"
    try:
        with server.http(timeout=120.0) as client:
            resp = client.request(method, case.path, content=case.body or None, headers=case.headers)
        return case.name, resp.status_code, resp.text[:300]
    except httpx.HTTPError as exc:
        return case.name, None, f"{type(exc).__name__}: {exc}"


def run_fuzz(server: ServerProcess, *, examples_per_operation: int = 70, workers: int = 8,
             derandomize: bool = True) -> FuzzResult:
    """Fuzz every POST route in both generation modes, then the hostile cases; count statuses.
    ``derandomize`` makes hypothesis generate the same cases every run (CI); the benchmark varies them."""
    generated, operations = _generated_cases(server, examples_per_operation, derandomize)
    cases: list[HostileCase | RouteCase] = [*generated, *hostile_cases(), *protocol_hostile_cases(),
                                            *response_id_cases()]
    result = FuzzResult(operations=operations)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = list(pool.map(lambda c: _send(server, c), cases))
    statuses: collections.Counter[int] = collections.Counter()
    for name, status, text in outcomes:
        statuses[status or 0] += 1
        if status is None or status >= 500:
            result.server_errors.append(f"{name}: {status} {text}")
    result.requests = len(outcomes)
    result.statuses = dict(statuses)
    with server.http(timeout=60.0) as client:
        ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        result.still_serves = ok.status_code == 200 and client.get("/health").status_code == 200
    return result
