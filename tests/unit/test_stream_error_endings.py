"""How Responses and Messages streams end when the request cannot finish (issue 46 §7): in band, with
``response.failed`` + ``error`` (Responses) or ``event: error`` (Messages) — after an engine failure, a
dead engine, and an abort at shutdown — and ``response.incomplete`` at max_output_tokens; and the
Anthropic error types of a 429, a 500 and a 503 outside a stream. Real sockets (uvicorn on a thread)
around the counting fake backend, each failure injected at a forward pass the test chooses."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

import cllm
from cllm.backends.base import BackendError
from cllm.server.app import create_app, uvicorn_config
from tests.unit.fakes import FakeBackend, fake_config
from tests.unit.live_server import free_port

MESSAGES_BODY = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "q"}]}
RESPONSES_BODY = {"model": "m", "input": "q", "max_output_tokens": 200}


class InjectingBackend(FakeBackend):
    """The counting fake; from its ``fail_at``-th forward pass on, a BackendError (``fatal``: a
    RuntimeError, which kills the engine loop); ``hold`` makes every forward wait until it is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(forward_sleep_s=0.005, **kwargs)
        self.fail_at: int | None = None
        self.fatal = False
        self.entered = threading.Event()  # a forward pass has begun
        self.hold = threading.Event()
        self.hold.set()

    def fail_after(self, passes: int, *, fatal: bool = False) -> None:
        self.fail_at, self.fatal = len(self.batches) + passes, fatal

    def forward_batch(self, flat_ids, positions, sequence_ids, **kwargs):
        self.entered.set()
        assert self.hold.wait(30), "the test never let the forward pass go on"
        if self.fail_at is not None and len(self.batches) >= self.fail_at:
            if self.fatal:
                raise RuntimeError("injected fatal error")
            raise BackendError("injected failure", sorted(set(sequence_ids)))
        return super().forward_batch(flat_ids, positions, sequence_ids, **kwargs)


