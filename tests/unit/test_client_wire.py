"""What clients read (issue 46 §5) over a scripted model: every streamed chunk carries
``finish_reason`` and ``logprobs`` (null until the end), the finish comes in a chunk of its own
with an empty delta, ``system_fingerprint`` has a value, the OpenAI routes answer without /v1,
token counting without generating, and llama-server's /tokenize and /detokenize bodies."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import cllm
from cllm.server.app import create_app
from tests.unit.fakes import fake_config
from tests.unit.live_server import live_server
from tests.unit.scripted import PLAIN_TEMPLATE, ScriptedBackend

KEY = "wire-key"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
CALL = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _app(template: str = PLAIN_TEMPLATE, **overrides):
    config = fake_config(n_seq_max=4, n_batch=512, accept_any_model=True, **overrides)
    backend = ScriptedBackend(slots=4, max_batch_tokens=512, template=template)
    return create_app(config, engine=cllm.AsyncLLM(backend=backend, config=config)), backend


@pytest.fixture(scope="module")
def served():
    app, backend = _app()
    with TestClient(app, base_url="http://localhost") as client:
        yield client, backend


@pytest.fixture(scope="module")
def with_tools():
    from tests.unit.scripted import THINKING_TEMPLATE
    app, backend = _app(THINKING_TEMPLATE)
    with TestClient(app, base_url="http://localhost") as client:
        yield client, backend


def _events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    lines = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _choices(events: list[dict]) -> list[dict]:
    return [c for e in events for c in e["choices"]]


# ---- nullable-but-required fields, in every chunk ------------------------------------------


@pytest.mark.parametrize("logprobs", [False, True])
def test_every_chat_chunk_carries_finish_reason_and_logprobs_and_the_finish_comes_alone(served, logprobs):
    client, backend = served
    backend.set_script("Hello there!")
    body = {"messages": CHAT, "stream": True, "n": 2, "logprobs": logprobs}
    events = _events(client.post("/v1/chat/completions", json=body))
    choices = _choices(events)
    assert all("finish_reason" in c and "logprobs" in c for c in choices)  # null, not absent
    assert all("usage" not in e for e in events)  # optional, and not asked for: absent
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        # OpenAI's ending: the finish alone, with an empty delta; nothing before it finishes.
        assert mine[-1] == {"index": index, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        assert all(c["finish_reason"] is None for c in mine[:-1])
        # Until the finish, every delta has "content" (null when a chunk brings none): clients index it.
        assert all("content" in c["delta"] for c in mine[:-1])
        assert "".join(c["delta"].get("content") or "" for c in mine) == "Hello there!"
        if logprobs:
            assert all(c["logprobs"]["content"] for c in mine[1:-1])


def test_usage_chunk_and_usage_null_when_asked_for(served):
    client, backend = served
    backend.set_script("Hi")
    for route, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "<|assistant|>"})):
        events = _events(client.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}}))
        assert all(e["usage"] is None for e in events[:-1]), route
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3, route


def test_every_completion_chunk_carries_logprobs_and_finish_reason_and_ends_with_an_empty_finish(served):
    client, backend = served
    backend.set_script("Hello")
    for logprobs in (None, 1):
        body = {"prompt": "<|assistant|>", "stream": True, "max_tokens": 50, "logprobs": logprobs}
        choices = _choices(_events(client.post("/v1/completions", json=body)))
        assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices)
        assert choices[-1] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
        assert all(c["finish_reason"] is None for c in choices[:-1])
        assert "".join(c["text"] for c in choices) == "Hello"
        assert all((c["logprobs"] is None) == (logprobs is None) for c in choices[:-1])
    # echo with nothing generated: the echoed prompt, then the finish on its own
    echoed = _choices(_events(client.post("/v1/completions", json={"prompt": "ab", "stream": True, "max_tokens": 0,
                                                                    "echo": True})))
    assert [(c["text"], c["finish_reason"]) for c in echoed] == [("ab", None), ("", "length")]


def test_a_tool_call_stream_ends_with_the_finish_alone(with_tools):
    client, backend = with_tools
    backend.set_script(CALL)
    events = _events(client.post("/v1/chat/completions", json={"messages": CHAT, "tools": TOOLS, "stream": True}))
    choices = _choices(events)
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert all(c["finish_reason"] is None and "finish_reason" in c and "content" in c["delta"] for c in choices[:-1])
    fragments = [t for c in choices for t in c["delta"].get("tool_calls", [])]
    assert fragments[0]["function"] == {"name": "get_weather", "arguments": ""} and fragments[0]["id"]
    assert "name" not in fragments[1]["function"]  # optional fields absent, not null
    assert json.loads("".join(t["function"]["arguments"] for t in fragments)) == {"city": "Paris"}


# ---- system_fingerprint ------------------------------------------------------------------


def test_system_fingerprint_in_every_body_and_chunk_and_stable(served):
    client, backend = served
    backend.set_script("Hi")
    seen = set()
    for route, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "<|assistant|>"})):
        seen.add(client.post(route, json=body).json()["system_fingerprint"])
        seen |= {e["system_fingerprint"] for e in _events(client.post(route, json={**body, "stream": True}))}
    assert len(seen) == 1
    (fingerprint,) = seen
    assert fingerprint.startswith(f"fp_cllm-{cllm.__version__}-") and len(fingerprint) > len("fp_cllm--")


def test_system_fingerprint_follows_the_settings():
    from cllm.config import CllmConfig
    from cllm.server.fingerprint import system_fingerprint
    base = CllmConfig()
    assert system_fingerprint(base) == system_fingerprint(CllmConfig())
    assert system_fingerprint(base) != system_fingerprint(base.with_overrides(type_k="q8_0", flash_attn=True))


# ---- routes without /v1 ------------------------------------------------------------------


def test_openai_routes_answer_without_v1_behind_the_same_key():
    app, backend = _app(api_key=KEY)
    backend.set_script("Hi")
    auth = {"Authorization": f"Bearer {KEY}"}
    calls = [("POST", "/chat/completions", {"messages": CHAT}), ("POST", "/completions", {"prompt": "x"}),
             ("GET", "/models", None), ("POST", "/embeddings", {"input": [1, 2]}),
             ("POST", "/responses", {"input": "hi"}),
             ("POST", "/chat/completions/input_tokens", {"messages": CHAT}),
             ("POST", "/responses/input_tokens", {"input": "hi"})]
    with TestClient(app, base_url="http://any.host.example") as client:
        for method, path, body in calls:
            assert client.request(method, path, json=body).status_code == 401, path
            resp = client.request(method, path, json=body, headers=auth)
            assert resp.status_code == 200, (path, resp.text)
            assert _same_shape(resp.json()) == _same_shape(client.request(method, "/v1" + path, json=body, headers=auth).json())
        assert client.get("/v1/health").json() == {"status": "ok"}  # public, as /health (and llama-server's)
        assert client.post("/messages", json={}, headers=auth).status_code == 404  # Anthropic's clients add /v1
        metrics = client.get("/metrics", headers=auth).text
        for _, path, _ in calls:  # counted under their own route label, not "other"
            assert f'code="200",route="{path}"' in metrics, path


def _same_shape(body: dict) -> dict:
    """``body`` with per-request values (ids, times, vectors) blanked, to compare two routes' answers."""
    def blank(value, key=""):
        if isinstance(value, dict):
            return {k: blank(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [blank(v, key) for v in value]
        return "*" if key in ("id", "created", "created_at", "embedding") else value
    return blank(body)


# ---- counting input tokens ---------------------------------------------------------------


def test_chat_input_tokens_count_the_prompt_the_request_would_run(with_tools):
    client, backend = with_tools
    backend.set_script("Sure.")
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 4}
    admitted = len(backend.prompts)
    counted = client.post("/v1/chat/completions/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "chat.completion.input_tokens"
    assert len(backend.prompts) == admitted  # nothing generated
    ran = client.post("/v1/chat/completions", json=body).json()
    assert counted.json()["input_tokens"] == ran["usage"]["prompt_tokens"]
    without_tools = client.post("/v1/chat/completions/input_tokens", json={"messages": CHAT}).json()["input_tokens"]
    assert without_tools < counted.json()["input_tokens"]  # the tools were rendered in


def test_response_input_tokens_count_the_input_the_response_would_run(with_tools):
    client, backend = with_tools
    backend.set_script("Sure.")
    body = {"input": "hi", "instructions": "Be brief.", "tools": [{"type": "function", **TOOLS[0]["function"]}]}
    admitted = len(backend.prompts)
    counted = client.post("/v1/responses/input_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": counted.json()["input_tokens"]}
    assert len(backend.prompts) == admitted
    made = client.post("/v1/responses", json=body).json()
    assert counted.json()["input_tokens"] == made["usage"]["input_tokens"]
    alone = client.post("/v1/responses/input_tokens", json={"input": "and now?"}).json()["input_tokens"]
    follow_up = {"input": "and now?", "previous_response_id": made["id"]}
    assert client.post("/v1/responses/input_tokens", json=follow_up).json()["input_tokens"] > alone  # the stored turns count


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions/input_tokens", {}, "messages"),
    ("/v1/chat/completions/input_tokens", {"messages": CHAT, "tools": [{"type": "nope"}]}, "tools"),
    ("/v1/chat/completions/input_tokens", {"messages": CHAT, "max_tokens": "many"}, "max_tokens"),
    ("/v1/responses/input_tokens", {"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ("/v1/responses/input_tokens", {"input": 5}, "input"),
])
def test_input_tokens_refuse_a_bad_body_naming_the_field(with_tools, path, body, param):
    client, _ = with_tools
    resp = client.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["param"].split(".")[0] == param, resp.text


# ---- llama-server's /tokenize and /detokenize ----------------------------------------------


def test_tokenize_takes_llama_servers_body(served):
    client, _ = served
    ids = client.post("/tokenize", json={"content": "hi<|user|>"}).json()["tokens"]
    assert ids == client.post("/tokenize", json={"prompt": "hi<|user|>"}).json()["tokens"]
    assert len(ids) == 3  # the marker is one special token, as llama-server's parse_special default
    pieces = client.post("/tokenize", json={"content": "hi<|user|>", "with_pieces": True}).json()["tokens"]
    assert pieces == [{"id": ids[0], "piece": "h"}, {"id": ids[1], "piece": "i"}, {"id": ids[2], "piece": "<|user|>"}]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hi<|user|>", "content": "hi<|user|>"}
    clash = client.post("/tokenize", json={"content": "hi", "add_special": True, "add_special_tokens": False})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "add_special"
    both = client.post("/tokenize", json={"content": "hi", "prompt": "hi"})
    assert both.status_code == 400 and both.json()["error"]["param"] in ("prompt", "content")
    none = client.post("/tokenize", json={})
    assert none.status_code == 400 and none.json()["error"]["param"] == "prompt"


def test_tokenize_add_special_defaults_as_each_body_does():
    """vLLM's ``prompt`` adds BOS unless told not to; llama-server's ``content`` adds it only when asked."""
    from tests.unit.fakes import ByteTokenizer, FakeBackend

    class BosTokenizer(ByteTokenizer):
        bos_token_id = 25  # "z"

        def encode(self, text, *, add_special=True, parse_special=True):
            return [25] * add_special + super().encode(text)

    backend = FakeBackend(slots=2)
    backend._tok = BosTokenizer()
    config = fake_config()
    app = create_app(config, engine=cllm.AsyncLLM(backend=backend, config=config))
    bos = 25
    with TestClient(app, base_url="http://localhost") as client:
        content = client.post("/tokenize", json={"content": "ab"}).json()["tokens"]
        asked = client.post("/tokenize", json={"content": "ab", "add_special": True}).json()["tokens"]
        prompt = client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"]
        assert asked == prompt == [bos, *content] and bos not in content


def test_with_pieces_gives_bytes_for_a_partial_character():
    from cllm.server.token_pieces import token_pieces

    class Bytes:
        def token_bytes(self, token_id):
            return {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"ok"}[token_id]
    assert [p.model_dump() for p in token_pieces(Bytes(), [1, 2, 3])] == [
        {"id": 1, "piece": [0xC3]}, {"id": 2, "piece": [0xA9]}, {"id": 3, "piece": "ok"}]


# ---- the OpenAI client over the stream ------------------------------------------------------


def test_openai_client_reads_the_streams_with_and_without_v1():
    config = fake_config(n_seq_max=4, n_batch=512, accept_any_model=True, api_key=KEY)
    backend = ScriptedBackend(slots=4, max_batch_tokens=512, template=PLAIN_TEMPLATE)
    backend.set_script("Hello there!")
    with live_server(config, backend) as url:
        for base in (f"{url}/v1", url):
            oai = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=30)
            chunks = list(oai.chat.completions.create(model="m", messages=CHAT, stream=True,
                                                      stream_options={"include_usage": True}))
            text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
            finishes = [c.finish_reason for ch in chunks for c in ch.choices]
            assert text == "Hello there!" and finishes[-1] == "stop" and set(finishes[:-1]) == {None}
            assert chunks[-1].usage.completion_tokens == len("Hello there!") + 1
            assert {ch.system_fingerprint for ch in chunks} == {chunks[0].system_fingerprint} != {None}
            completion = list(oai.completions.create(model="m", prompt="<|assistant|>", stream=True, max_tokens=50))
            assert "".join(c.choices[0].text for c in completion) == "Hello there!"
            assert completion[-1].choices[0].finish_reason == "stop"
            assert oai.models.list().data[0].id
