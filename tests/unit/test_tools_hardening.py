"""Issue 27 item 3: plain JSON is no tool call; a forced call always parses as one.

Without a model: the parsers, the plan and the streamed path must agree that a reply naming an
undeclared function, or bare JSON data, is content; and a reply the forced-call grammar accepts
(random allowed tokens, as a random-weight model would pick them) always reads back as a call.
"""
from __future__ import annotations

import json
import random

import pytest

from cllm.tools import plan_tools
from cllm.tools.parsers import GenericParser, Llama3JsonParser, MistralParser
from cllm.tools.stream import ToolCallStream

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOTE = {"type": "function", "function": {
    "name": "add_note", "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "priority": {"type": "integer"}, "score": {"type": "number"}}, "required": ["text"]}}}
NO_TOOLS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
LLAMA3_TEMPLATE = "{% for m in messages %}{% if m.role == 'ipython' %}x{% endif %}{{ m.content }}{% endfor %}"
MISTRAL_TEMPLATE = "{{ '[TOOL_CALLS]' }}{% for m in messages %}{{ m.content }}{% endfor %}"

PLAIN_JSON = ['{"name": "Alice", "age": 30}', ' {"name": "get_weather", "city": "Paris", "age": 3}',
              '[{"name": "Alice", "arguments": {}}]', '{"name": "Alice", "arguments": {"x": 1}}']


def _stream(plan, text: str, step: int) -> tuple[str, list]:
    stream = ToolCallStream(plan)
    content = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = stream.finish()
    return content + rest, calls


@pytest.mark.parametrize("template", [NO_TOOLS_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE])
@pytest.mark.parametrize("text", PLAIN_JSON)
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_plain_json_reply_is_content_not_a_call(template, text, step):
    plan = plan_tools([WEATHER], "auto", None, template)
    parsed = plan.parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    assert _stream(plan, text, step) == (text, [])  # the streamed path agrees


def test_generic_needs_its_wrapper_and_a_declared_name():
    assert GenericParser().parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}').tool_calls == []
    assert GenericParser().parse('[{"name": "get_weather", "arguments": {}}]').tool_calls == []
    wrapped = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert [c.name for c in GenericParser({"get_weather"}).parse(wrapped).tool_calls] == ["get_weather"]
    assert GenericParser({"get_time"}).parse(wrapped).tool_calls == []  # undeclared: content
    plan = plan_tools([WEATHER], "auto", None, NO_TOOLS_TEMPLATE)
    assert [c.name for c in plan.parse(wrapped).tool_calls] == ["get_weather"]
    assert _stream(plan, wrapped, 3)[1][0].name == "get_weather"


def test_llama3_and_mistral_calls_of_declared_tools_still_parse():
    llama = plan_tools([WEATHER], "auto", None, LLAMA3_TEMPLATE)
    assert llama.parser.name == "llama3_json"
    call = llama.parse('{"name": "get_weather", "parameters": {"city": "Lima"}}').tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in call] == [("get_weather", {"city": "Lima"})]
    mistral = plan_tools([WEATHER], "auto", None, MISTRAL_TEMPLATE)
    assert mistral.parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]').tool_calls[0].name == "get_weather"
    # An undeclared name anywhere in the list makes the whole reply content.
    text = '[{"name": "get_weather", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]'
    assert mistral.parse(text).tool_calls == [] and mistral.parse(text).content == text
    assert Llama3JsonParser({"x"}).parse('{"name": "get_weather", "parameters": {}}').tool_calls == []
    assert MistralParser().parse('[{"name": "get_weather", "arguments": {}}]').tool_calls  # no request: any name


def test_tool_parameters_are_an_object_schema():
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters.*type \"object\""):
        plan_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "auto", None,
                   NO_TOOLS_TEMPLATE)
    plan = plan_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}], "required", None, NO_TOOLS_TEMPLATE)
    assert plan.forced_schema()["properties"]["tool_calls"]["items"]["properties"]["arguments"] == {"type": "object"}


def test_a_forced_reply_without_a_call_says_why():
    plan = plan_tools([WEATHER], "required", None, NO_TOOLS_TEMPLATE)
    whole = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert plan.missing_call(whole, "stop") is None
    assert "max_tokens" in plan.missing_call(whole[:30], "length")
    assert "stop strings" in plan.missing_call(whole[:30], "stop")
    assert plan_tools([WEATHER], "auto", None, NO_TOOLS_TEMPLATE).missing_call("hello", "stop") is None


