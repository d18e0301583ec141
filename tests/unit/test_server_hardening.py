"""Issue 9 defect 12 on the in-process app over the fake backend: /health after the engine died,
lone surrogates, and unhandled errors counted as 500."""
from __future__ import annotations

import inspect
import os
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

import cllm
from cllm.engine.prompt_ids import INLINE_PROMPT_LEN
from cllm.server import routes
from cllm.server.app import _telemetry_settings, create_app
from tests.unit.fakes import FakeBackend, fake_config


def fake_app():
    config = fake_config()
    return create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))


def test_health_is_503_once_the_engine_loop_died():
    with TestClient(fake_app(), base_url="http://localhost") as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine = client.app.state.cllm.loaded.engine

        def broken_step():
            raise RuntimeError("simulated engine bug")
        engine.engine.step = broken_step
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code >= 500
        deadline = time.monotonic() + 10
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
])
def test_lone_surrogate_is_a_400_naming_it(route, body):
    with TestClient(fake_app(), base_url="http://localhost") as client:
        resp = client.post(route, content=body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "surrogate" in resp.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200


def test_unhandled_error_is_counted_as_500_not_499(monkeypatch):
    async def broken_tokenize(request: Request):
        raise RuntimeError("simulated handler bug")
    monkeypatch.setattr(routes, "tokenize", broken_tokenize)
    with TestClient(fake_app(), base_url="http://localhost", raise_server_exceptions=False) as client:
        assert client.post("/tokenize", json={"prompt": "ab"}).status_code == 500
        metrics = client.get("/metrics").text
    assert 'cllm_http_responses_total{code="500",route="/tokenize"} 1.0' in metrics
    assert 'code="499"' not in metrics


# ---- defect 13: auth ------------------------------------------------------------------

def test_api_key_from_env_is_verbatim_and_never_blank():
    from cllm.config import load_config
    assert load_config(environ={"CLLM_API_KEY": "12345"}).server.api_key == "12345"
    assert load_config(environ={"CLLM_API_KEY": "null"}).server.api_key == "null"  # a key, not "no auth"
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="api_key is empty"):
            load_config(environ={"CLLM_API_KEY": blank})


def keyed_app(key: str = "sekrit"):
    config = fake_config(api_key=key)
    return create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/v1/engine"),
])
def test_with_a_key_every_route_but_health_needs_it(method, path):
    with TestClient(keyed_app(), base_url="http://any.host.example") as client:
        resp = client.request(method, path, json={"prompt": "ab", "tokens": [1]})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        good = client.request(method, path, json={"prompt": "ab", "tokens": [1]},
                              headers={"Authorization": "Bearer sekrit"})
        assert good.status_code == 200
        assert client.get("/health").status_code == 200


def test_keyless_server_refuses_foreign_host_headers():
    with TestClient(fake_app(), base_url="http://evil.example") as client:
        resp = client.get("/v1/models")
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "host_not_allowed"
    for base in ("http://localhost:8000", "http://127.0.0.1", "http://[::1]:9000"):
        with TestClient(fake_app(), base_url=base) as client:
            assert client.get("/v1/models").status_code == 200, base
    config = fake_config(allowed_hosts=["llm.internal"])
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    with TestClient(app, base_url="http://llm.internal:8000") as client:
        assert client.get("/v1/models").status_code == 200


# ---- defect 17: tokenising and templating off the event loop -----------------------------

