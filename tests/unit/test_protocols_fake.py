"""Responses, Messages and reasoning output over a scripted model, through the official clients
against a real uvicorn server: the wire formats, streamed == non-streamed, the response store,
errors naming the field in each protocol's shape, and the API key as x-api-key."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from cllm.server.responses_store import ResponseStore
from tests.unit.fakes import fake_config
from tests.unit.live_server import live_server
from tests.unit.scripted import OPENED_TEMPLATE, PLAIN_TEMPLATE, ScriptedBackend

KEY = "unit-test-key"
THOUGHT = ("<think>", "\nThe user greets me.\n", ("</think>", False), "\n\nHello there!")
CALL = ('<think>Weather needs a tool.</think>\n\nLet me check.\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',)
WEATHER_RESP = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_ANT = {"name": "get_weather", "description": "Weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _config(**overrides):
    return fake_config(n_seq_max=4, n_batch=512, accept_any_model=True, **overrides)


@pytest.fixture(scope="module")
def served():
    backend = ScriptedBackend(slots=4, max_batch_tokens=512)
    with live_server(_config(api_key=KEY), backend) as url:
        yield backend, url


@pytest.fixture()
def oai(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture()
def ant(served):
    return anthropic.Anthropic(base_url=served[1], api_key=KEY, max_retries=0, timeout=30)


def _script(served, *pieces):
    served[0].set_script(*pieces)


# ---- chat completions: reasoning_content ------------------------------------------------------


def test_chat_reasoning_split_streamed_equals_non_streamed(served, oai):
    _script(served, *THOUGHT)
    messages = [{"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model="m", messages=messages).choices[0]
    assert plain.message.content == "Hello there!"
    assert plain.message.model_extra["reasoning_content"] == "The user greets me."
    reasoning = content = ""
    for chunk in oai.chat.completions.create(model="m", messages=messages, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            assert "<" not in (choice.delta.content or "")  # no piece of a marker leaks into content
    assert (reasoning, content) == ("The user greets me.", "Hello there!")
    per_choice: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
    for chunk in oai.chat.completions.create(model="m", messages=messages, stream=True, n=2):
        for choice in chunk.choices:
            per_choice[choice.index][0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            per_choice[choice.index][1] += choice.delta.content or ""
    assert per_choice == {0: ["The user greets me.", "Hello there!"], 1: ["The user greets me.", "Hello there!"]}


def test_chat_tool_call_after_thinking(served, oai):
    _script(served, *CALL)
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER_RESP.items() if k != "type"}}]
    choice = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "weather?"}], tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Weather needs a tool."
    assert choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


# ---- Responses ---------------------------------------------------------------------------------


def test_responses_create_and_stream_agree(served, oai):
    _script(served, *THOUGHT)
    made = oai.responses.create(model="m", input="hi", instructions="Be brief.")
    assert made.status == "completed" and made.object == "response" and made.id.startswith("resp_")
    assert [item.type for item in made.output] == ["reasoning", "message"]
    assert made.output[0].content[0].text == "The user greets me."
    assert made.output_text == "Hello there!"
    assert made.usage.input_tokens > 0 and made.usage.output_tokens > 0
    assert made.usage.output_tokens_details.reasoning_tokens > 0
    with oai.responses.stream(model="m", input="hi", instructions="Be brief.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there!"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == made.output_text and final.output[0].content[0].text == made.output[0].content[0].text


def test_responses_function_call_round_trip_streamed_and_not(served, oai):
    _script(served, *CALL)
    made = oai.responses.create(model="m", input="weather in Paris?", tools=[WEATHER_RESP])
    calls = [item for item in made.output if item.type == "function_call"]
    assert [item.type for item in made.output] == ["reasoning", "message", "function_call"]
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    with oai.responses.stream(model="m", input="weather in Paris?", tools=[WEATHER_RESP]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert [(i.type, getattr(i, "content", None) and i.content[0].text) for i in final.output[:2]] == \
        [(i.type, getattr(i, "content", None) and i.content[0].text) for i in made.output[:2]]
    # The call's output fed back: the model sees it in its prompt.
    _script(served, "It is sunny in Paris.")
    backend = served[0]
    answer = oai.responses.create(model="m", tools=[WEATHER_RESP], input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"},
    ])
    assert answer.output_text == "It is sunny in Paris."
    assert "<|tool|>22 C and sunny" in backend.prompts[-1] and '"name": "get_weather"' in backend.prompts[-1]


def test_responses_previous_response_id_store_get_delete(served, oai):
    backend = served[0]
    _script(served, "Nice to meet you, Ada.")
    first = oai.responses.create(model="m", input="My name is Ada.", instructions="FIRST-INSTRUCTIONS")
    _script(served, "Your name is Ada.")
    second = oai.responses.create(model="m", input="What is my name?", previous_response_id=first.id)
    prompt = backend.prompts[-1]
    assert "My name is Ada." in prompt and "Nice to meet you, Ada." in prompt and "What is my name?" in prompt
    assert "FIRST-INSTRUCTIONS" not in prompt  # instructions are not carried over
    assert second.previous_response_id == first.id
    fetched = oai.responses.retrieve(second.id)
    assert fetched.id == second.id and fetched.output_text == "Your name is Ada."
    items = oai.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"]
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model="m", input="again", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model="m", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


class Person(BaseModel):
    name: str
    age: int


def test_responses_parse_json_schema(served, oai):
    _script(served, '{"name": "Ada", "age": 36}')
    parsed = oai.responses.parse(model="m", input="Who?", text_format=Person)
    assert parsed.output_parsed == Person(name="Ada", age=36)


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),  # image URLs are not fetched unless allow_image_urls
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input[0].type"),
    ({"input": "x", "max_output_tokens": 10 ** 9}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_RESP]}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "temperature": -1}, "temperature"),
])
def test_responses_bad_input_is_400_naming_the_field(served, body, param):
    r = httpx.post(f"{served[1]}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_response_id_is_404(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{served[1]}/v1/responses/resp_nope", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


# ---- Anthropic Messages ------------------------------------------------------------------------


def test_messages_create_and_stream_agree(served, ant):
    _script(served, *THOUGHT)
    made = ant.messages.create(model="m", max_tokens=200, system="Be brief.", messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in made.content] == ["thinking", "text"]
    assert made.content[0].thinking == "The user greets me." and made.content[1].text == "Hello there!"
    assert made.stop_reason == "end_turn" and made.usage.output_tokens > 0 and made.id.startswith("msg_")
    with ant.messages.stream(model="m", max_tokens=200, system="Be brief.",
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == made.content[0].thinking and final.content[1].text == made.content[1].text
    assert final.stop_reason == "end_turn"


def test_messages_tool_use_and_tool_result(served, ant):
    _script(served, *CALL)
    made = ant.messages.create(model="m", max_tokens=200, tools=[WEATHER_ANT],
                               messages=[{"role": "user", "content": "weather in Paris?"}])
    assert made.stop_reason == "tool_use"
    use = [b for b in made.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    with ant.messages.stream(model="m", max_tokens=200, tools=[WEATHER_ANT],
                             messages=[{"role": "user", "content": "weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    _script(served, "Sunny.")
    answer = ant.messages.create(model="m", max_tokens=50, tools=[WEATHER_ANT], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 C"}]},
    ])
    assert answer.content[0].text == "Sunny." and "<|tool|>22 C" in served[0].prompts[-1]


def test_messages_stop_sequence_and_max_tokens(served, ant):
    _script(served, "one two STOP three")
    made = ant.messages.create(model="m", max_tokens=100, stop_sequences=["STOP"], messages=[{"role": "user", "content": "x"}])
    assert (made.stop_reason, made.stop_sequence, made.content[0].text) == ("stop_sequence", "STOP", "one two ")
    short = ant.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert short.stop_reason == "max_tokens"
    with ant.messages.stream(model="m", max_tokens=100, stop_sequences=["STOP"],
                             messages=[{"role": "user", "content": "x"}]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", "STOP", "one two ")


def test_messages_count_tokens_matches_usage(served, ant):
    _script(served, "ok")
    messages = [{"role": "user", "content": "count me"}]
    counted = ant.messages.count_tokens(model="m", system="sys", messages=messages, tools=[WEATHER_ANT])
    made = ant.messages.create(model="m", max_tokens=5, system="sys", messages=messages, tools=[WEATHER_ANT])
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize("body, needle", [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "messages.0.content.0: image is not a PNG"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}},
     "tool_choice.type"),
    ({"model": "m", "max_tokens": 10 ** 9, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
])
def test_messages_errors_in_anthropic_shape(served, body, needle):
    r = httpx.post(f"{served[1]}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert needle in payload["error"]["message"], payload


def test_messages_auth_x_api_key_and_bearer(served):
    url = f"{served[1]}/v1/messages"
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    wrong = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served[1], api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])


# ---- settings: an opened reasoning block, reasoning_parser none ---------------------------------


def test_template_that_opens_the_block_and_parser_none():
    backend = ScriptedBackend(slots=2, max_batch_tokens=512, template=OPENED_TEMPLATE)
    backend.set_script("Thinking first.", ("</think>", False), "\n\nAnswer.")
    with live_server(_config(), backend) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        made = client.responses.create(model="m", input="q")
        assert [i.type for i in made.output] == ["reasoning", "message"]
        assert made.output[0].content[0].text == "Thinking first." and made.output_text == "Answer."
        with client.responses.stream(model="m", input="q") as stream:
            final = stream.get_final_response()
        assert final.output[0].content[0].text == "Thinking first." and final.output_text == "Answer."
    backend = ScriptedBackend(slots=2, max_batch_tokens=512, template=PLAIN_TEMPLATE)
    backend.set_script(*THOUGHT)
    with live_server(_config(reasoning_parser="deepseek_r1"), backend) as url:
        message = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]}).json()
        assert message["choices"][0]["message"]["reasoning_content"] == "The user greets me."
    backend = ScriptedBackend(slots=2, max_batch_tokens=512)
    backend.set_script(*THOUGHT)
    with live_server(_config(reasoning_parser="none"), backend) as url:
        message = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]}).json()
        assert message["choices"][0]["message"]["content"] == "<think>\nThe user greets me.\n</think>\n\nHello there!"
        assert "reasoning_content" not in message["choices"][0]["message"] or \
            message["choices"][0]["message"]["reasoning_content"] is None


# ---- the store's bounds -------------------------------------------------------------------------


def test_store_bounds_count_bytes_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_bytes=10_000, ttl_s=60, clock=lambda: now[0])
    for i in range(3):
        assert store.put({"id": f"r{i}"}, [], [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    store.get("r1")  # used: r2 is now the least recently used
    assert store.put({"id": "r3"}, [], [])
    assert store.get("r2") is None and store.get("r1") is not None
    now[0] = 61.0
    assert store.get("r1") is None and len(store) == 0 and store.bytes_held == 0
    small = ResponseStore(max_entries=100, max_bytes=300, ttl_s=60)
    assert not small.put({"id": "big", "x": "y" * 400}, [], [])
    for i in range(10):
        small.put({"id": f"s{i}", "x": "y" * 50}, [], [])
    assert small.bytes_held <= 300 and small.get("s9") is not None and small.get("s0") is None
    assert store.delete("nope") is False


# ---- a stream that fails midway ----------------------------------------------------------------


def test_streams_that_time_out_end_with_each_protocols_error_event():
    backend = ScriptedBackend(slots=2, max_batch_tokens=512, forward_sleep_s=0.02)
    backend.set_script("word " * 200)
    with live_server(_config(request_timeout_s=0.5), backend) as url:
        with httpx.stream("POST", f"{url}/v1/responses", json={"input": "q", "stream": True}, timeout=30) as r:
            events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
        assert events[0] == "response.created" and events[-2:] == ["response.failed", "error"]
        assert "response.completed" not in events
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIError):
            with client.responses.stream(model="m", input="q") as stream:
                list(stream)
        with httpx.stream("POST", f"{url}/v1/messages", timeout=30,
                          json={"model": "m", "max_tokens": 500, "stream": True, "messages": [{"role": "user", "content": "q"}]}) as r:
            lines = list(r.iter_lines())
        assert lines[0] == "event: message_start" and "event: error" in lines and "event: message_stop" not in lines
        error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "timeout_error"
        ant = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(anthropic.APIError):
            with ant.messages.stream(model="m", max_tokens=500, messages=[{"role": "user", "content": "q"}]) as stream:
                list(stream)