@contextlib.contextmanager
def serving(backend: FakeBackend, **overrides: Any) -> Iterator[tuple[str, cllm.AsyncLLM]]:
    """Serve ``backend`` on a free port; yields the base URL and the engine."""
    config = fake_config(n_seq_max=backend.capacity.max_num_seqs, accept_any_model=True, **overrides)
    config = config.with_overrides(port=free_port(), log_level="warning")
    engine = cllm.AsyncLLM(backend=backend, config=config)
    server = uvicorn.Server(uvicorn_config(create_app(config, engine=engine), config))
    thread = threading.Thread(target=server.run, name="error-endings-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.server.port}", engine
    finally:
        backend.hold.set()
        server.should_exit = True
        thread.join(timeout=15)


def sse(url: str, path: str, body: dict[str, Any], *, on_first_data: Any = None) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed request; ``on_first_data()`` runs when the first text arrives."""
    events: list[tuple[str, dict]] = []
    kind = ""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
                if on_first_data is not None and kind in ("response.output_text.delta", "content_block_delta"):
                    on_first_data()
                    on_first_data = None
    return events


def kinds(events: list[tuple[str, dict]]) -> list[str]:
    return [k for k, _ in events]


def assert_responses_failed(events: list[tuple[str, dict]], code: str, needle: str) -> None:
    assert kinds(events)[0] == "response.created" and kinds(events)[-2:] == ["response.failed", "error"], kinds(events)
    assert not {"response.completed", "response.incomplete"} & set(kinds(events))
    failed = events[-2][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == code and needle in failed["error"]["message"]
    assert events[-1][1]["code"] == code and needle in events[-1][1]["message"]


def assert_messages_error(events: list[tuple[str, dict]], error_type: str, needle: str) -> None:
    assert kinds(events)[0] == "message_start" and kinds(events)[-1] == "error", kinds(events)
    assert "message_stop" not in kinds(events)
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == error_type and needle in error["error"]["message"]


def test_an_engine_failure_mid_stream_ends_each_protocol_with_its_error_event():
    backend = InjectingBackend(slots=2)
    with serving(backend) as (url, _):
        backend.fail_after(4)  # the prefill and a few tokens stream first
        events = sse(url, "/v1/responses", RESPONSES_BODY)
        assert "response.output_text.delta" in kinds(events)
        assert_responses_failed(events, "internal_error", "injected failure")
        backend.fail_after(4)
        events = sse(url, "/v1/messages", MESSAGES_BODY)
        assert "content_block_delta" in kinds(events)
        assert_messages_error(events, "api_error", "injected failure")
        assert backend.held == {}  # the failed requests' slots are free
        backend.fail_at = None  # and the server goes on serving
        assert kinds(sse(url, "/v1/messages", {**MESSAGES_BODY, "max_tokens": 3}))[-1] == "message_stop"


def test_a_dead_engine_ends_open_streams_in_band_and_later_requests_are_503():
    for path, body in (("/v1/responses", RESPONSES_BODY), ("/v1/messages", MESSAGES_BODY)):
        backend = InjectingBackend(slots=2)
        with serving(backend) as (url, _):
            backend.fail_after(4, fatal=True)
            events = sse(url, path, body)
            if path == "/v1/responses":
                assert_responses_failed(events, "engine_unavailable", "injected fatal error")
            else:
                assert_messages_error(events, "overloaded_error", "injected fatal error")
            resp = httpx.post(url + path, json=body, timeout=30)  # the engine is gone: 503
            assert resp.status_code == 503, resp.text
            if path == "/v1/messages":
                assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "overloaded_error"
            else:
                assert resp.json()["error"]["code"] == "engine_unavailable"


def test_an_abort_at_shutdown_ends_each_protocol_with_its_error_event():
    for path, body in (("/v1/responses", RESPONSES_BODY), ("/v1/messages", {**MESSAGES_BODY, "max_tokens": 2000})):
        backend = InjectingBackend(slots=2)
        with serving(backend) as (url, engine):
            # The engine's drain with no grace left (what the server's shutdown does after shutdown_grace_s).
            events = sse(url, path, {**body, "max_output_tokens": 2000} if "input" in body else body,
                         on_first_data=lambda: asyncio.run(engine.shutdown(0.0)))
            if path == "/v1/responses":
                assert_responses_failed(events, "aborted", "")
            else:
                assert_messages_error(events, "overloaded_error", "")
            assert backend.held == {}


def test_a_streamed_response_cut_at_max_output_tokens_ends_with_response_incomplete():
    backend = InjectingBackend(slots=2)
    with serving(backend) as (url, _):
        events = sse(url, "/v1/responses", {**RESPONSES_BODY, "max_output_tokens": 3})
    assert kinds(events)[-1] == "response.incomplete" and "response.completed" not in kinds(events)
    response = events[-1][1]["response"]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 3
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert response["output"][0]["content"][0]["text"] == text != ""


@pytest.mark.parametrize("status", [429, 500, 503])
def test_messages_errors_outside_a_stream_carry_anthropics_type(status: int):
    """429: the client's share taken by its held request; 500: the engine failed the request; 503: the
    engine is dead."""
    backend = InjectingBackend(slots=2)
    with serving(backend, max_sequences_per_client=1) as (url, _):
        if status == 429:
            backend.hold.clear()
            first = threading.Thread(target=httpx.post, args=(url + "/v1/messages",),
                                     kwargs={"json": MESSAGES_BODY, "timeout": 30})
            first.start()
            assert backend.entered.wait(30)  # the first request runs (held): it holds the client's one sequence
        else:
            backend.fail_after(2, fatal=status == 503)
            if status == 503:  # the engine dies under a first request; the next one finds it dead
                httpx.post(url + "/v1/messages", json=MESSAGES_BODY, timeout=30)
        resp = httpx.post(url + "/v1/messages", json=MESSAGES_BODY, timeout=30)
        if status == 429:
            backend.hold.set()
            first.join(30)
        assert resp.status_code == status, resp.text
        expected = {429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}[status]
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == expected, resp.json()
