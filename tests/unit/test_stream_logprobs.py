"""Issue 9 defect 16: streamed logprobs equal non-streamed ones token for token, text held back or not.

The fake tokenizer splits '€' over three tokens (60, 61, 62), so the first two add no text; a stop
string's possible prefix is held back too. Both used to drop those tokens' logprobs from the stream.
"""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import cllm
from cllm.server.app import create_app
from tests.unit.fakes import FakeBackend, fake_config


@pytest.fixture()
def client():
    config = fake_config()
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def sse_chunks(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        data = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_stream_logprobs_equal_non_streamed_across_a_split_character(client):
    body = {"prompt": [57], "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == "gh€"  # 58 'g', 59 'h', then 60 61 62 = '€', then EOS
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    text = ""
    for chunk in sse_chunks(client, "/v1/completions", body):
        for choice in chunk["choices"]:
            text += choice["text"]
            for key in streamed:
                streamed[key] += (choice.get("logprobs") or {}).get(key, [])
    assert text == whole["text"]
    assert streamed == {k: whole["logprobs"][k] for k in streamed}
    # 58, 59 are one character each; 60 and 61 begin '€' and add no text; 62 completes it; EOS after
    assert whole["logprobs"]["text_offset"] == [0, 1, 2, 2, 2, 3]


def test_completion_stream_logprobs_cover_text_held_back_for_a_stop_string(client):
    body = {"prompt": "a", "max_tokens": 6, "temperature": 0, "logprobs": 1, "stop": ["cdx"]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == "bcdefg"
    tokens, offsets = [], []
    for chunk in sse_chunks(client, "/v1/completions", body):
        for choice in chunk["choices"]:
            tokens += (choice.get("logprobs") or {}).get("tokens", [])
            offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    assert tokens == whole["logprobs"]["tokens"] == list("bcdefg")
    assert offsets == whole["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5]


def test_chat_stream_logprobs_equal_non_streamed_across_a_split_character(client):
    body = {"messages": [{"role": "user", "content": "y"}], "max_tokens": 60, "temperature": 0, "logprobs": True}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["message"]["content"].endswith("€")
    streamed = []
    for chunk in sse_chunks(client, "/v1/chat/completions", body):
        for choice in chunk["choices"]:
            streamed += (choice.get("logprobs") or {}).get("content") or []
    assert streamed == whole["logprobs"]["content"]
    assert [e["bytes"] for e in streamed[-4:-1]] == [[0xE2], [0x82], [0xAC]]
    assert streamed[-1]["bytes"] == [] and whole["finish_reason"] == "stop"  # EOS