class _ByteVocab:
    """Every byte is a token (id = byte value), 256 is EOS: any text the grammar allows can be written."""

    vocab_size = 257
    eos_token_ids = frozenset({256})

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == 256 else bytes([token_id])


_CLOSERS = [ord(c) for c in '"]},0123456789']


def _random_completions(compiled, count: int, max_tokens: int, seed: int) -> list[str]:
    """Texts the grammar completes, each token drawn from those it allows (as a random-weight model
    under the mask picks them; closing characters favoured so that strings end), stopped at EOS."""
    import numpy as np
    import xgrammar as xgr

    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, 257).numpy()
        out = b""
        for _ in range(max_tokens):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:257]).tolist()
            closers = [t for t in allowed if t in _CLOSERS]
            token = rng.choice(closers if closers and rng.random() < 0.3 else allowed)
            assert matcher.accept_token(token)
            if token == 256:
                texts.append(out.decode("utf-8", errors="replace"))
                break
            out += bytes([token])
    return texts


def test_every_reply_the_forced_grammar_completes_parses_as_a_call():
    import xgrammar  # noqa: F401 (the structured extra, which `make test` installs: missing is a failure, not a skip)
    from cllm.sampling.params import SamplingParams
    from cllm.structured.cache import GrammarCache

    anything = {"type": "function", "function": {"name": "anything", "parameters": {}}}
    plan = plan_tools([WEATHER, NOTE, anything], "required", None, NO_TOOLS_TEMPLATE)
    compiled = GrammarCache(_ByteVocab(), 4).get(SamplingParams(json_schema=plan.forced_schema()))
    texts = _random_completions(compiled, count=80, max_tokens=300, seed=7)
    assert len(texts) >= 20  # enough complete replies to mean something
    for text in texts:
        calls = plan.parse(text).tool_calls
        assert calls and all(c.name in ("get_weather", "add_note", "anything") for c in calls), repr(text)
        assert plan.missing_call(text, "stop") is None


# ---- through the chat route, over a scripted model ---------------------------------------------


def _chat_app(script: str):
    from fastapi.testclient import TestClient

    import cllm
    from cllm.server.app import create_app
    from tests.unit.fakes import fake_config
    from tests.unit.scripted import PLAIN_TEMPLATE, ScriptedBackend

    backend = ScriptedBackend(slots=2, max_batch_tokens=512, template=PLAIN_TEMPLATE)  # no tools in it: generic
    backend.set_script(script)
    config = fake_config(n_seq_max=2, n_batch=512, accept_any_model=True)
    return TestClient(create_app(config, engine=cllm.AsyncLLM(backend=backend, config=config)), base_url="http://localhost")


def _chat(client, stream: bool) -> tuple[str | None, list, str]:
    """(content, tool calls as (name, arguments), finish_reason) of one chat reply, streamed or not."""
    body = {"messages": [{"role": "user", "content": "Who?"}], "tools": [WEATHER], "tool_choice": "auto",
            "max_tokens": 80, "stream": stream}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not stream:
        choice = resp.json()["choices"][0]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"], calls, choice["finish_reason"]
    content, names, args, finish = "", [], [], None
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    names.append(call["function"]["name"])
                    args.append("")
                args[-1] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content or None, [(n, json.loads(a)) for n, a in zip(names, args)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_answers_plain_json_as_content(stream):
    reply = '{"name": "Alice", "age": 30}'
    with _chat_app(reply) as client:
        assert _chat(client, stream) == (reply, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_still_reads_a_generic_call(stream):
    with _chat_app('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}') as client:
        assert _chat(client, stream) == (None, [("get_weather", {"city": "Oslo"})], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_short_is_an_error_that_says_why(stream):
    """tool_choice required: a reply that max_tokens cut before the call was complete is a 400 naming
    max_tokens (an error event when streamed), never plain text with no call."""
    with _chat_app('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}') as client:
        body = {"messages": [{"role": "user", "content": "Who?"}], "tools": [WEATHER], "tool_choice": "required",
                "max_tokens": 12, "stream": stream}
        resp = client.post("/v1/chat/completions", json=body)
        if not stream:
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
        else:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
            error = events[-1]["error"]
            assert not any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", []))
        assert error["code"] == "tool_call_incomplete" and error["param"] == "max_tokens" and "max_tokens" in error["message"]
        ok = client.post("/v1/chat/completions", json={**body, "max_tokens": 200, "stream": False})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "tool_calls"
