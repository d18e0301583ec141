"""Issue 9 defect 14, the queue half: one request or one client cannot fill the waiting queue, and a
client-chosen priority is honoured only when the server allows it."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import cllm
from cllm.server.app import create_app
from tests.unit.fakes import FakeBackend, fake_config


def app_client(**overrides) -> TestClient:
    config = fake_config(**overrides)
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    return TestClient(app, base_url="http://localhost")


def test_one_request_cannot_queue_more_than_its_share_of_sequences():
    with app_client(max_sequences_per_request=4) as client:
        resp = client.post("/v1/completions", json={"prompt": ["ab", "cd", "ef"], "n": 2, "max_tokens": 2})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "too_many_sequences" and "6 sequences" in resp.json()["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "n": 5,
                                                         "max_tokens": 2})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "too_many_sequences"
        many = client.post("/v1/completions", json={"prompt": ["ab"] * 5, "max_tokens": 2})
        assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
        ok = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_client_over_its_share_gets_429_and_its_share_comes_back():
    with app_client(max_sequences_per_client=3) as client:
        quota = client.app.state.cllm.quota
        body = {"prompt": ["ab", "cd"], "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert quota.in_flight("testclient") == 0  # given back when the request ended
        held = quota._acquire("testclient", 2)  # this client already has 2 sequences in flight
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
        assert refused.json()["error"]["code"] == "client_quota_exceeded"
        other = quota._acquire("10.0.0.7", 3)  # another client's share is its own
        other.release()
        held.release()
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert quota.in_flight("testclient") == 0


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "priority": -5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "priority": 3}),
])
def test_client_priority_is_refused_unless_the_server_allows_it(route, body):
    with app_client() as client:
        resp = client.post(route, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
        assert client.post(route, json={**body, "priority": 0}).status_code == 200
    with app_client(allow_client_priority=True, policy="priority") as client:
        assert client.post(route, json=body).status_code == 200
