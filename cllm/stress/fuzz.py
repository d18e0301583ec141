"""Fuzzing: schemathesis cases from the server's own /openapi.json for every POST route, plus the
hand-written hostile requests; no request may get a 5xx, and the server must still serve after.

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
from schemathesis import GenerationMode

from cllm.stress.hostile import HostileCase, hostile_cases
from cllm.stress.server_process import ServerProcess


@dataclass(slots=True)
class FuzzResult:
    """Figures of one fuzzing run."""

    requests: int = 0  # requests sent
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    server_errors: list[str] = field(default_factory=list)  # "<case>: <status> <body>" of every 5xx or dropped connection
    operations: list[str] = field(default_factory=list)  # the POST routes fuzzed
    still_serves: bool = False  # a normal request succeeded afterwards


def _generated_cases(server: ServerProcess, examples: int, derandomize: bool) -> tuple[list[HostileCase], list[str]]:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
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
                raw = kwargs.get("data") or kwargs.get("content") or b""
                payload = httpx.Request("POST", "http://x", json=body).content if body is not None else raw
                headers = {k: str(v) for k, v in (kwargs.get("headers") or {}).items()
                           if k.lower() in ("content-type", "accept")}
                headers.setdefault("Content-Type", "application/json")
                cases.append(HostileCase(f"{mode.value} {operation.path}", operation.path,
                                         payload if isinstance(payload, bytes) else str(payload).encode(), headers))
            collect()
    return cases, operations


def _send(server: ServerProcess, case: HostileCase) -> tuple[str, int | None, str]:
    try:
        with server.http(timeout=120.0) as client:
            resp = client.post(case.path, content=case.body, headers=case.headers)
        return case.name, resp.status_code, resp.text[:300]
    except httpx.HTTPError as exc:
        return case.name, None, f"{type(exc).__name__}: {exc}"


def run_fuzz(server: ServerProcess, *, examples_per_operation: int = 70, workers: int = 8,
             derandomize: bool = True) -> FuzzResult:
    """Fuzz every POST route in both generation modes, then the hostile cases; count statuses.
    ``derandomize`` makes hypothesis generate the same cases every run (CI); the benchmark varies them."""
    cases, operations = _generated_cases(server, examples_per_operation, derandomize)
    cases += hostile_cases()
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