def test_prompts_are_tokenised_and_rendered_off_the_event_loop():
    import threading
    app = fake_app()
    seen: list[str] = []
    with TestClient(app, base_url="http://localhost") as client:
        engine = app.state.cllm.loaded.engine
        inner = engine.engine
        tokenize_prompt, tokenize_chat = inner.tokenize_prompt, inner.tokenize_chat

        def spy_prompt(prompt, *args, **kwargs):
            seen.append((len(prompt), threading.current_thread().name))
            return tokenize_prompt(prompt, *args, **kwargs)

        def spy_chat(*args, **kwargs):
            seen.append(("chat", threading.current_thread().name))
            return tokenize_chat(*args, **kwargs)
        inner.tokenize_prompt, inner.tokenize_chat = spy_prompt, spy_chat
        loop_thread = client.portal.call(lambda: threading.current_thread().name)
        long_text = "ab" * (INLINE_PROMPT_LEN // 2 + 1)  # a longer prompt is tokenised in a worker thread
        assert client.post("/v1/completions", json={"prompt": long_text, "max_tokens": 2}).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                         "max_tokens": 2}).status_code == 200
        assert client.post("/tokenize", json={"messages": [{"role": "user", "content": "ab"}]}).status_code == 200
        # the long prompt and both chat renderings in worker threads; the chat's few rendered ids are
        # checked on the loop, as a short prompt is: the thread's round trip costs more (issue 28)
        assert {(what, thread == loop_thread) for what, thread in seen if what == "chat" or what > INLINE_PROMPT_LEN} \
            == {("chat", False), (len(long_text), False)}
        assert sum(1 for what, _ in seen if what == "chat") == 2
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        assert seen[-1] == (2, loop_thread)


def test_token_lists_detokenize_and_async_chat_stay_off_the_event_loop():
    # Issue 9 defect 17, the rest: long token-id prompts (checked id by id), /detokenize, and AsyncLLM.chat
    # (Jinja + tokenising for Python callers) all run their O(size) work in worker threads.
    import asyncio
    import threading

    import cllm
    from tests.unit.fakes import FakeBackend, fake_config
    app = fake_app()
    seen: list[tuple[str, str]] = []
    with TestClient(app, base_url="http://localhost") as client:
        inner = app.state.cllm.loaded.engine.engine
        tokenize_prompt, decode = inner.tokenize_prompt, inner.tokenizer.decode

        def spy_prompt(*args, **kwargs):
            seen.append(("prompt", threading.current_thread().name))
            return tokenize_prompt(*args, **kwargs)

        def spy_decode(*args, **kwargs):
            seen.append(("decode", threading.current_thread().name))
            return decode(*args, **kwargs)
        inner.tokenize_prompt, inner.tokenizer.decode = spy_prompt, spy_decode
        loop_thread = client.portal.call(lambda: threading.current_thread().name)
        long_ids = [1 + i % 50 for i in range(INLINE_PROMPT_LEN + 1)]
        assert client.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 2}).status_code == 200
        assert client.post("/detokenize", json={"tokens": [1, 2, 3]}).json()["prompt"] == "bcd"
    assert {kind for kind, _ in seen} >= {"prompt", "decode"} and loop_thread not in {t for _, t in seen}

    config = fake_config()
    engine = cllm.AsyncLLM(backend=FakeBackend(slots=1), config=config)
    rendered_in: list[str] = []
    tokenize_chat = engine.engine.tokenize_chat

    def spy_chat(*args, **kwargs):
        rendered_in.append(threading.current_thread().name)
        return tokenize_chat(*args, **kwargs)
    engine.engine.tokenize_chat = spy_chat

    async def chat() -> tuple[str, str]:
        outs = [o async for o in engine.chat([{"role": "user", "content": "ab"}],
                                            cllm.SamplingParams(max_tokens=3, temperature=0))]
        return threading.current_thread().name, outs[-1].outputs[0].finish_reason
    try:
        caller, finish = asyncio.run(chat())
    finally:
        asyncio.run(engine.shutdown())
    assert finish == "length" and rendered_in and caller not in rendered_in


@pytest.mark.parametrize("otel_env", [None, "OTEL_TRACES_EXPORTER"])
def test_fastapi_native_telemetry_runs_only_where_opentelemetry_is_configured(monkeypatch, otel_env):
    """FastAPI's native telemetry (0.16x) asks the global providers on every request whether one is
    configured (~2 % of the event loop at 256 streams): off, unless an OTEL_* variable says the process
    uses OpenTelemetry. A FastAPI without it gets no such argument."""
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)
    if otel_env:
        monkeypatch.setenv(otel_env, "none")
    app = fake_app()
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        assert _telemetry_settings() == {}
    else:
        assert [app._telemetry[k] for k in ("tracing", "metrics", "logs")] == [bool(otel_env)] * 3
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/health").json() == {"status": "ok"}
