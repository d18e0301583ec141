"""What clients read (issue 46 §5), on a real `cllm serve` of the embedded model: the OpenAI client
reading streams from a base URL without /v1, token counts equal to what the request then runs with
the model's real template, and /tokenize's pieces from the real tokenizer."""
from __future__ import annotations

import json

import openai

# The fixtures are imported so pytest finds them in this module.
from tests.integration.conftest_server import ServerProcess, server  # noqa: F401

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _data(lines: list[str]) -> list[dict]:
    payloads = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_openai_client_streams_from_a_base_url_without_v1(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=server.api_key or "unused", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="", messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    finishes = [c.finish_reason for ch in chunks for c in ch.choices]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-2].choices[0].delta.content is None  # the finish arrives alone
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    fingerprints = {ch.system_fingerprint for ch in chunks}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_cllm-")
    whole = client.chat.completions.create(model="", messages=CHAT, max_tokens=12, temperature=0)
    assert whole.system_fingerprint in fingerprints
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content


def test_raw_completion_chunks_carry_every_required_key(server: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        events = _data(list(resp.iter_lines()))
    choices = [c for e in events for c in e["choices"]]
    assert all(set(c) == {"index", "text", "logprobs", "finish_reason"} for c in choices)
    assert choices[-1] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in e and e["system_fingerprint"] for e in events)


def test_input_tokens_equal_the_prompt_the_request_runs(server: ServerProcess) -> None:
    with server.http() as http:
        for body in ({"messages": CHAT}, {"messages": CHAT, "tools": TOOLS}):
            counted = http.post("/v1/chat/completions/input_tokens", json={**body, "max_tokens": 2})
            assert counted.status_code == 200, counted.text
            ran = http.post("/v1/chat/completions", json={**body, "max_tokens": 2, "temperature": 0}).json()
            assert counted.json() == {"object": "chat.completion.input_tokens",
                                      "input_tokens": ran["usage"]["prompt_tokens"]}
        body = {"input": "Name three colors.", "instructions": "You are terse.", "max_output_tokens": 2}
        counted = http.post("/responses/input_tokens", json=body).json()  # without /v1 too
        made = http.post("/v1/responses", json=body).json()
        assert counted == {"object": "response.input_tokens", "input_tokens": made["usage"]["input_tokens"]}


def test_tokenize_pieces_from_the_real_tokenizer(server: ServerProcess) -> None:
    text = "Hello, café 𝔘"
    with server.http() as http:
        plain = http.post("/tokenize", json={"content": text}).json()["tokens"]
        pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == plain
        raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        assert raw.decode() == text
        assert any(isinstance(p["piece"], list) for p in pieces)  # 𝔘 is split across byte tokens
        assert http.post("/detokenize", json={"tokens": plain}).json()["content"] == text
